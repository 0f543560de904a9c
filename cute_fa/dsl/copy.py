"""Copies every architecture's kernels make: an fp32 MMA accumulator to a 16-bit shared-memory
tile, a shared-memory tile to global memory in 16-byte row-predicated stores, the address of
one element (for atomics), the transposed view of a tile, and zeroing a tile's rows past
seqused; and the column tail of a tile wider than its tensor (Note [rounded head dims] in
cute_fa/config.py): the widened view, the predicated copy of a row's 16-byte chunks, the zeroing
of the columns past the tensor's."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def row_store_copy(dtype, num_threads: int, cols: int) -> cute.TiledCopy:
    """Register -> global tiled copy of 16 bytes a thread for (rows, cols) tiles of ``dtype``
    over ``num_threads`` threads: a row takes the largest power of two of threads that divides
    its cols / 8 vectors (cols 96: 4 threads, 3 vectors each)."""
    elems = 128 // dtype.width
    threads_per_row = math.gcd(cols // elems, num_threads)
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128),
        cute.make_layout(
            (num_threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1)
        ),
        cute.make_layout((1, elems)),
    )


def elem_ptr(t: cute.Tensor, i: int):
    """Pointer to element ``i`` (a linear index into ``t``'s shape) of a tensor, e.g. for an
    atomic on one element of an accumulator's global partition."""
    return t.iterator + cute.crd2idx(cute.idx2crd(i, t.shape), t.layout)


@cute.jit
def acc_to_smem(acc: cute.Tensor, tiled_mma, sX: cute.Tensor, tidx: Int32):
    """Convert ``acc`` (this thread's part of an accumulator of ``tiled_mma``) to ``sX``'s
    element type and write it into ``sX`` in the MMA's C layout. The caller orders the writes
    against other readers of ``sX`` (a barrier before and after)."""
    dtype = sX.element_type
    rX = cute.make_fragment_like(acc, dtype)
    rX.store(acc.load().to(dtype))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)
    r2s = cute.make_tiled_copy_C(atom, tiled_mma)
    thr_r2s = r2s.get_slice(tidx)
    cute.copy(r2s, thr_r2s.retile(rX), thr_r2s.partition_D(sX))


@cute.jit
def store_rows(
    sX: cute.Tensor,
    gX: cute.Tensor,
    rows_left: Int32,
    copy_r2g: cute.TiledCopy,
    tidx: Int32,
    cols: cutlass.Constexpr[int | None] = None,
):
    """Copy the shared-memory tile ``sX`` to the global tile ``gX`` (same static shape) through
    registers, ``copy_r2g`` deciding each thread's 16-byte pieces; rows at or past ``rows_left``
    are not written (they belong to no sequence, or to the next one), nor, with ``cols``, the
    pieces of columns at or past ``cols`` (a tile wider than its tensor, ``widen_cols``)."""
    thr_r2g = copy_r2g.get_slice(tidx)
    tXsX = thr_r2g.partition_S(sX)
    tXgX = thr_r2g.partition_D(gX)
    # Linear row indices also for a hierarchical row mode (packed GQA's (G, rows)).
    tXcX = thr_r2g.partition_D(cute.make_identity_tensor(cute.product_each(gX.shape)))
    tXrX = cute.make_fragment_like(tXgX, sX.element_type)
    cute.autovec_copy(tXsX, tXrX)
    for m in cutlass.range_constexpr(cute.size(tXgX.shape[1])):
        if tXcX[0, m, 0][0] < rows_left:
            copy_cols(copy_r2g, tXrX, tXgX, tXcX, m, cols)


def widen_cols(t: cute.Tensor, cols: int) -> cute.Tensor:
    """``t`` (its last mode the columns, static) viewed ``cols`` columns wide, strides kept: the
    tile-shaped view a kernel partitions when its tile is wider than the tensor's rows (Note
    [rounded head dims] in cute_fa/config.py). No data moves; the kernel never touches the
    columns past the tensor's own (``copy_cols`` skips them)."""
    if cute.size(t.shape[-1]) == cols:
        return t
    shape = (*t.shape[:-1], cols)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=t.stride))


