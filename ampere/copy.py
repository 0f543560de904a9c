"""sm80 copy helpers shared by the forward and backward kernels: tiled copies, row-predicated
loads and stores (column-predicated too for a tile wider than its tensor, Note [rounded head
dims] in cute_fa/config.py), and staging an accumulator tile through shared memory."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from cute_fa.dsl.copy import acc_to_smem, copy_cols, store_rows, zero_cols


def smem_layout(dtype, rows: int, cols: int, stages: int | None = None):
    """Swizzled shared-memory layout of a (rows, cols) 16-bit tile: 8-row atoms 64 (or 32) columns
    wide, so 128-bit cp.async writes and ldmatrix reads are both free of bank conflicts."""
    kblock = 64 if cols % 64 == 0 else 32
    atom = cute.make_composed_layout(
        cute.make_swizzle(3 if kblock == 64 else 2, 3, 3),
        0,
        cute.make_layout((8, kblock), stride=(kblock, 1)),
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def gmem_tiled_copies(dtype, num_threads: int, cols: int):
    """(cp.async global->shared, 128-bit register->global) tiled copies for (rows, cols) tiles."""
    kblock = 64 if cols % 64 == 0 else 32
    elems = 128 // dtype.width
    threads_per_row = kblock // elems
    thr_layout = cute.make_layout(
        (num_threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1)
    )
    val_layout = cute.make_layout((1, elems))
    g2s = cute.make_tiled_copy_tv(
        cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=128
        ),
        thr_layout,
        val_layout,
    )
    r2g = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128),
        thr_layout,
        val_layout,
    )
    return g2s, r2g


@cute.jit
def load_rows(
    copy_g2s: cute.TiledCopy,
    tXgX: cute.Tensor,
    tXsX: cute.Tensor,
    tXcX: cute.Tensor,
    rows_left: Int32,
    zero_fill: cutlass.Constexpr[bool],
    cols: cutlass.Constexpr[int | None] = None,
):
    """cp.async a tile partition, skipping rows at or past ``rows_left`` (zero-filled in shared
    memory with ``zero_fill``) and, with ``cols``, the 16-byte pieces of columns at or past
    ``cols`` (``zero_cols`` zeroes those once). ``tXcX`` is the identity partition giving each
    row and column index."""
    for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
        if tXcX[0, m, 0][0] < rows_left:
            copy_cols(copy_g2s, tXgX, tXsX, tXcX, m, cols)
        elif cutlass.const_expr(zero_fill):
            tXsX[None, m, None].fill(0)


@cute.jit
def zero_tile_cols(
    copy_g2s: cute.TiledCopy, sX: cute.Tensor, cols: cutlass.Constexpr[int], tidx: Int32
):
    """Zero the columns at or past ``cols`` of a (rows, tile cols) shared-memory tile, 16 bytes
    a thread in ``copy_g2s``'s partition (the loads' own, so each thread zeroes pieces no load
    of its writes). The caller orders it before the readers (the first load's barrier)."""
    thr = copy_g2s.get_slice(tidx)
    coords = cute.make_identity_tensor(cute.product_each(sX.shape))
    zero_cols(thr.partition_D(sX), thr.partition_S(coords), cols)


@cute.jit
def store_acc(
    acc: cute.Tensor,
    tiled_mma: cute.TiledMma,
    sX: cute.Tensor,
    gX: cute.Tensor,
    rows_left: Int32,
    copy_r2g: cute.TiledCopy,
    barrier,
    tidx: Int32,
    cols: cutlass.Constexpr[int | None] = None,
):
    """Write a (rows, cols) fp32 accumulator tile to global memory in the tensor's dtype: through
    ``sX`` (free shared memory of the tile's shape), then 16 bytes a thread, rows past
    ``rows_left`` skipped (and with ``cols`` the columns at or past it). The caller guarantees
    no warp still reads ``sX``."""
    acc_to_smem(acc, tiled_mma, sX, tidx)
    barrier.arrive_and_wait()
    store_rows(sX, gX, rows_left, copy_r2g, tidx, cols)


@cute.jit
def store_zeros(
    gX: cute.Tensor,
    rows_left: Int32,
    copy_r2g: cute.TiledCopy,
    tidx: Int32,
    cols: cutlass.Constexpr[int | None] = None,
):
    """Zero the rows of a global tile below ``rows_left`` (with ``cols``, their columns below
    it)."""
    thr_r2g = copy_r2g.get_slice(tidx)
    tXgX = thr_r2g.partition_D(gX)
    # Linear row indices also for a hierarchical row mode (packed GQA's (G, rows)).
    tXcX = thr_r2g.partition_D(cute.make_identity_tensor(cute.product_each(gX.shape)))
    tXrX = cute.make_fragment_like(tXgX, gX.element_type)
    tXrX.fill(0.0)
    for m in cutlass.range_constexpr(cute.size(tXgX.shape[1])):
        if tXcX[0, m, 0][0] < rows_left:
            copy_cols(copy_r2g, tXrX, tXgX, tXcX, m, cols)
