"""Where one batch entry's sequences start and how long they are (dense, varlen or seqused)."""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class SeqlenInfo(NamedTuple):
    """Where one batch entry's query and key rows start in their tensors and how many there
    are (``seqlen_info``)."""

    offset_q: Int32
    seqlen_q: Int32
    offset_k: Int32
    seqlen_k: Int32


@cute.jit
def seqlen_info(
    batch: Int32,
    mQ: cute.Tensor,
    mK: cute.Tensor,
    mCuSeqlensQ: cute.Tensor | None,
    mCuSeqlensK: cute.Tensor | None,
    mSeqUsedQ: cute.Tensor | None,
    mSeqUsedK: cute.Tensor | None,
):
    """``SeqlenInfo`` (offset_q, seqlen_q, offset_k, seqlen_k) of batch entry ``batch``.

    Dense tensors are (b, s, h, d) and a batch entry starts at row 0 of its own slice; varlen
    tensors are (1, total, h, d) and entry ``b`` starts at ``cu_seqlens[b]``. ``seqused`` caps the
    length actually used; the kernel never touches rows past it (the interface pre-fills those
    output rows with 0 and their LSE with -inf).
    """
    offset_q = Int32(0)
    offset_k = Int32(0)
    seqlen_q = Int32(mQ.shape[1])
    seqlen_k = Int32(mK.shape[1])
    if cutlass.const_expr(mCuSeqlensQ is not None):
        offset_q = mCuSeqlensQ[batch]
        seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
    if cutlass.const_expr(mCuSeqlensK is not None):
        offset_k = mCuSeqlensK[batch]
        seqlen_k = mCuSeqlensK[batch + 1] - offset_k
    if cutlass.const_expr(mSeqUsedQ is not None):
        seqlen_q = mSeqUsedQ[batch]
    if cutlass.const_expr(mSeqUsedK is not None):
        seqlen_k = mSeqUsedK[batch]
    return SeqlenInfo(offset_q, seqlen_q, offset_k, seqlen_k)
