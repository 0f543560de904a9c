"""sm80 warp-level MMA helpers: ldmatrix-fed mma.sync GEMMs on register fragments."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsA: cute.Tensor | None,
    tCrA_copy: cute.Tensor | None,
    tCsB: cute.Tensor,
    tCrB_copy: cute.Tensor,
    copy_A: cute.TiledCopy | None,
    copy_B: cute.TiledCopy,
    prefetch: cutlass.Constexpr[bool] = True,
):
    """acc += A @ B over the K mode.

    A comes from shared memory through ``copy_A`` (ldmatrix) or, when ``tCsA`` is None, is already
    in registers (P of the P @ V product). B always comes from shared memory. With ``prefetch``
    k-slice k+1 is loaded while slice k multiplies (two slices of fragments live); without it each
    slice is loaded right before its MMAs (one slice live: fewer registers).
    """
    num_k = cute.size(tCrB.shape[2])
    if cutlass.const_expr(prefetch):
        if cutlass.const_expr(tCsA is not None):
            cute.copy(copy_A, tCsA[None, None, 0], tCrA_copy[None, None, 0])
        cute.copy(copy_B, tCsB[None, None, 0], tCrB_copy[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(not prefetch):
            if cutlass.const_expr(tCsA is not None):
                cute.copy(copy_A, tCsA[None, None, k], tCrA_copy[None, None, k])
            cute.copy(copy_B, tCsB[None, None, k], tCrB_copy[None, None, k])
        elif cutlass.const_expr(k + 1 < num_k):
            if cutlass.const_expr(tCsA is not None):
                cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_copy[None, None, k + 1])
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_copy[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


def acc_as_A_operand(rP: cute.Tensor) -> cute.Tensor:
    """View an m16n8k16 accumulator fragment ((2, 2), MMA_M, MMA_N) as an A operand.

    The A fragment of m16n8k16 holds (2, 2, 2) values per thread over a 16-wide K slice, which is
    exactly two neighbouring n8 accumulator tiles: group MMA_N in pairs.
    """
    div = cute.logical_divide(rP.layout, (None, None, 2))
    layout = cute.make_layout(
        ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
        stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
    )
    return cute.make_tensor(rP.iterator, layout)
