"""Reference attention for tests and benchmarks: plain torch, no kernels.

``attention_ref`` is the ground truth (``upcast=True``: fp32 math, fp32 output) and the
baseline (``upcast=False``: the kernels' mixed precision, Note [the kernel-precision
baseline]) of DESIGN.md's tolerance rule, which ``check_close`` implements:

    max|out - out_ref| <= 2 * max|out_pt - out_ref| + atol

with atol 2-4 ulps of the input dtype at the largest magnitude of that tensor's reference
(``ulp_atol``; Note [check_close's atol]).

Masking follows Note [bottom-right aligned masks] in cute_fa/dsl/mask.py (the same rule as
flash_attn.cute): with ``offset = seqlen_k - seqlen_q``, query ``i`` sees key ``j`` iff
``i + offset - left <= j <= i + offset + right``; ``None`` is unbounded; causal is ``right = 0``.
A row that sees no key has output 0 and LSE -inf, never NaN.
"""

from __future__ import annotations

import math

import torch

from .checks import resolve_window

__all__ = [
    "attention_ref",
    "attention_varlen_ref",
    "check_close",
    "ulp_atol",
    "visible_mask",
]


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    window_left: int | None,
    window_right: int | None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: True where query i sees key j (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left is not None:
        visible &= j >= diag - window_left
    if window_right is not None:
        visible &= j <= diag + window_right
    return visible


class _RoundValue(torch.autograd.Function):
    """``x`` rounded to ``dtype`` and back (the value a kernel keeps in ``dtype``); the gradient
    passes through unrounded (the kernel's gradient of it is computed in fp32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _RoundGrad(torch.autograd.Function):
    """Identity forward; the gradient rounded to ``dtype`` (a backward kernel's dS tile, which
    it keeps in the input dtype for the dQ and dK GEMMs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype).to(grad.dtype), None


class _DeltaHolder:
    """What the two halves of the baseline's delta model share within one backward pass."""

    p: torch.Tensor | None = None  # normalized P, (b, h, sq, sk)
    shift: torch.Tensor | None = None  # delta(rounded out) - delta(out), (b, h, sq, 1)


class _DeltaOfRoundedOut(torch.autograd.Function):
    """Identity forward on the baseline's fp32 ``out``; its backward records how far the
    kernels' ``delta = rowsum(dO * out)``, taken from the output rounded to ``dtype`` (or from
    ``delta_out``, the output the kernel's backward was given), is from the one autograd forms
    implicitly (from the fp32 output): Note [the kernel-precision baseline]."""

    @staticmethod
    def forward(ctx, out, dtype, holder: _DeltaHolder, delta_out=None):
        stored = out.to(dtype) if delta_out is None else delta_out.detach()
        if stored.shape != out.shape:
            raise ValueError(f"delta_out {tuple(stored.shape)} is not the output's shape")
        ctx.save_for_backward(out, stored)
        ctx.holder = holder
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, stored = ctx.saved_tensors
        shift = (grad * (stored.to(out.dtype) - out)).sum(-1)  # (b, sq, h)
        ctx.holder.shift = shift.transpose(1, 2).unsqueeze(-1)
        return grad, None, None, None


class _ShiftDelta(torch.autograd.Function):
    """Identity forward on the scores entering the softmax; backward adds ``-P * shift`` to
    their gradient, so that dS = P (dP - delta) uses the kernels' delta (``_DeltaOfRoundedOut``
    ran first: the scores' gradient needs the output's)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, holder: _DeltaHolder):
        ctx.holder = holder
        return scores.view_as(scores)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h = ctx.holder
        if h.shift is None or h.p is None:
            return grad, None
        return grad - h.p * h.shift, None


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    upcast: bool = True,
    reorder_ops: bool = False,
    delta_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (b, sq, h, d) queries over (b, sk, h_kv, d) keys and (b, sk, h_kv, dv) values.

    Returns ``(out, lse)``: out (b, sq, h, dv) in fp32 when ``upcast`` (the ground truth) or in
    the input dtype otherwise (the baseline); lse (b, h, sq) fp32, natural log.

    ``upcast=False`` is the baseline of the tolerance (Note [the kernel-precision baseline]):
    the mixed precision of the kernels, not all-16-bit math. Scores, softcap, the softmax and
    the P V accumulation are fp32 from the 16-bit inputs; what the kernels hold in the input
    dtype is rounded to it: P before P V (unnormalised, divided by the row sum after, as the
    kernels do), the output, and in the backward (autograd) the dS tile and the gradients;
    softcap's tanh is rounded to 11 significant bits (the kernels' ``tanh.approx``, relative
    error 2^-11). ``reorder_ops``: the scale on k instead of q and P normalised before it is
    rounded: the same precision in another rounding order.

    GQA/MQA: k and v heads are repeated (``repeat_interleave``) to the query head count.
    softcap > 0: ``scores = softcap * tanh(scores * scale / softcap)`` before the softmax.
    delta_out (``upcast=False`` only): the output, (b, sq, h, dv) in the input dtype, whose
    delta = rowsum(dO * out) the baseline's backward uses, e.g. the kernel's own forward output
    that its backward was given (default: the baseline's output rounded to the input dtype).
    learnable_sink (h,): one extra logit per head in the softmax denominator that attends to
    nothing (it lowers the weights of the real keys and adds to the LSE).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention_ref takes (batch, seqlen, heads, head_dim) tensors")
    _, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads {nheads} is not a multiple of nheads_kv {nheads_kv}")
    causal, local, window_left, window_right = resolve_window(causal, window_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    low = q.dtype  # the kernels' operand dtype (the baseline rounds to it)
    out_dtype = torch.float32 if upcast else low
    q, k, v = q.float(), k.float(), v.float()
    if nheads_kv != nheads:
        k = k.repeat_interleave(nheads // nheads_kv, dim=2)
        v = v.repeat_interleave(nheads // nheads_kv, dim=2)
        if not upcast:  # the kernels write each query head's dK, dV in the input dtype
            k, v = _RoundGrad.apply(k, low), _RoundGrad.apply(v, low)

    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q * softmax_scale, k)
    if not upcast:
        scores = _RoundGrad.apply(scores, low)
    if softcap > 0:
        capped = torch.tanh(scores / softcap)
        if not upcast:
            capped = _RoundValue.apply(capped, torch.float16)  # 11 significant bits
        scores = capped * softcap
    if causal or local:
        visible = visible_mask(seqlen_q, seqlen_k, window_left, window_right, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    holder = _DeltaHolder()
    if not upcast:
        scores = _ShiftDelta.apply(scores, holder)

    # The softmax with masked rows and the sink explicit: the row max covers the visible keys
    # and the sink, and a row with no visible key keeps max 0, so nothing below computes
    # -inf - (-inf).
    row_max = scores.amax(dim=-1, keepdim=True) if seqlen_k > 0 else scores.sum(-1, True)
    if learnable_sink is not None:
        sink = learnable_sink.float().view(1, nheads, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    if learnable_sink is not None:
        denom = denom + torch.exp(sink - row_max)
    lse = (torch.log(denom) + row_max).squeeze(-1)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    if upcast:
        out = torch.einsum("bhts,bshd->bthd", probs / safe, v)
    elif reorder_ops:
        out = torch.einsum("bhts,bshd->bthd", _RoundValue.apply(probs / safe, low), v)
    else:
        p = _RoundValue.apply(probs, low)
        out = torch.einsum("bhts,bshd->bthd", p, v) / safe.transpose(1, 2)
    if not upcast and torch.is_grad_enabled() and out.requires_grad:
        holder.p = (probs / safe).detach()
        out = _DeltaOfRoundedOut.apply(out, low, holder, delta_out)
    return out.to(out_dtype), lse.to(torch.float32)


# Note [the kernel-precision baseline]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The tolerance allows twice the error of a baseline computed "in the input dtype". All-16-bit
# math (scores rounded to bf16: an absolute error of ~0.02 on a score of 5, 2 % on its
# exponential) made that baseline so inexact that a 1 % error in the softmax scale, a wrong
# key dropped, or a missing delta term could hide inside twice its error in bf16. The kernels
# do not round there: their scores, softcap, softmax and accumulators are fp32, and only P (for
# P V), dS (for dQ and dK) and the outputs are held in the input dtype. So the baseline rounds
# exactly those and computes the rest in fp32; it is as inexact as a correct kernel, not more.
# What the kernels approximate beyond rounding is modelled too: softcap's tanh.approx.f32
# (relative error up to 2^-10.99) as tanh rounded to fp16's 11 significant bits; MUFU.EX2
# (2 ulps of fp32) and the polynomial exp2 (7.5e-5 relative, Note [exp2 on the FMA pipe]) are
# far below the bf16 rounding of P and are not modelled. The backward's delta = rowsum(dO * O)
# is formed by every FlashAttention backward (the preprocess) from the output as stored, in the
# input dtype; autograd's softmax gradient forms it from the unrounded output. Where a row's dQ
# cancels (few keys, or the last rows of a causal mask: dS = P (dP - delta) with dP close to
# delta) that rounding of O is most of a correct kernel's dQ error (seen in the sweep: 2-13x the
# allowance of a baseline without it, 0.1x with it), so the baseline's backward uses the
# rounded output's delta (``_DeltaOfRoundedOut`` and ``_ShiftDelta``). Which way a value rounds
# is itself random at one element: with one or two rows whose dQ cancels, the baseline's own
# rounded output and the kernel's can round apart, so a test of a backward may pass the output
# it gave the kernel (``delta_out``) and the baseline forms delta from exactly that input.


def merge_splits(out_partial: torch.Tensor, lse_partial: torch.Tensor):
    """The split-KV merge in fp32: (out, lse) of partial results over their first dim (the
    splits), ``lse_partial`` with the shape of ``out_partial`` less its last dim: lse =
    log(sum_s exp(lse_s)), out = sum_s exp(lse_s - lse) out_s; a split at LSE -inf adds
    nothing, a row whose splits are all -inf gets out 0 and lse -inf."""
    lse = torch.logsumexp(lse_partial, dim=0)
    weights = torch.exp(lse_partial - lse).nan_to_num(nan=0.0)  # all -inf: weight 0
    return (weights.unsqueeze(-1) * out_partial.float()).sum(0), lse


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_ref`` of packed (total, h, d) sequences; returns out (total_q, h, dv) and
    lse (h, total_q). Query rows past ``seqused_q`` are 0 with LSE -inf (as cute_fa leaves them).
    """
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used_q = None if seqused_q is None else seqused_q.tolist()
    used_k = None if seqused_k is None else seqused_k.tolist()
    upcast = kwargs.get("upcast", True)
    out_dtype = torch.float32 if upcast else q.dtype
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]), dtype=out_dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cu_q) - 1):
        q0 = cu_q[b]
        k0 = cu_k[b]
        len_q = cu_q[b + 1] - q0 if used_q is None else used_q[b]
        len_k = cu_k[b + 1] - k0 if used_k is None else used_k[b]
        o, l_ = attention_ref(
            q[None, q0 : q0 + len_q],
            k[None, k0 : k0 + len_k],
            v[None, k0 : k0 + len_k],
            **kwargs,
        )
        out[q0 : q0 + len_q] = o[0]
        lse[:, q0 : q0 + len_q] = l_[0]
    return out, lse