@cute.jit
def copy_cols(
    atom: cute.TiledCopy,
    tXsrc: cute.Tensor,
    tXdst: cute.Tensor,
    tXcX: cute.Tensor,
    m: cutlass.Constexpr[int],
    cols: cutlass.Constexpr[int | None],
):
    """Copy row ``m`` of a thread's (V, M, K) partitions, ``tXcX`` its identity partition; with
    ``cols``, each 16-byte piece (a K index) only where its columns lie below ``cols`` (the
    column tail of a tile wider than its tensor)."""
    if cutlass.const_expr(cols is None):
        cute.copy(atom, tXsrc[None, m, None], tXdst[None, m, None])
    else:
        for k in cutlass.range_constexpr(cute.size(tXsrc.shape[2])):
            if tXcX[0, m, k][1] < cols:
                cute.copy(atom, tXsrc[None, m, k], tXdst[None, m, k])


@cute.jit
def col_predicate(tXcX: cute.Tensor, cols: cutlass.Constexpr[int]) -> cute.Tensor:
    """Predicate of a thread's (V, M, K) copy partition (``tXcX`` its identity partition) for
    ``cute.copy(..., pred=)``: each 16-byte piece whose columns lie below ``cols``, the same for
    every row (a (1, M, K) Boolean tensor of K values, rows broadcast)."""
    num_k = cute.size(tXcX.shape[2])
    pred = cute.make_rmem_tensor(
        cute.make_layout((1, cute.size(tXcX.shape[1]), num_k), stride=(0, 0, 1)), cutlass.Boolean
    )
    for k in cutlass.range_constexpr(num_k):
        pred[0, 0, k] = tXcX[0, 0, k][1] < cols
    return pred


@cute.jit
def zero_cols(tXsX: cute.Tensor, tXcX: cute.Tensor, cols: cutlass.Constexpr[int]):
    """Zero a thread's 16-byte pieces of a partitioned (V, M, K) shared-memory tile whose
    columns lie at or past ``cols`` (``tXcX`` its identity partition): the padded columns of a
    tile wider than its tensor, which no predicated load writes (Note [rounded head dims])."""
    for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
        for k in cutlass.range_constexpr(cute.size(tXsX.shape[2])):
            if tXcX[0, m, k][1] >= cols:
                tXsX[None, m, k].fill(0)


def transposed(t: cute.Tensor) -> cute.Tensor:
    """The same elements with the first two modes swapped: a (rows, cols, ...) tile viewed as
    (cols, rows, ...) (an ldmatrix.trans operand on sm80; on sm90 a K-major WGMMA operand viewed
    MN-major for the other GEMM)."""
    modes = [1, 0] + list(range(2, cute.rank(t.layout)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def tma_views(
    mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor
) -> tuple[cute.Tensor, cute.Tensor, cute.Tensor]:
    """The forward protocol's (batch, seqlen, heads, d) Q, K, V as the TMA loads of the sm90 and
    sm100 forwards take them: Q and K as (seqlen, d, heads, batch), V^T as
    (dv, seqlen, heads, batch). Views only: no data moves."""
    mQ_t = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
    mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
    mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
    return mQ_t, mK_t, mVt


@cute.jit
def zero_rows_from(tile: cute.Tensor, valid: Int32, first: Int32, threads: cutlass.Constexpr[int]):
    """Zero rows [valid, rows) of a (rows, cols) shared-memory tile (any layout, swizzled too):
    ``threads`` threads, this one numbered ``first``, take every threads-th element. Rows past
    seqused are not inputs and may hold NaN, which 0 * NaN in a GEMM would spread. The caller
    fences (fence.proxy.async: WGMMA and tcgen05 MMAs read through the async proxy) and
    synchronizes the threads before any GEMM reads the tile."""
    cols = cute.size(tile.shape[1])
    rows = cute.size(tile.shape[0])
    for idx in cutlass.range(first, (rows - valid) * cols, threads, unroll=1):
        tile[valid + idx // cols, idx % cols] = tile.element_type(0.0)
