"""WGMMA helpers shared by the sm90 kernels: issuing one GEMM over the k slices of its fragments,
a WGMMA accumulator reused, in 16 bits, as the register A operand of the next WGMMA (P V in
the forward, P^T dO and dS^T Q in the backward).
``zero_rows_from`` lives in cute_fa/dsl/copy.py (the sm100 backward zeroes rows too)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


def gemm_over_k(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tA: cute.Tensor,
    tB: cute.Tensor,
    zero_init: bool,
    b_stage=None,
) -> None:
    """acc = A B (``zero_init``: the first k slice overwrites acc) or acc += A B: one WGMMA per
    k slice of the fragments, issue only (the caller fences before and commits after).
    ``b_stage``: the smem stage of B, its last mode; None when ``tB`` has no stage mode (already
    sliced). Runs at trace time: the loop unrolls."""
    if not zero_init:
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    for k in range(cute.size(tA.shape[2])):
        if zero_init:
            tiled_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
        tB_k = tB[None, None, k] if b_stage is None else tB[None, None, k, b_stage]
        cute.gemm(tiled_mma, acc, tA[None, None, k], tB_k, acc)


@cute.jit
def convert_in_chunks(dst: cute.Tensor, src: cute.Tensor):
    """dst = src in dst's element type, 8 elements (one k = 16 slice of the A operand) at a time.

    Both are compact register fragments of the same shape. A whole-fragment conversion of a
    size that is not a power of two (P of 112 or 80 keys: 56 or 40 values a thread) comes out of
    the compiler partly as scalar conversions packed into 32-bit registers right before the
    WGMMA that reads them, and ptxas then serializes the P V WGMMAs (warning C7519). Chunks of 8
    always lower to packed pair conversions (cvt.rn.bf16x2.f32 / f16x2).
    """
    n = cute.size(src)
    src_v = cute.make_tensor(src.iterator, cute.make_layout((8, n // 8)))
    dst_v = cute.make_tensor(dst.iterator, cute.make_layout((8, n // 8)))
    for j in cutlass.range_constexpr(n // 8):
        dst_v[None, j].store(src_v[None, j].load().to(dst.element_type))


def acc_as_rs_operand(rP: cute.Tensor) -> cute.Tensor:
    """View a 16-bit copy of a WGMMA accumulator as the register A operand of the next WGMMA.

    ((2, 2, N/8), MMA_M, MMA_N) (C layout: column pair, row pair, 8-column group) ->
    ((2, 2, 2), MMA_M, (MMA_N, N/16)): the A fragment of one k=16 slice is two adjacent
    8-column groups of the C fragment, so no data moves.
    """
    shape = rP.layout.shape
    stride = rP.layout.stride
    layout = cute.make_layout(
        ((shape[0][0], shape[0][1], 2), shape[1], (shape[2], shape[0][2] // 2)),
        stride=(
            (stride[0][0], stride[0][1], stride[0][2]),
            stride[1],
            (stride[2], stride[0][2] * 2),
        ),
    )
    return cute.make_tensor(rP.iterator, layout)
