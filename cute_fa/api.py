"""The public torch API: ``flash_attn_func`` and ``flash_attn_varlen_func`` (drop-ins for
``flash_attn.cute``) and their autograd.

Call path: argument normalisation (window, scale, unimplemented flash_attn.cute arguments;
``cute_fa.checks``) -> ``torch.ops.cute_fa.fwd`` (``cute_fa.ops``: a ``torch.library`` op with
a fake implementation, so ``torch.compile(fullgraph=True)`` traces it without graph breaks) ->
checks -> planning by the device's compute capability -> compile cache -> launch on torch's
current CUDA stream.

Checks, in order (each names the argument; all run before any compile or launch):
  1. metadata, also under torch.compile's fake tensors: tensor types, dtypes (TypeError),
     ranks, head dims, head counts, batch/sequence extents, strides (ValueError), cu_seqlens /
     seqused dtype, rank and length; then "no kernel on any GPU implements this"
     (NotImplementedError, e.g. head_dim 80);
  2. data pointers 16-byte aligned (ValueError);
  3. values of cu_seqlens / seqused, read on the host (one device sync), see below;
  4. the device: every tensor on one CUDA device (ValueError; so CPU tensors pass 1-3 and fail
     here), then the device's compute capability (NotImplementedError below 8.0 or for a
     feature its kernel lacks).

Sequence metadata (varlen): ``cu_seqlens_q`` / ``cu_seqlens_k`` are int32 (batch + 1,) with
``cu[0] == 0``, non-decreasing, and ``cu[-1] == total`` (the packed length: every packed row
belongs to a sequence; flash_attn also accepts ``cu[-1] < total``). ``seqused_*`` are int32
(batch,) with ``0 <= seqused[b] <=`` the room sequence b has (its cu_seqlens extent, or the
seqlen of a batched tensor); query rows past ``seqused_q`` come back as 0 with LSE -inf.
Value checks cost a host sync; ``CUTE_FA_SKIP_CHECKS=1`` (read at import) skips them, and they
are skipped while a CUDA graph is being captured. ``max_seqlen_q`` (the grid size) is computed
from ``cu_seqlens_q`` when not given (that read syncs too, even with checks off); a given value
smaller than the longest query sequence is an error when values are checked.

Masks (Note [bottom-right aligned masks] in cute_fa/dsl/mask.py): query i sees key j iff
``i + sk - sq - left <= j <= i + sk - sq + right``; None is unbounded; ``causal=True`` sets
right = 0; window ``(None, 0)`` is causal; any other window with an int is a sliding window
(local). Window ints may be negative and are taken literally: a window with
``left + right < 0`` sees no key (flash_attn.cute instead reads that as "no window", after
FA2's ``(-1, -1)``). A row that sees no key gets output 0 and LSE -inf.

Split-KV (``num_splits``, as flash_attn.cute): 1 (the default) off; n > 1 splits every query
block's key blocks into n ranges, each run by its own CTA into fp32 partial outputs, then merged
by the combine kernel (``flash_attn_combine``'s); 0, None or a negative value: a count from the
SM count, the number of tiles and the key length (Note [split-KV heuristic] in
cute_fa/planning.py; 1 where no kernel splits). Implemented by the sm90 forward; an explicit
n > 1 on a GPU whose kernel cannot split raises NotImplementedError. The result is the same
attention (not bitwise: a different summation order); the backward needs only out and lse.

Scheduler metadata (``get_scheduler_metadata``, flash_attn.cute's signature; Note [scheduler
metadata] in cute_fa/scheduler.py): a varlen call's host-side decisions, computed ahead of it
without reading a tensor: ``max_seqlen_q``, the split count of ``num_splits=0`` and the
``pack_gqa`` decision. ``flash_attn_varlen_func(..., scheduler_metadata=md)`` checks that md
was computed for its arguments (ValueError naming each difference) and runs as the call with
md's max_seqlen_q, split count and packing: the same kernel, bitwise the same results, and no
host read of ``cu_seqlens_q`` (a decode step under CUDA-graph capture).

Return convention (as flash_attn.cute): ``(out, lse)``; lse is fp32 (batch, nheads, seqlen_q),
or (nheads, total_q) for packed varlen queries, when ``return_lse=True`` or when an input
requires grad; otherwise ``lse`` is None.

Backward: ``cute_fa::bwd`` (``cute_fa.ops``; a custom op with a fake implementation too, so
torch.compile traces forward and backward without graph breaks) runs
``cute_fa.backward.run_backward``: gradients
for q, k, v, also through a used ``lse`` (dLSE). ``deterministic=True`` makes the gradients
bitwise reproducible (dQ summed in a fixed order; dK and dV always are). For packed keys the
backward's grid needs ``max_seqlen_k``: pass it to ``flash_attn_varlen_func`` to avoid a host
sync (and under CUDA-graph capture, where that sync is not allowed).
"""

