"""Online softmax of a thread that owns a whole row (sm100: a TMEM lane is one query row).

The math is that of ``OnlineSoftmax`` (cute_fa/dsl/softmax.py, Note [base-2 online softmax] and
Note [rescale threshold]); there a row is spread over the 4 threads of a quad and every
reduction ends in shuffles, here one thread holds the row (``tcgen05.ld`` 32x32b: lane i of
the warp reads TMEM lane 32 * (warp % 4) + i), so the reductions are in registers and the
running max / sum are two scalars. The O rescale itself belongs to another warpgroup (the
correction warps), so ``update_max`` returns the factor instead of applying it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .softmax import LN_2


@cute.jit
def update_max(
    m_prev: Float32,
    m_cur: Float32,
    scale_log2: Float32,
    is_first: cutlass.Constexpr[bool],
    check_inf: cutlass.Constexpr[bool],
    rescale_threshold: cutlass.Constexpr[float],
):
    """The row's new running max from the old one and this block's max: (m_new, m_scaled,
    factor), with m_scaled = m_new * scale_log2 (0 for a row still at -inf when ``check_inf``)
    the exponent's offset, and factor = 2^(m_prev * scale_log2 - m_scaled) what O and the row
    sum are multiplied by (exactly 1 when the max stays; 1 on the first block). With
    ``rescale_threshold`` t > 0 the max moves only by more than t log2 units (Note [rescale
    threshold])."""
    m_new = m_cur
    if cutlass.const_expr(not is_first):
        if cutlass.const_expr(rescale_threshold > 0):
            # (m_prev = -inf: moves to any m_cur; both -inf: NaN > t is False, stays.)
            moved = (m_cur - m_prev) * scale_log2 > rescale_threshold
            m_new = m_cur if moved else m_prev
        else:
            m_new = cute.arch.fmax(m_prev, m_cur)
    m_scaled = m_new * scale_log2
    if cutlass.const_expr(check_inf):
        m_scaled = 0.0 if m_new == -Float32.inf else m_scaled
    factor = Float32(1.0)
    if cutlass.const_expr(not is_first):
        factor = cute.math.exp2(m_prev * scale_log2 - m_scaled, fastmath=True)
        factor = Float32(1.0) if m_new == m_prev else factor  # exactly 1: no rescale
    return m_new, m_scaled, factor


@cute.jit
def finalize_row(row_max: Float32, row_sum: Float32, scale_log2: Float32):
    """(1 / row_sum, natural-log LSE) of a finished row; a row that saw no key (row_sum 0)
    gets 0 and -inf, so its O is 0 (Note [base-2 online softmax])."""
    empty = row_sum == 0.0
    inv = 0.0 if empty else cute.arch.rcp_approx(row_sum)
    lse = (
        -Float32.inf
        if empty
        else (row_max * scale_log2 + cute.math.log2(row_sum, fastmath=True)) * LN_2
    )
    return Float32(inv), Float32(lse)


def row_view(t: cute.Tensor) -> cute.Tensor:
    """A thread's row fragment (registers, or the matching coordinate tensor) as a (1, n)
    (rows, cols) view, the shape ``cute_fa.dsl.mask.apply_mask`` takes."""
    return cute.make_tensor(
        t.iterator, cute.composition(t.layout, cute.make_layout((1, cute.size(t))))
    )
