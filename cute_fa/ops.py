"""The ``cute_fa::fwd`` and ``cute_fa::bwd`` custom ops: forward launch plans and launches.

``torch.ops.cute_fa.fwd`` (a ``torch.library`` op with a fake implementation, so
``torch.compile(fullgraph=True)`` traces it without graph breaks): checks (``cute_fa.checks``)
-> planning by the device's compute capability and tuned table (``cute_fa.planning``) ->
compile cache (``cute_fa.compile``) -> launch on torch's current CUDA stream. ``cute_fa::bwd``
runs ``cute_fa.backward.run_backward``. Autograd and the public functions are in
``cute_fa.api``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from . import planning, selftest, tuned
from .backward import run_backward
from .checks import (
    ALIGN_BYTES,
    Shapes,
    check_alignment,
    check_metadata,
    check_page_table_values,
    check_values,
    check_values_and_max_seqlen_q,
    device_of,
    kernel_window,
    resolve_window,
)
from .combine import combine_kernel, launch_combine
from .compile import fwd_cache
from .device import capability, sm_count, tuned_table


def _compiled_kernel(config):
    """The launchable kernel of a compile key (the compile cache: memory, disk, compile)."""
    return fwd_cache().get(config)


class _Plan(NamedTuple):
    """Everything a call with a given input signature needs that is not a pointer or a value:
    built once per signature by the full checks, then reused (Note [launch plans])."""

    kernel: object  # the compiled kernel (a tvm_ffi.Function)
    device: torch.device
    out_shape: tuple
    lse_shape: tuple
    varlen_q: bool
    varlen_k: bool
    seqlen_q: int
    seqused_q: bool
    has_int_metadata: bool  # cu_seqlens / seqused present: their values are checked per call
    no_work: bool  # out is empty or there are no keys: no launch
    window_left: int
    window_right: int
    shapes: Shapes
    # Allocation templates (Note [allocation templates]): one element each, expanded (stride 0)
    # to the shapes of out and lse.
    out_like: torch.Tensor
    lse_like: torch.Tensor
    # Split-KV (Note [split-KV launches]): key splits (1: off) and the compiled combine kernel.
    num_splits: int = 1
    combine: object = None
    # Packed GQA (Note [packed GQA plans]): query heads a tile packs per K/V head; 0: off.
    pack_gqa: int = 0
    # Split-KV: allocation templates of the fp32 partial O (S, b, sq, h, dv) and LSE (S, b, h,
    # sq) (packed q: b = 1), Note [allocation templates].
    partial_out_like: torch.Tensor | None = None
    partial_lse_like: torch.Tensor | None = None


# Note [launch plans]
# ~~~~~~~~~~~~~~~~~~~
# The metadata checks, the device check, dispatch and the compile-cache lookup depend only on
# the input signature: shapes, strides, dtypes and devices of the tensors, plus the mask flags
# and the tuning state (``cute_fa.tuning`` overrides and tuned-table writes, ``tuned.state()``).
# ``_plans`` maps that signature to a ``_Plan`` made by the full, ordered checks on its first
# call; later calls with the same signature pay for the key, the pointer-alignment check, the
# value checks of varlen metadata (when present), two allocations and the launch. A plan is
# stored only once every check, the device check included, has passed, and once its kernel has
# passed the first-use self-check where it needs one (``cute_fa.selftest``; a kernel that fails
# it is replaced by the plan without its family). The table is bounded: it is cleared when it
# outgrows ``_MAX_PLANS`` (workloads with ever new shapes just re-check).
_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def clear_plans() -> None:
    """Drop every forward launch plan (a tool that changes a process-wide setting between
    calls of one signature; the next call of each signature checks and plans again)."""
    _plans.clear()


def _tensor_key(t):
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def _make_plan(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    causal,
    window_left,
    window_right,
    softcap,
    num_splits: int = 1,
    pack_gqa: int = -1,
    page_table=None,
) -> tuple[_Plan, int]:
    """The full, ordered checks (module docstring); returns the plan and max_seqlen_q.
    ``num_splits``: 1 no split-KV, > 1 that many splits, 0 the heuristic's count.
    ``pack_gqa``: -1 automatic, 0 off, 1 on (Note [packed GQA plans])."""
    causal, local, window_left, window_right = resolve_window(causal, (window_left, window_right))
    shapes = check_metadata(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        causal=causal, local=local, softcap=softcap, page_table=page_table,
    )  # fmt: skip
    check_alignment(q, k, v)
    max_seqlen_q = check_values_and_max_seqlen_q(
        shapes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, check_values(q)
    )
    device = device_of(
        (q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"),
        (cu_seqlens_k, "cu_seqlens_k"), (seqused_q, "seqused_q"), (seqused_k, "seqused_k"),
        (page_table, "page_table"),
    )  # fmt: skip
    if page_table is not None and check_values(q):
        check_page_table_values(page_table, seqused_k, k.shape[1], k.shape[0])
    if shapes.varlen_q:
        lse_shape = (shapes.nheads, shapes.seqlen_q)
    else:
        lse_shape = (shapes.batch, shapes.nheads, shapes.seqlen_q)
    out_shape = (*q.shape[:-1], shapes.head_dim_v)
    no_work = math.prod(out_shape) == 0 or k.numel() == 0
    # Dispatch (NotImplementedError) even when there is nothing to launch; compile only when
    # there is.
    # The tile may depend on the query length (dense: seqlen_q; varlen: this first call's
    # max_seqlen_q, which the plan then keeps for every call of its signature).
    seqlen_hint = max_seqlen_q if shapes.varlen_q else shapes.seqlen_q
    plan_args = (capability(device), shapes.request, seqlen_hint, tuned_table(device))
    plan_args, config, unsplit, splits = _choose(
        plan_args, shapes, max_seqlen_q, device, num_splits, pack_gqa, no_work
    )
    config = _for_device(config, device, no_work)
    kernel = None if no_work else _compiled_kernel(config)
    if kernel is not None and splits > 1 and selftest.needs_check(config):
        # A split variant that is self-checked (its family is: cute_fa/selftest.py
        # needs_check) is checked split, then merged; one that fails: the unsplit plan, with the
        # warning.
        error = selftest.failure(kernel, config, device)
        if error:
            fallback = _for_device(unsplit, device, no_work)
            selftest.warn_fallback(config, error, fallback, device)
            splits, config, kernel = 1, fallback, _compiled_kernel(fallback)
    combine = None
    if kernel is not None and splits > 1:
        # The partial O is fp32; the combine writes q's dtype. Rows past seqused_q are never
        # written by the split kernel, so the combine skips them (with cu_seqlens_q for packed
        # queries); they keep the 0 / -inf allocated for them.
        combine = combine_kernel(
            device, torch.float32, q.dtype, shapes.head_dim_v, True,
            cu_seqlens_q is not None, seqused_q is not None,
        )  # fmt: skip
    elif kernel is not None:
        kernel, config = _self_checked(kernel, config, device, plan_args)
    wl, wr = kernel_window(local, window_left, window_right)
    partial_out_like = partial_lse_like = None
    if combine is not None:
        b4, sq4 = (1, shapes.seqlen_q) if shapes.varlen_q else (shapes.batch, shapes.seqlen_q)
        h, dv = shapes.nheads, shapes.head_dim_v
        one = torch.empty(1, dtype=torch.float32, device=device)
        partial_out_like = one.expand(splits, b4, sq4, h, dv)
        partial_lse_like = one.expand(splits, b4, h, sq4)
    plan = _Plan(
        kernel=kernel,
        device=device,
        out_shape=out_shape,
        lse_shape=lse_shape,
        varlen_q=shapes.varlen_q,
        varlen_k=shapes.varlen_k,
        seqlen_q=shapes.seqlen_q,
        seqused_q=seqused_q is not None,
        has_int_metadata=any(
            t is not None for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table)
        ),
        no_work=no_work,
        window_left=wl,
        window_right=wr,
        shapes=shapes,
        out_like=torch.empty(1, dtype=q.dtype, device=device).expand(out_shape),
        lse_like=torch.empty(1, dtype=torch.float32, device=device).expand(lse_shape),
        num_splits=splits if kernel is not None else 1,
        combine=combine,
        pack_gqa=config.pack_gqa if kernel is not None else 0,
        partial_out_like=partial_out_like,
        partial_lse_like=partial_lse_like,
    )
    return plan, max_seqlen_q


def _choose(
    plan_args: tuple, shapes: Shapes, max_seqlen_q: int, device, num_splits: int, pack_gqa: int,
    no_work: bool = False, max_seqlen_k: int | None = None,
):  # fmt: skip
    """The host-side decisions of a plan: (plan_args, config, unsplit config, split count).
    Packing (Note [packed GQA plans]), then the split count (``num_splits`` 1: none, > 1: that
    many, NotImplementedError where no kernel splits; 0: ``_heuristic_splits``, 1 where no
    kernel splits). Reads no tensor: ``get_scheduler_metadata`` makes the same decisions ahead
    of a call (Note [scheduler metadata] in cute_fa/scheduler.py)."""
    _, config = planning.fwd_plan(*plan_args)
    if not no_work:
        plan_args, config = _packed(plan_args, config, shapes, pack_gqa)
    unsplit = config
    splits = 1
    if num_splits > 1:
        splits = planning.clamp_num_splits(num_splits, shapes.batch)
    elif num_splits == 0 and not no_work:
        splits = _heuristic_splits(config, shapes, max_seqlen_q, device, max_seqlen_k)
    if splits > 1:
        split_args = (plan_args[0], dataclasses.replace(plan_args[1], split_kv=True),
                      *plan_args[2:])  # fmt: skip
        if num_splits > 1:  # asked for: NotImplementedError where no kernel splits
            _, config = planning.fwd_plan(*split_args)
        else:  # the heuristic's choice: only where a kernel splits
            _, split_config, _ = planning.try_plan(*split_args)
            if split_config is None:
                splits = 1
            else:
                config = split_config
    return plan_args, config, unsplit, splits


def scheduler_choice(
    device, request: planning.FwdRequest, batch: int, nheads: int, nheads_kv: int,
    max_seqlen_q: int, max_seqlen_k: int, num_splits: int, pack_gqa: int,
) -> tuple[int, bool]:  # fmt: skip
    """(split count, packs) that a call of ``request`` on ``device`` plans (``_choose``), from
    numbers alone: ``max_seqlen_q`` picks the tile as a varlen call's does, ``max_seqlen_k`` is
    the key length of the split heuristic (Note [scheduler metadata] in cute_fa/scheduler.py)."""
    shapes = Shapes(batch, max_seqlen_q, max_seqlen_k, nheads, nheads_kv, request.head_dim,
                    request.head_dim_v, request.varlen_q, request.varlen_k, request)  # fmt: skip
    plan_args = (capability(device), request, max_seqlen_q, tuned_table(device))
    _, config, _, splits = _choose(
        plan_args, shapes, max_seqlen_q, device, num_splits, pack_gqa, max_seqlen_k=max_seqlen_k
    )
    return splits, bool(config.pack_gqa)


# Note [packed GQA plans]
# ~~~~~~~~~~~~~~~~~~~~~~~
# ``pack_gqa`` (flash_attn.cute's argument): True packs the query heads of each K/V head into
# one tile's rows (Note [packed GQA] in cute_fa/dsl/pack_gqa.py) wherever a kernel of the device
# does; None packs where ``planning.pack_gqa_helps`` says the packed tiles waste far fewer rows
# (Note [pack_gqa heuristic]); False never. MHA calls (one query head per K/V head) have nothing
# to pack. Where no kernel packs the call (heads per K/V head that neither divide the tile's
# rows nor are a multiple of them: 64 on sm90, tile_m on sm80; non-powers of two on sm100) it
# runs unpacked: the same results, one head a tile. A launch
# plan records what it packs (``_Plan.pack_gqa``).


def _packed(plan_args: tuple, config, shapes: Shapes, pack_gqa: int):
    """(plan_args, config) of the packed plan when the call packs (Note [packed GQA plans]),
    else the arguments unchanged."""
    group = shapes.nheads // max(shapes.nheads_kv, 1)
    if group < 2 or pack_gqa == 0:
        return plan_args, config
    if pack_gqa < 0 and not planning.pack_gqa_helps(plan_args[2], group, config.tile_m):
        return plan_args, config
    # (the packed tile's rows: `group` heads of each query position)
    capability_, request, seqlen_hint, table = plan_args
    packed_args = (capability_, dataclasses.replace(request, pack_gqa=group), seqlen_hint * group,
                   table)  # fmt: skip
    _, packed_config, _ = planning.try_plan(*packed_args)
    if packed_config is None:
        return plan_args, config
    return packed_args, packed_config


def _heuristic_splits(
    config, shapes: Shapes, max_seqlen_q: int, device, max_seqlen_k: int | None = None
) -> int:
    """``num_splits`` 0: the count of Note [split-KV heuristic] for the tile of ``config``
    (the unsplit plan), clamped to the grid (planning.clamp_num_splits). The key length:
    ``max_seqlen_k`` when given (scheduler metadata), else the keys' extent (dense: k's
    seqlen; paged: max_pages * page_size; packed: the average)."""
    group = config.pack_gqa or 1  # packed GQA: a tile holds the rows of `group` heads
    tiles = shapes.batch * (shapes.nheads // group) * -(-max_seqlen_q * group // config.tile_m)
    seqlen_k = shapes.seqlen_k
    if max_seqlen_k is not None:
        seqlen_k = max_seqlen_k
    elif shapes.varlen_k:  # packed keys: the average length (the longest is not known here)
        seqlen_k = -(-seqlen_k // max(shapes.batch, 1))
    splits = planning.num_splits_heuristic(tiles, -(-seqlen_k // config.tile_n), sm_count(device))
    return planning.clamp_num_splits(splits, shapes.batch)


# Note [split-KV launches]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A plan with num_splits S > 1 runs a split-KV forward kernel (FwdConfig.split_kv) on fp32
# partial buffers, then the combine kernel (ampere/flash_combine.py) into out and lse:
#   dense q:  out_partial (S, b, sq, h, dv), lse_partial (S, b, h, sq); the forward kernel sees
#             them as (S * b, sq, h, dv) and (S * b, h, sq) (split slowest), the combine as
#             (S, b, sq, h, dv) and the transposed view (S, b, sq, h), out and lse.transpose.
#   packed q: out_partial (S, total_q, h, dv), lse_partial (S, h, total_q): the forward kernel's
#             batch extent is S; the combine adds a batch dim of 1.
# The split count is a runtime value: one compiled kernel serves every S. The backward needs
# only out and lse, so a split forward's backward is the usual one. A split variant of a family
# that gets the first-use self-check (cute_fa/selftest.py needs_check) is checked as three splits
# into poisoned partials, merged by the LSE-weighted sum, against the reference; one that fails
# serves its calls unsplit.


def _for_device(config, device, no_work: bool):
    if getattr(config.tuning, "num_ctas", 0) and not no_work:  # persistent: one CTA an SM
        config = config.with_tuning(num_ctas=sm_count(device))
    return config


def _self_checked(kernel, config, device, plan_args: tuple):
    """(kernel, config) that may serve the call: ``config`` itself, or when its compiled kernel
    fails the first-use self-check (``cute_fa.selftest``), the plan without its family (one
    warning a process naming the variant and the error); SelfCheckError when no other family
    implements the call. A packed GQA call whose other families do not pack runs unpacked
    there."""
    exclude: set[int] = set()
    while selftest.needs_check(config):
        error = selftest.failure(kernel, config, device)
        if not error:
            break
        exclude.add(config.arch)
        _, fallback, why = planning.try_plan(*plan_args, exclude=frozenset(exclude))
        if fallback is None and plan_args[1].pack_gqa:
            capability_, request, seqlen_hint, table = plan_args
            plan_args = (capability_, dataclasses.replace(request, pack_gqa=0),
                         seqlen_hint // request.pack_gqa, table)  # fmt: skip
            _, fallback, why = planning.try_plan(*plan_args, exclude=frozenset(exclude))
        if fallback is None:
            raise selftest.SelfCheckError(
                f"cute_fa: {config.name} failed its first-use self-check on this GPU ({error}) "
                f"and no other kernel implements the call ({why}); CUTE_FA_SELFTEST=0 runs it "
                f"unchecked"
            )
        fallback = _for_device(fallback, device, False)
        selftest.warn_fallback(config, error, fallback, device)
        config, kernel = fallback, _compiled_kernel(fallback)
    return kernel, config


# Note [allocation templates]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.empty(shape, dtype=..., device=...)`` parses three arguments on every call;
# ``torch.empty_like(t)`` takes all of them from ``t`` and costs about half as much host time.
# A plan keeps one-element tensors expanded to the shapes of out and lse: not dense (stride 0),
# so ``empty_like`` gives them contiguous strides, the layout the fake implementation promises.


def fwd_impl(
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    softmax_scale, causal, window_left, window_right, softcap, num_splits=1, pack_gqa=-1,
    page_table=None,
):  # fmt: skip
    if (
        cu_seqlens_q is None and cu_seqlens_k is None and seqused_q is None
        and seqused_k is None and page_table is None
    ):  # fmt: skip
        # The common batched call: a shorter key (device indices; a CPU tensor gives -1).
        key = (
            q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
            v.dtype, q.get_device(), k.get_device(), v.get_device(),
            causal, window_left, window_right, softcap > 0, tuned.state(), num_splits, pack_gqa,
        )  # fmt: skip
    else:
        key = (
            _tensor_key(q), _tensor_key(k), _tensor_key(v), _tensor_key(cu_seqlens_q),
            _tensor_key(cu_seqlens_k), _tensor_key(seqused_q), _tensor_key(seqused_k),
            causal, window_left, window_right, softcap > 0, tuned.state(), num_splits, pack_gqa,
            _tensor_key(page_table),
        )  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        plan, max_seqlen_q = _make_plan(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
            causal, window_left, window_right, softcap, num_splits, pack_gqa, page_table,
        )  # fmt: skip
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    else:
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGN_BYTES:
            check_alignment(q, k, v)
        if plan.has_int_metadata:
            max_seqlen_q = check_values_and_max_seqlen_q(
                plan.shapes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                check_values(q),
            )  # fmt: skip
            if page_table is not None and check_values(q):
                check_page_table_values(page_table, seqused_k, k.shape[1], k.shape[0])
    if not plan.varlen_q:
        max_seqlen_q = plan.seqlen_q

    if plan.seqused_q or plan.no_work:
        # Rows past seqused_q belong to no sequence, and without keys no row sees one: 0, -inf.
        device = plan.device
        out = torch.zeros(plan.out_shape, dtype=q.dtype, device=device)
        lse = torch.full(plan.lse_shape, float("-inf"), dtype=torch.float32, device=device)
        if plan.no_work:
            return out, lse
    else:
        out = torch.empty_like(plan.out_like)
        lse = torch.empty_like(plan.lse_like)
    # The kernels take 4-D q/k/v/out and 3-D lse: packed varlen tensors get a batch dim of 1.
    if plan.varlen_q:
        q4, out4, lse3 = q.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0)
    else:
        q4, out4, lse3 = q, out, lse
    k4, v4 = (k.unsqueeze(0), v.unsqueeze(0)) if plan.varlen_k else (k, v)
    if plan.num_splits > 1:
        _split_forward(plan, q4, k4, v4, out4, lse3, softmax_scale, softcap, max_seqlen_q,
                       cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table)  # fmt: skip
        return out, lse
    plan.kernel(
        q4, k4, v4, out4, lse3, softmax_scale, softcap, plan.window_left, plan.window_right,
        max_seqlen_q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
    )  # fmt: skip
    return out, lse


def _split_forward(
    plan, q4, k4, v4, out4, lse3, softmax_scale, softcap, max_seqlen_q,
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table=None,
):  # fmt: skip
    """The split-KV forward into fp32 partial buffers, then the combine into out4 (b, sq, h,
    dv) and lse3 (b, h, sq) (packed q: b = 1), Note [split-KV launches]."""
    splits, (b, sq, h, dv) = plan.num_splits, out4.shape
    out_p = torch.empty_like(plan.partial_out_like)  # (splits, b, sq, h, dv) fp32
    lse_p = torch.empty_like(plan.partial_lse_like)  # (splits, b, h, sq)
    plan.kernel(
        q4, k4, v4, out_p.view(splits * b, sq, h, dv), lse_p.view(splits * b, h, sq),
        softmax_scale, softcap, plan.window_left, plan.window_right, max_seqlen_q,
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
    )  # fmt: skip
    seqused = seqused_q
    cu = cu_seqlens_q if plan.varlen_q else None
    launch_combine(plan.combine, out_p, lse_p.transpose(-1, -2), out4, lse3.transpose(-1, -2),
                   cu, seqused)  # fmt: skip


def fwd_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    softmax_scale, causal, window_left, window_right, softcap, num_splits=1, pack_gqa=-1,
    page_table=None,
):  # fmt: skip
    causal, local, _, _ = resolve_window(causal, (window_left, window_right))
    shapes = check_metadata(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        causal=causal, local=local, softcap=softcap, page_table=page_table,
    )  # fmt: skip
    out = q.new_empty((*q.shape[:-1], shapes.head_dim_v))
    if shapes.varlen_q:
        lse = q.new_empty((shapes.nheads, shapes.seqlen_q), dtype=torch.float32)
    else:
        lse = q.new_empty((shapes.batch, shapes.nheads, shapes.seqlen_q), dtype=torch.float32)
    return out, lse


_lib = torch.library.Library("cute_fa", "DEF")
_lib.define(
    "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "Tensor? seqused_q, Tensor? seqused_k, int? max_seqlen_q, float softmax_scale, "
    "bool causal, int? window_left, int? window_right, float softcap, int num_splits=1, "
    "int pack_gqa=-1, Tensor? page_table=None) "
    "-> (Tensor, Tensor)"
)
# CPU too, so that CPU tensors reach the checks and get a clear error instead of a dispatcher
# message.
_lib.impl("fwd", fwd_impl, "CUDA")
_lib.impl("fwd", fwd_impl, "CPU")
torch.library.register_fake("cute_fa::fwd", fwd_fake, lib=_lib)
fwd_op = torch.ops.cute_fa.fwd.default


def bwd_impl(
    dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
    deterministic,
):  # fmt: skip
    device_of(
        (dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"), (dlse, "dlse"),
    )  # fmt: skip
    return run_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
        deterministic, dlse=dlse,
    )  # fmt: skip


def bwd_fake(
    dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
    deterministic,
):  # fmt: skip
    if dout.shape != out.shape:
        raise ValueError(f"dout has shape {tuple(dout.shape)}, out {tuple(out.shape)}")
    if dlse is not None and dlse.shape != lse.shape:
        raise ValueError(f"dlse has shape {tuple(dlse.shape)}, lse {tuple(lse.shape)}")
    # The real implementation returns contiguous gradients shaped and typed like q, k, v.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_lib.define(
    "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? seqused_q, Tensor? seqused_k, "
    "int? max_seqlen_q, int? max_seqlen_k, float softmax_scale, bool causal, int? window_left, "
    "int? window_right, float softcap, bool deterministic) -> (Tensor, Tensor, Tensor)"
)
_lib.impl("bwd", bwd_impl, "CUDA")
_lib.impl("bwd", bwd_impl, "CPU")
torch.library.register_fake("cute_fa::bwd", bwd_fake, lib=_lib)
bwd_op = torch.ops.cute_fa.bwd.default


def eager_cuda(t) -> bool:
    """A plain CUDA tensor outside any tracing or dispatch/function mode: the op's CUDA
    implementation may be called directly (Note [eager fast path])."""
    return (
        type(t) is torch.Tensor
        and t.is_cuda
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._is_torch_function_mode_enabled()
    )