from __future__ import annotations

import torch

from . import tuned
from .checks import (
    check_learnable_sink,
    check_tensor,
    kernel_scale,
    reject_unimplemented,
    resolve_num_splits,
    resolve_pack_gqa,
    resolve_scale,
    resolve_softcap,
    window_args,
)
from .ops import bwd_impl, bwd_op, eager_cuda, fwd_impl, fwd_op
from .scheduler import SchedulerMetadata, call_arguments, get_scheduler_metadata

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "get_scheduler_metadata",
    "SchedulerMetadata",
]


class _FlashAttnForward(torch.autograd.Function):
    """Forward through ``cute_fa::fwd``; backward through ``cute_fa::bwd``.

    Gradients are not materialised (``set_materialize_grads(False)``): an unused ``lse`` gives
    ``dlse = None`` and costs nothing; a used one folds into the backward's delta (Note
    [gradient of the LSE] in cute_fa/backward.py). Only ``out`` unused gives ``dout`` zeros.
    The backward runs under the ``cute_fa.tuning`` overrides that were active at the forward
    (autograd may run it on a worker thread, which does not see the caller's context).
    """

    @staticmethod
    def forward(
        ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
        softmax_scale, causal, window_left, window_right, softcap, num_splits, pack_gqa,
        max_seqlen_k, deterministic,
    ):  # fmt: skip
        out, lse = fwd_op(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
            softmax_scale, causal, window_left, window_right, softcap, num_splits, pack_gqa,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.params = (
            max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
            deterministic,
        )  # fmt: skip
        # (Traced by torch.compile, the graph carries no Python context: its backward runs
        # under whatever overrides are active when it runs.)
        ctx.tuning = None if torch.compiler.is_compiling() else tuned.snapshot()
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        args = (
            dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            *ctx.params,
        )  # fmt: skip
        if ctx.tuning is None:
            dq, dk, dv = bwd_op(*args)
        else:
            with tuned.restored(ctx.tuning):
                dq, dk, dv = bwd_impl(*args) if eager_cuda(dout) else bwd_op(*args)
        return dq, dk, dv, *([None] * 14)


def _requires_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _apply_learnable_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor):
    """(out, lse) of attention with one more logit per head, ``sink``, in every row's softmax
    denominator (Note [learnable sink])."""
    # lse (batch, nheads, seqlen_q) and out (batch, seqlen_q, nheads, dv), or packed queries:
    # lse (nheads, total_q) and out (total_q, nheads, dv). Either way heads are lse's dim -2.
    lse_all = torch.logaddexp(lse, sink.to(lse.dtype).unsqueeze(-1))
    ratio = torch.exp(lse - lse_all).transpose(-1, -2)
    # A row with lse = -inf (no key) and a sink of -inf: nothing at all, out 0 (not NaN).
    ratio = torch.where(torch.isnan(ratio), torch.zeros_like(ratio), ratio)
    wide = out if out.element_size() >= 4 else out.float()  # 16-bit out: scale in fp32
    return (wide * ratio.unsqueeze(-1).to(wide.dtype)).to(out.dtype), lse_all


# Note [learnable sink]
# ~~~~~~~~~~~~~~~~~~~~~
# ``learnable_sink`` (nheads,) adds one logit per head to every row's softmax denominator; it
# attends to no value. With the kernels' (out, lse) of the same call without it:
#     lse' = log(exp(lse) + exp(sink)),    out' = out * exp(lse - lse')
# (a row that sees no key: out' = 0, lse' = sink). These are torch ops on the kernels' outputs,
# so autograd differentiates them: d lse' / d sink gives the sink's gradient, and the kernels'
# backward receives dout * exp(lse - lse') and the gradient of their LSE (the backward's dLSE
# path), which together are the exact gradients of the sink-inclusive softmax. The cost is two
# elementwise passes over out (forward) and their backward; folding the sink into the kernels'
# final normalization would remove them.