# Note [the RMS rule]
# ~~~~~~~~~~~~~~~~~~~
# The largest error of a 16-bit result is set by rounding: in bf16 one ulp is 0.4 % of a value,
# and a systematic error such as a 1 % error in the softmax scale moves the output by about that
# much, so the max rule alone cannot tell it from rounding in every element (on unit-variance
# inputs it used 0.9-2.1x of the max rule's allowance). Rounding errors are independent from
# element to element and a systematic error is not: over a whole tensor the root mean square
# separates them (a correct result of the baseline's precision uses 0.4-0.6x of twice the
# baseline's RMS error; a 1 % scale error 3-6x, dQ / dK / dV included, softcap 30 too). So
# check_close applies the DESIGN.md rule to the maximum and to the RMS of the errors, with the
# same factor 2 and an RMS atol of RMS_ULPS ulps at the RMS magnitude of the reference (2**-6
# below that, for references that are zero by construction). A saturating softcap (tanh of
# scores well past 1, e.g. a cap of 2 on unit-variance scores) leaves the output almost
# independent of the scale, so a scale error there changes nearly nothing to catch.


# Note [check_close's atol]
# atol is ``ULPS * eps(dtype) * magnitude`` with ``magnitude`` the largest finite |ref| of the
# tensor compared (no floor of 1.0: attention outputs and gradients are mostly well below 1, and
# a floor of 1.0 made atol 8-16 ulps there, loose enough to pass a 1 % softmax-scale error).
# ``eps * x`` is one to two ulps at x, so ULPS = 2 is 2-4 ulps at the largest magnitude.
# A tensor whose largest magnitude is below MAGNITUDE_FLOOR = 2**-6 gets the atol of that floor
# (bf16: 2.4e-4, fp16: 3.1e-5). Such a reference is zero by construction, not small: every row
# sees no key, softmax_scale=0 (which the kernels run with a scale of 1e-30), or dq and dk with
# one key, where dS = P * (dP - delta) cancels exactly in the reference and to fp32 noise
# (~1e-6: two fp32 sums of the same products in different orders) in a kernel. Real outputs
# and gradients of unit-variance inputs are above 0.05 (out of 1 query over 4224 keys: 0.08).
ULPS = 2.0
BASELINE_FACTOR = 2.0
MAGNITUDE_FLOOR = 2.0**-6
# The RMS rule's atol: a quarter of an ulp at the tensor's RMS magnitude (one rounding alone
# has an RMS error of about 0.29 ulp), at 2**-6 below that (Note [the RMS rule]).
RMS_ULPS = 0.25


