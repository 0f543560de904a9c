"""Copies every architecture's kernels make: an fp32 MMA accumulator to a 16-bit shared-memory
tile, a shared-memory tile to global memory in 16-byte row-predicated stores, the address of
one element (for atomics), the transposed view of a tile, and zeroing a tile's rows past
seqused."""

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
    sX: cute.Tensor, gX: cute.Tensor, rows_left: Int32, copy_r2g: cute.TiledCopy, tidx: Int32
):
    """Copy the shared-memory tile ``sX`` to the global tile ``gX`` (same static shape) through
    registers, ``copy_r2g`` deciding each thread's 16-byte pieces; rows at or past ``rows_left``
    are not written (they belong to no sequence, or to the next one)."""
    thr_r2g = copy_r2g.get_slice(tidx)
    tXsX = thr_r2g.partition_S(sX)
    tXgX = thr_r2g.partition_D(gX)
    # Linear row indices also for a hierarchical row mode (packed GQA's (G, rows)).
    tXcX = thr_r2g.partition_D(cute.make_identity_tensor(cute.product_each(gX.shape)))
    tXrX = cute.make_fragment_like(tXgX, sX.element_type)
    cute.autovec_copy(tXsX, tXrX)
    for m in cutlass.range_constexpr(cute.size(tXgX.shape[1])):
        if tXcX[0, m, 0][0] < rows_left:
            cute.copy(copy_r2g, tXrX[None, m, None], tXgX[None, m, None])


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