def _forward(requires_grad: bool, q, k, v, *args, max_seqlen_k=None, deterministic=False,
             page_table=None):  # fmt: skip
    """Forward with autograd when needed; eager calls on plain CUDA tensors skip the
    dispatcher (Note [eager fast path]). ``max_seqlen_k`` and ``deterministic`` only concern
    the backward; ``page_table`` (paged K/V) is forward-only."""
    if requires_grad:
        if page_table is not None:
            raise NotImplementedError(
                "cute_fa: paged K/V (page_table) is forward-only (a serving path); call "
                "it under torch.no_grad() or with inputs that do not require grad"
            )
        return _FlashAttnForward.apply(q, k, v, *args, max_seqlen_k, deterministic)
    if eager_cuda(q):
        return fwd_impl(q, k, v, *args, page_table)
    return fwd_op(q, k, v, *args, page_table)


# Note [eager fast path]
# ~~~~~~~~~~~~~~~~~~~~~~
# ``torch.ops.cute_fa.fwd`` is what torch.compile, export, fake tensors and dispatch modes see.
# A plain eager call (a CUDA ``torch.Tensor``, nothing being traced, no torch dispatch or
# function mode active, no autograd needed) calls the op's CUDA implementation directly: the
# same function the dispatcher would reach, without its ~10 us of argument boxing. The autograd
# backward calls ``cute_fa::bwd``'s implementation the same way under the same conditions.


