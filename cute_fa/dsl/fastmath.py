"""Fast math on pairs of fp32 values: the packed (f32x2) forms of the exponential helpers.

sm100 has packed fp32 instructions (``fma.rn.f32x2``, ``add``/``mul``/``sub``; SASS ``FFMA2``,
``FADD2``, ``FMUL2``) that do two fp32 operations in one issue slot; the DSL exposes them as
``cute.arch.fma_packed_f32x2`` and friends. They do not exist before sm100: on sm80 / sm90 use
the scalar ``exp2_poly`` of cute_fa/dsl/softmax.py (the same polynomial; Note [exp2 on the FMA
pipe] there has the error analysis).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .softmax import EXP2_POLY, ROUND_MAGIC

# The lowest exponent of a normal fp32: inputs below it are clamped, so the exponent bits
# added in ``exp2_poly_x2`` stay in range (2^-126 instead of 0 for x < -126).
EXP2_MIN = -126.0


@cute.jit
def exp2_poly_x2(x0: Float32, x1: Float32) -> tuple[Float32, Float32]:
    """(2^x0, 2^x1) for finite x <= ~8 on the FMA and integer pipes (no MUFU): Cody-Waite
    split 2^x = 2^j * 2^f with j = round(x) and f in [-0.5, 0.5] (one packed add and two packed
    subtracts), 2^f by the degree-3 polynomial of ``exp2_poly`` (three packed FMAs), j added to
    the exponent bits (an integer shift-add each). Masked (-inf) inputs must not come here."""
    x0 = cute.arch.fmax(x0, Float32(EXP2_MIN))
    x1 = cute.arch.fmax(x1, Float32(EXP2_MIN))
    magic = (Float32(ROUND_MAGIC), Float32(ROUND_MAGIC))
    t0, t1 = cute.arch.add_packed_f32x2((x0, x1), magic)
    r0, r1 = cute.arch.sub_packed_f32x2((t0, t1), magic)
    f0, f1 = cute.arch.sub_packed_f32x2((x0, x1), (r0, r1))
    c0, c1, c2, c3 = EXP2_POLY
    p0, p1 = cute.arch.fma_packed_f32x2(
        (Float32(c3), Float32(c3)), (f0, f1), (Float32(c2), Float32(c2))
    )
    p0, p1 = cute.arch.fma_packed_f32x2((p0, p1), (f0, f1), (Float32(c1), Float32(c1)))
    p0, p1 = cute.arch.fma_packed_f32x2((p0, p1), (f0, f1), (Float32(c0), Float32(c0)))
    y0 = (p0.bitcast(Int32) + (t0.bitcast(Int32) << 23)).bitcast(Float32)
    y1 = (p1.bitcast(Int32) + (t1.bitcast(Int32) << 23)).bitcast(Float32)
    return y0, y1


@cute.jit
def scale_sub_x2(
    x0: Float32, x1: Float32, scale: Float32, bias: Float32
) -> tuple[Float32, Float32]:
    """(x0 * scale - bias, x1 * scale - bias) in one packed FMA (the exponent's argument of
    Note [base-2 online softmax])."""
    return cute.arch.fma_packed_f32x2((x0, x1), (scale, scale), (-bias, -bias))


@cute.jit
def exp2_row(
    row: cute.Tensor,
    scale_log2: Float32,
    m_scaled: Float32,
    poly_every: cutlass.Constexpr[int],
):
    """In place over a thread's row of scores (an rmem tensor of even size): p = 2^(s *
    scale_log2 - m_scaled), the argument by packed FMAs, every ``poly_every``-th pair by
    ``exp2_poly_x2`` (0: every exponential on MUFU.EX2). Returns the row's sum of p."""
    n = cute.size(row)
    acc = (Float32(0.0), Float32(0.0))
    for i in cutlass.range_constexpr(0, n, 2):
        a0, a1 = scale_sub_x2(row[i], row[i + 1], scale_log2, m_scaled)
        if cutlass.const_expr(poly_every > 0 and (i // 2) % poly_every == poly_every - 1):
            a0, a1 = exp2_poly_x2(a0, a1)
        else:
            a0 = cute.math.exp2(a0, fastmath=True)
            a1 = cute.math.exp2(a1, fastmath=True)
        row[i] = a0
        row[i + 1] = a1
        acc = cute.arch.add_packed_f32x2(acc, (a0, a1))
    return acc[0] + acc[1]