def _rms(x: torch.Tensor) -> float:
    return float(x.double().square().mean().sqrt()) if x.numel() else 0.0


def ulp_atol(ref: torch.Tensor, dtype: torch.dtype, ulps: float = ULPS) -> float:
    """``ulps * eps(dtype) * max(max|ref|, MAGNITUDE_FLOOR)`` over the finite elements of
    ``ref``: ``ulps`` to ``2 * ulps`` units in the last place of ``dtype`` at the largest
    magnitude of ``ref``, or at 2**-6 below that (Note [check_close's atol])."""
    finite = ref.detach()[torch.isfinite(ref)]
    magnitude = float(finite.abs().max()) if finite.numel() else 0.0
    return ulps * torch.finfo(dtype).eps * max(magnitude, MAGNITUDE_FLOOR)


def check_close(
    out: torch.Tensor,
    out_ref: torch.Tensor,
    out_pt: torch.Tensor,
    atol: float | None = None,
    *,
    name: str = "out",
) -> None:
    """Assert DESIGN.md's tolerance: ``max|out - out_ref| <= 2 * max|out_pt - out_ref| + atol``,
    and the same of the root mean square of the errors (Note [the RMS rule]):
    ``rms(out - out_ref) <= 2 * rms(out_pt - out_ref) + rms_atol``.

    ``out_ref`` is the fp32 ground truth, ``out_pt`` the baseline at the kernels' precision
    (Note [the kernel-precision baseline]). ``atol`` (when given, the RMS rule's too) defaults
    to ``ulp_atol(out_ref, dtype)``: 2-4 ulps of the lower-precision dtype among
    ``out``/``out_pt`` at the largest finite magnitude of this ``out_ref``, or at 2**-6 if
    that is smaller (no floor of 1.0; Note [check_close's atol]). Infinities must match exactly
    (an LSE of -inf for a row that sees no key); NaN anywhere in ``out`` fails. Raises
    AssertionError with the worst element.
    """
    if out.shape != out_ref.shape or out_pt.shape != out_ref.shape:
        raise AssertionError(
            f"{name}: shape {tuple(out.shape)} vs reference {tuple(out_ref.shape)} "
            f"and baseline {tuple(out_pt.shape)}"
        )
    x, ref, pt = out.float(), out_ref.float(), out_pt.float()
    nan = torch.isnan(x)
    if nan.any():
        first = tuple(int(i) for i in nan.nonzero()[0])
        raise AssertionError(f"{name}: {int(nan.sum())} NaN elements (first at {first})")
    inf_ref = torch.isinf(ref)
    inf_bad = (torch.isinf(x) | inf_ref) & (x != ref)
    if inf_bad.any():
        first = tuple(int(i) for i in inf_bad.nonzero()[0])
        raise AssertionError(
            f"{name}: infinities differ at {int(inf_bad.sum())} elements; first at {first}: "
            f"got {float(x[first])}, reference {float(ref[first])}"
        )
    finite = ~inf_ref
    explicit_atol = atol is not None
    if atol is None:
        low = min((out.dtype, out_pt.dtype), key=lambda t: torch.finfo(t).bits)
        atol = ulp_atol(ref, low)
    if not finite.any():
        return
    err = torch.where(finite, (x - ref).abs(), torch.zeros_like(x))
    base = torch.where(finite & torch.isfinite(pt), (pt - ref).abs(), torch.zeros_like(pt))
    max_err, max_base = float(err.max()), float(base.max())
    allowed = BASELINE_FACTOR * max_base + atol
    if not max_err <= allowed:
        worst = tuple(int(i) for i in (err == max_err).nonzero()[0])
        raise AssertionError(
            f"{name}: max |out - ref| = {max_err:.3e} > allowed {allowed:.3e} "
            f"(= {BASELINE_FACTOR:g} * baseline {max_base:.3e} + atol {atol:.3e}); "
            f"worst at {worst}: got {float(x[worst]):.6g}, reference {float(ref[worst]):.6g}, "
            f"baseline {float(pt[worst]):.6g}"
        )
    low = min((out.dtype, out_pt.dtype), key=lambda t: torch.finfo(t).bits)
    rms_ref = _rms(torch.where(finite, ref, torch.zeros_like(ref)))
    rms_atol = RMS_ULPS * torch.finfo(low).eps * max(rms_ref, MAGNITUDE_FLOOR)
    if explicit_atol:  # the caller's absolute bound (e.g. an fp32 LSE) holds for the RMS too
        rms_atol = max(rms_atol, atol)
    rms_err, rms_base = _rms(err), _rms(base)
    rms_allowed = BASELINE_FACTOR * rms_base + rms_atol
    if not rms_err <= rms_allowed:
        raise AssertionError(
            f"{name}: rms |out - ref| = {rms_err:.3e} > allowed {rms_allowed:.3e} "
            f"(= {BASELINE_FACTOR:g} * baseline rms {rms_base:.3e} + atol {rms_atol:.3e}; "
            f"max |out - ref| {max_err:.3e} was within {allowed:.3e}): an error spread over the "
            f"tensor, larger than rounding"
        )