# --------------------------------------------------------------------------------------------
# Public API


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: torch.Tensor | None = None,
    gather_kv_indices: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    block_sparse_tensors=None,
    block_sparse_tensors_bwd=None,
    return_lse: bool = False,
):
    """Exact attention of q (batch, seqlen_q, nheads, d) over k (batch, seqlen_k, nheads_kv, d)
    and v (batch, seqlen_k, nheads_kv, dv); nheads a multiple of nheads_kv (GQA/MQA).

    Same signature, defaults and return convention as ``flash_attn.cute.flash_attn_func``:
    returns ``(out, lse)`` with out (batch, seqlen_q, nheads, dv) in q's dtype and lse fp32
    (batch, nheads, seqlen_q), or None unless ``return_lse`` or an input requires grad.
    ``softmax_scale`` defaults to d ** -0.5; ``softcap`` > 0 caps scores as
    ``softcap * tanh(scores / softcap)``; masks as in the module docstring. ``num_splits``:
    split-KV (module docstring). Arguments of
    flash_attn.cute that cute_fa does not implement yet raise NotImplementedError when set
    (``python -m cute_fa features`` lists them). ``deterministic`` only concerns the backward.
    """
    if not (
        qv is None
        and gather_kv_indices is None
        and score_mod is None
        and score_mod_bwd is None
        and mask_mod is None
        and aux_tensors is None
        and aux_scalars is None
        and block_sparse_tensors is None
        and block_sparse_tensors_bwd is None
    ):
        reject_unimplemented(
            qv=qv,
            gather_kv_indices=gather_kv_indices,
            score_mod=score_mod,
            score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod,
            aux_tensors=aux_tensors,
            aux_scalars=aux_scalars,
            block_sparse_tensors=block_sparse_tensors,
            block_sparse_tensors_bwd=block_sparse_tensors_bwd,
        )
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        check_tensor(q, "q")
        check_tensor(k, "k")
        check_tensor(v, "v")
    causal, window_left, window_right = window_args(causal, window_size)
    scale = resolve_scale(softmax_scale, q.shape[-1] if q.dim() else 0)
    requires_grad = _requires_grad(q, k, v)
    q, scale = kernel_scale(q, scale)
    if learnable_sink is not None:
        check_learnable_sink(learnable_sink, q.shape[-2] if q.dim() else 0, q)
    out, lse = _forward(
        requires_grad, q, k, v, None, None, None, None, None,
        scale, causal, window_left, window_right, resolve_softcap(softcap),
        resolve_num_splits(num_splits), resolve_pack_gqa(pack_gqa),
        deterministic=bool(deterministic),
    )  # fmt: skip
    if learnable_sink is not None:
        out, lse = _apply_learnable_sink(out, lse, learnable_sink)
        requires_grad = requires_grad or (torch.is_grad_enabled() and learnable_sink.requires_grad)
    return out, (lse if return_lse or requires_grad else None)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    min_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    gather_kv_indices: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: torch.Tensor | None = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_scalars=None,
    return_lse: bool = False,
    scheduler_metadata=None,
    seqlen_k_per_split: int | None = None,
    disable_scheduler_metadata: bool = False,
):
    """Attention over packed variable-length sequences (``flash_attn.cute`` signature).

    With ``cu_seqlens_q`` (int32, batch + 1), q is packed (total_q, nheads, d); without, it is
    (batch, seqlen_q, nheads, d). Likewise k and v with ``cu_seqlens_k``. ``seqused_q`` /
    ``seqused_k`` (int32, batch) cap how many rows of each sequence count. Returns ``(out,
    lse)``: out shaped like q with dv, lse fp32 (nheads, total_q) for packed q or (batch,
    nheads, seqlen_q), or None unless ``return_lse`` or an input requires grad.
    ``max_seqlen_q`` sizes the grid (computed from cu_seqlens_q when None); ``max_seqlen_k``
    sizes the backward's grid (computed from cu_seqlens_k when None: a host sync);
    ``min_seqlen_k`` is accepted and not needed; ``num_splits``: split-KV. ``page_table``
    (int32 (batch, max_pages)): paged K/V, k and v then (num_pages, page_size, nheads_kv, d),
    sequence b's key j in page ``page_table[b, j // page_size]`` at row ``j % page_size``;
    ``seqused_k`` the cache lengths (without it every page of a row counts); not with
    ``cu_seqlens_k``; forward only.
    Only the pages a sequence uses are read; their indices must be in [0, num_pages) (checked
    with the other metadata unless ``CUTE_FA_SKIP_CHECKS=1``: an index out of range there is
    an out-of-bounds read). ``scheduler_metadata``: what ``get_scheduler_metadata`` computed
    for this call (its max_seqlen_q, split count and packing decided ahead: no host read of
    cu_seqlens_q; ValueError when it was computed for other arguments); the results are
    bitwise those of the call without it given md's max_seqlen_q, num_splits and pack_gqa
    (Note [scheduler metadata] in cute_fa/scheduler.py); ``disable_scheduler_metadata=True``
    ignores it. Sequence metadata rules, split-KV and checks: see the module docstring.
    """
    if not (
        qv is None
        and gather_kv_indices is None
        and score_mod is None
        and score_mod_bwd is None
        and mask_mod is None
        and block_sparse_tensors is None
        and aux_tensors is None
        and aux_scalars is None
        and seqlen_k_per_split is None
    ):
        reject_unimplemented(
            qv=qv,
            gather_kv_indices=gather_kv_indices,
            score_mod=score_mod,
            score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod,
            block_sparse_tensors=block_sparse_tensors,
            aux_tensors=aux_tensors,
            aux_scalars=aux_scalars,
            seqlen_k_per_split=seqlen_k_per_split,
        )
    check_tensor(q, "q")
    check_tensor(k, "k")
    check_tensor(v, "v")
    if max_seqlen_q is not None:
        max_seqlen_q = int(max_seqlen_q)
        if max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    if max_seqlen_k is not None:
        max_seqlen_k = int(max_seqlen_k)
        if max_seqlen_k < 0:
            raise ValueError(f"max_seqlen_k must be >= 0, got {max_seqlen_k}")
    causal, window_left, window_right = window_args(causal, window_size)
    softcap = resolve_softcap(softcap)
    num_splits, pack_gqa = resolve_num_splits(num_splits), resolve_pack_gqa(pack_gqa)
    if scheduler_metadata is not None and not disable_scheduler_metadata:
        max_seqlen_q, max_seqlen_k, num_splits, pack_gqa = call_arguments(
            scheduler_metadata, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
            page_table, max_seqlen_q, max_seqlen_k, causal, window_left, window_right, softcap,
            num_splits, pack_gqa,
        )  # fmt: skip
    scale = resolve_scale(softmax_scale, q.shape[-1] if q.dim() else 0)
    requires_grad = _requires_grad(q, k, v)
    q, scale = kernel_scale(q, scale)
    if learnable_sink is not None:
        check_learnable_sink(learnable_sink, q.shape[-2] if q.dim() else 0, q)
    out, lse = _forward(
        requires_grad, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
        scale, causal, window_left, window_right, softcap, num_splits, pack_gqa,
        max_seqlen_k=max_seqlen_k, deterministic=bool(deterministic), page_table=page_table,
    )  # fmt: skip
    if learnable_sink is not None:
        out, lse = _apply_learnable_sink(out, lse, learnable_sink)
        requires_grad = requires_grad or (torch.is_grad_enabled() and learnable_sink.requires_grad)
    return out, (lse if return_lse or requires_grad else None)
