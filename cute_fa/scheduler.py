"""``get_scheduler_metadata`` (flash_attn.cute's signature) and the ``scheduler_metadata``
argument of ``flash_attn_varlen_func``: a call's host-side decisions computed ahead of it
(Note [scheduler metadata])."""

from __future__ import annotations

import dataclasses
import operator

import torch

from . import ops, planning, tuned
from .checks import (
    DTYPE_NAMES,
    MAX_HEAD_DIM,
    check_cu_seqlens_batch,
    check_int32_vector,
    check_tensor,
    device_of,
    resolve_num_splits,
    resolve_pack_gqa,
    resolve_window,
)

__all__ = ["SchedulerMetadata", "get_scheduler_metadata"]


# Note [scheduler metadata]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# flash_attn.cute's ``get_scheduler_metadata`` runs a prepare kernel that writes per-sequence
# tile and split counts into device tensors for its varlen tile schedulers. cute_fa's kernels
# schedule from the grid alone (one CTA a tile and split) and have no such tensors. What a
# cute_fa call takes from the host, besides pointers and shapes, is:
#   - ``max_seqlen_q`` of packed queries: it sizes the grid (and picks the tile); without it
#     the call reads ``cu_seqlens_q`` on the host, a device sync, which CUDA-graph capture
#     does not allow;
#   - the split count of ``num_splits=0`` (Note [split-KV heuristic] in cute_fa/planning.py):
#     from the tile, the head and batch counts, max_seqlen_q, a key length and the SM count;
#   - the packing decision of ``pack_gqa=None`` (Note [pack_gqa heuristic]): from max_seqlen_q,
#     the query heads per K/V head and the tile.
# None of these reads a tensor's values. ``get_scheduler_metadata`` computes all three from its
# arguments (numbers, flags, and the device of the sequence tensors: its compute capability, SM
# count and tuned table) with the planning code of a call (``ops._choose``), and returns them in
# a frozen ``SchedulerMetadata`` together with the call signature they were computed for.
# ``flash_attn_varlen_func(..., scheduler_metadata=md)`` checks that signature against its own
# arguments (ValueError naming each difference), then runs as the call with
# ``max_seqlen_q=md.max_seqlen_q, num_splits=md.num_splits, pack_gqa=md.pack_gqa``: the same
# launch plan, kernel and split count, so bitwise the same results as that call. (Each is the
# launch plan of its own signature, which keeps the tile of its first call's max_seqlen_q, as
# every varlen plan does: Note [launch plans] in cute_fa/ops.py.)
#
# The one input that the metadata and a call without it see differently is the key length of
# the split heuristic: the metadata takes ``max_seqlen_k`` (the longest key sequence, as
# flash_attn.cute's does), a call only the keys' extent (k.shape[1] of a dense cache,
# max_pages * page_size of a paged one, the average of packed keys). Where max_seqlen_k is that
# extent, num_splits=0 plans the same split count with and without the metadata; a smaller
# max_seqlen_k (a cache filled to less than its room) may split less: there are fewer keys.
#
# The signature checked: batch, head counts, head dims, max_seqlen_q (for a dense q, q.shape[1],
# the tile hint of such a call), max_seqlen_k (at most the keys' extent; the call's own value
# when given), causal / window, softcap on or off, which of cu_seqlens_q / cu_seqlens_k /
# seqused_q / seqused_k are given, num_splits and pack_gqa as asked, the device, and the tuning
# state (``cute_fa.tuning`` blocks, tuned-table writes; not in a call traced by torch.compile,
# whose graph runs under the overrides of its run). The dtype changes none of the three
# decisions on any kernel today, nor does paging where it keeps the kernel (pages of 16, 64, 256
# on sm90 and sm80; tests/test_scheduler_metadata.py checks that), so ``qkv_dtype`` and
# ``page_size`` are optional and checked only when given. Paging that moves a call to another
# kernel changes them: on sm100 (no paged kernel) and on sm90 for page sizes its TMA boxes do
# not take (not a multiple of 8, or of 16 at d 96 and 192) a paged call runs the sm80 forward's
# row gather, which neither packs nor tiles as the others do; pass ``page_size`` there.
# ``has_softcap`` changes the tile on some head dims and is part of the signature.
#
# Under CUDA-graph capture: compute the metadata before the capture (no sync either way), call
# once outside the capture (the compile), then capture the call with scheduler_metadata=md:
# value checks are skipped during capture and md's max_seqlen_q spares the read of
# cu_seqlens_q. A replay launches the grid and split count of capture time, so md.max_seqlen_q
# must stay at least the longest query sequence of every replay.


@dataclasses.dataclass(frozen=True)
class SchedulerMetadata:
    """What ``get_scheduler_metadata`` computed for one call signature (Note [scheduler
    metadata] in cute_fa/scheduler.py): the call's decisions and what they were computed for.
    Holds no tensor; flash_attn_varlen_func raises ValueError when used with another call.

    Decisions: ``max_seqlen_q`` (the grid's query length), ``num_splits`` (the split-KV count
    the call runs; 1: none) and ``pack_gqa`` (whether the call packs query heads). The rest is
    the signature: ``max_seqlen_k`` (the split heuristic's key length), ``batch``, ``nheads``,
    ``nheads_kv``, ``headdim``, ``headdim_v``, ``causal``, ``window_size`` (``(left, right)``
    as resolved: None unbounded, ``(None, None)`` no window), ``has_softcap``, which of
    cu_seqlens_q / cu_seqlens_k / seqused_q / seqused_k were given (``varlen_q``, ``varlen_k``,
    ``has_seqused_q``, ``has_seqused_k``), ``page_size`` and ``qkv_dtype`` (None: not stated,
    not checked), the arguments ``num_splits_asked`` (0: the heuristic) and ``pack_gqa_asked``
    (None / False / True), the CUDA ``device`` and the tuning state."""

    max_seqlen_q: int
    num_splits: int
    pack_gqa: bool
    max_seqlen_k: int
    batch: int
    nheads: int
    nheads_kv: int
    headdim: int
    headdim_v: int
    causal: bool
    window_size: tuple[int | None, int | None]
    has_softcap: bool
    varlen_q: bool
    varlen_k: bool
    has_seqused_q: bool
    has_seqused_k: bool
    page_size: int | None
    qkv_dtype: torch.dtype | None
    num_splits_asked: int
    pack_gqa_asked: bool | None
    device: torch.device
    tuning_state: tuple = dataclasses.field(repr=False, compare=False)


def _count(value, name: str, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _batch_of(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) -> int:
    """The batch size the sequence tensors give (their lengths, not their values)."""
    sizes = {}
    for t, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        if t is not None:
            sizes[name] = check_cu_seqlens_batch(t, name)
    for t, name in ((seqused_q, "seqused_q"), (seqused_k, "seqused_k")):
        if t is not None:
            check_tensor(t, name)
            if t.dtype != torch.int32:
                raise TypeError(f"{name} must be torch.int32, got {t.dtype}")
            if t.dim() != 1:
                raise ValueError(f"{name} must be 1-D (batch), got shape {tuple(t.shape)}")
            check_int32_vector(t, name, t.shape[0], "batch")
            sizes[name] = t.shape[0]
    if not sizes:
        raise ValueError(
            "get_scheduler_metadata needs at least one of cu_seqlens_q, cu_seqlens_k, "
            "seqused_q, seqused_k (they give the batch size and the device)"
        )
    if len(set(sizes.values())) > 1:
        given = ", ".join(f"{name}: {n}" for name, n in sizes.items())
        raise ValueError(f"the sequence tensors give different batch sizes ({given})")
    return next(iter(sizes.values()))


def _reject_append_kv(seqlen_k_new, cu_seqlens_k_new, leftpad_k, seqlen_k_per_split) -> None:
    for name, value, off in (
        ("seqlen_k_new", seqlen_k_new, 0),
        ("cu_seqlens_k_new", cu_seqlens_k_new, None),
        ("leftpad_k", leftpad_k, None),
        ("seqlen_k_per_split", seqlen_k_per_split, None),
    ):
        if value is not off and (isinstance(value, torch.Tensor) or value != off):
            given = (
                f"a tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else repr(value)[:80]
            )
            raise NotImplementedError(
                f"cute_fa: get_scheduler_metadata's {name} is not implemented (got {given}): "
                f"cute_fa's calls append no keys and take no left padding or fixed split "
                f"length; pass {off}"
            )


def get_scheduler_metadata(
    max_seqlen_q: int,
    max_seqlen_k: int,
    nheads: int,
    nheads_kv: int,
    headdim: int,
    num_splits: int,
    headdim_v: int | None = None,
    pack_gqa: bool | None = None,
    causal: bool = False,
    window_size_left: int | None = None,
    window_size_right: int | None = None,
    seqlen_k_new: int = 0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqlen_k_per_split: int | None = None,
    _arch: int | None = None,
    *,
    has_softcap: bool = False,
    page_size: int | None = None,
    qkv_dtype: torch.dtype | None = None,
) -> SchedulerMetadata:
    """The host-side decisions of a ``flash_attn_varlen_func`` call, computed ahead of it and
    without reading any tensor's values (no device sync): for a decode step captured in a CUDA
    graph. Pass the result as ``scheduler_metadata=`` to the call it was computed for (Note
    [scheduler metadata] in cute_fa/scheduler.py).

    Same signature as ``flash_attn.cute.interface.get_scheduler_metadata``; returns a
    ``SchedulerMetadata`` (no tensors, unlike flash_attn.cute's prepare-kernel output):
    ``max_seqlen_q``, ``num_splits`` (the split count the call runs: ``num_splits`` 0 or None
    the heuristic's count for these sizes and this GPU's SM count, 1 none, n > 1 that many,
    capped to the grid) and ``pack_gqa`` (whether the call packs query heads: ``pack_gqa``
    None the heuristic's choice, True where a kernel packs, False never), plus the signature
    the call must match.

    Arguments as the call's: ``max_seqlen_q`` the longest query sequence (for a dense q,
    q.shape[1]); ``max_seqlen_k`` the longest key sequence (the split heuristic's key length;
    at most the keys' extent); ``nheads`` / ``nheads_kv`` / ``headdim`` / ``headdim_v`` (None:
    headdim); ``causal`` and ``window_size_left`` / ``window_size_right`` (the call's
    ``window_size``); ``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_q``, ``seqused_k``: those
    the call passes (at least one), for their lengths (the batch size), their device (a CUDA
    device: the SM count, compute capability and tuned table of that GPU decide) and which are
    given; their values are not read. ``num_splits`` and ``pack_gqa`` as the call passes them.

    cute_fa's keyword arguments (flash_attn.cute has none of them; FA3's
    ``get_scheduler_metadata`` has ``has_softcap``, ``page_size`` and ``qkv_dtype``):
    ``has_softcap`` whether the call has ``softcap > 0``; ``page_size`` the page size of a
    paged call and ``qkv_dtype`` its dtype, both checked against the call only when given (they
    change no decision).

    Accepted for flash_attn.cute compatibility with no meaning here: ``_arch`` (the device
    decides); ``seqlen_k_new``, ``cu_seqlens_k_new``, ``leftpad_k`` and
    ``seqlen_k_per_split`` raise NotImplementedError unless 0 / None (cute_fa's calls append
    no keys and take no left padding or fixed split length).

    Errors: TypeError / ValueError for bad arguments (naming them), ValueError for sequence
    tensors not on a CUDA device, NotImplementedError where no kernel of the device implements
    the call (as the call would raise).
    """
    _reject_append_kv(seqlen_k_new, cu_seqlens_k_new, leftpad_k, seqlen_k_per_split)
    max_seqlen_q = _count(max_seqlen_q, "max_seqlen_q", 0)
    max_seqlen_k = _count(max_seqlen_k, "max_seqlen_k", 0)
    nheads = _count(nheads, "nheads", 1)
    nheads_kv = _count(nheads_kv, "nheads_kv", 1)
    if nheads % nheads_kv:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    headdim = _count(headdim, "headdim", 1)
    headdim_v = headdim if headdim_v is None else _count(headdim_v, "headdim_v", 1)
    for dim, name in ((headdim, "headdim"), (headdim_v, "headdim_v")):
        if dim % 8 or dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{name} must be a positive multiple of 8 and at most {MAX_HEAD_DIM}, got {dim}"
            )
    splits_asked = resolve_num_splits(num_splits)
    pack_asked = resolve_pack_gqa(pack_gqa)
    causal, local, left, right = resolve_window(bool(causal), (window_size_left, window_size_right))
    if page_size is not None:
        page_size = _count(page_size, "page_size", 1)
        if cu_seqlens_k is not None:
            raise ValueError("page_size and cu_seqlens_k cannot be used together (a paged call)")
    if qkv_dtype is not None and qkv_dtype not in DTYPE_NAMES:
        raise TypeError(f"qkv_dtype must be torch.float16 or torch.bfloat16, got {qkv_dtype}")
    batch = _batch_of(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    device = device_of(
        (cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"),
        (seqused_q, "seqused_q"), (seqused_k, "seqused_k"),
    )  # fmt: skip
    request = planning.FwdRequest(
        dtype=DTYPE_NAMES.get(qkv_dtype, "bf16"),
        head_dim=headdim,
        head_dim_v=headdim_v,
        causal=causal,
        local=local,
        has_softcap=bool(has_softcap),
        varlen_q=cu_seqlens_q is not None,
        varlen_k=cu_seqlens_k is not None,
        seqused_q=seqused_q is not None,
        seqused_k=seqused_k is not None,
        page_size=page_size or 0,
    )
    planning.check_fwd_implementable_somewhere(request)
    splits, packs = ops.scheduler_choice(
        device, request, batch, nheads, nheads_kv, max_seqlen_q, max_seqlen_k, splits_asked,
        pack_asked,
    )  # fmt: skip
    return SchedulerMetadata(
        max_seqlen_q=max_seqlen_q,
        num_splits=splits,
        pack_gqa=packs,
        max_seqlen_k=max_seqlen_k,
        batch=batch,
        nheads=nheads,
        nheads_kv=nheads_kv,
        headdim=headdim,
        headdim_v=headdim_v,
        causal=causal,
        window_size=(left, right),
        has_softcap=bool(has_softcap),
        varlen_q=request.varlen_q,
        varlen_k=request.varlen_k,
        has_seqused_q=request.seqused_q,
        has_seqused_k=request.seqused_k,
        page_size=page_size,
        qkv_dtype=qkv_dtype,
        num_splits_asked=splits_asked,
        pack_gqa_asked=pack_gqa,
        device=device,
        tuning_state=tuned.state(),
    )


def _key_room(k, cu_seqlens_k, page_table) -> tuple[int, str] | None:
    """The most keys a sequence can have in this call's tensors, and what that is; None when
    the shapes are malformed (the call's checks name them)."""
    if page_table is not None:
        if k.dim() == 4 and isinstance(page_table, torch.Tensor) and page_table.dim() == 2:
            return page_table.shape[1] * k.shape[1], "max_pages * page_size"
        return None
    if cu_seqlens_k is not None:
        return (k.shape[0], "total_k, k.shape[0]") if k.dim() == 3 else None
    return (k.shape[1], "k.shape[1]") if k.dim() == 4 else None


def call_arguments(
    md, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
    max_seqlen_q, max_seqlen_k, causal, window_left, window_right, softcap, num_splits,
    pack_gqa,
) -> tuple[int, int, int, int]:  # fmt: skip
    """(max_seqlen_q, max_seqlen_k, num_splits, pack_gqa) for the op of a
    ``flash_attn_varlen_func`` call with ``scheduler_metadata=md``: md's decisions, once md's
    signature matches the call's arguments (ValueError naming each difference otherwise;
    TypeError when md is not a SchedulerMetadata). ``causal`` / ``window_*`` as
    ``checks.window_args`` gives them; ``num_splits`` and ``pack_gqa`` as the op takes them;
    ``max_seqlen_*`` the call's, or None. Tensor extents are compared where the tensors have
    the ranks the call needs; other ranks are left to the call's checks."""
    if not isinstance(md, SchedulerMetadata):
        raise TypeError(
            f"scheduler_metadata must be what cute_fa.get_scheduler_metadata returns, got "
            f"{type(md).__name__}"
        )
    problems = []

    def differ(name: str, computed, call) -> None:
        if computed != call:
            problems.append(f"{name} {computed!r}, this call {call!r}")

    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    differ("cu_seqlens_q given:", md.varlen_q, varlen_q)
    differ("cu_seqlens_k given:", md.varlen_k, varlen_k)
    differ("seqused_q given:", md.has_seqused_q, seqused_q is not None)
    differ("seqused_k given:", md.has_seqused_k, seqused_k is not None)
    if q.dim() == (3 if varlen_q else 4) and k.dim() >= 3 and v.dim() >= 3:
        differ("nheads", md.nheads, q.shape[-2])
        differ("nheads_kv", md.nheads_kv, k.shape[-2])
        differ("headdim", md.headdim, q.shape[-1])
        differ("headdim_v", md.headdim_v, v.shape[-1])
        if not varlen_q:
            differ("batch (q.shape[0])", md.batch, q.shape[0])
            differ("max_seqlen_q (for a dense q, q.shape[1])", md.max_seqlen_q, q.shape[1])
    if varlen_q and isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1:
        differ("batch (len(cu_seqlens_q) - 1)", md.batch, cu_seqlens_q.shape[0] - 1)
    room = _key_room(k, cu_seqlens_k, page_table)
    if room is not None and md.max_seqlen_k > room[0]:
        problems.append(f"max_seqlen_k {md.max_seqlen_k}, more than this call's keys hold "
                        f"({room[1]} = {room[0]})")  # fmt: skip
    if max_seqlen_q is not None:
        differ("max_seqlen_q", md.max_seqlen_q, max_seqlen_q)
    if max_seqlen_k is not None:
        differ("max_seqlen_k", md.max_seqlen_k, max_seqlen_k)
    _, _, left, right = resolve_window(causal, (window_left, window_right))
    differ("causal", md.causal, causal)
    differ("window_size", md.window_size, (left, right))
    differ("has_softcap", md.has_softcap, softcap > 0)
    if md.page_size is not None:
        paged = page_table is not None and k.dim() == 4
        differ("page_size", md.page_size, k.shape[1] if paged else None)
    if md.qkv_dtype is not None:
        differ("qkv_dtype", md.qkv_dtype, q.dtype)
    differ("num_splits (0: the heuristic)", md.num_splits_asked, num_splits)
    differ("pack_gqa", md.pack_gqa_asked, {-1: None, 0: False, 1: True}[pack_gqa])
    differ("device", md.device, q.device)
    # (Traced by torch.compile, the call has no tuning context to compare: the graph runs under
    # the overrides active when it runs.)
    if not torch.compiler.is_compiling() and md.tuning_state != tuned.state():
        problems.append("another tuning state (a cute_fa.tuning block or a tuned-table write)")
    if problems:
        given = "; ".join(problems)
        raise ValueError(
            f"cute_fa: scheduler_metadata was computed for another call ({given}): call "
            f"get_scheduler_metadata with this call's arguments"
        )
    return (
        md.max_seqlen_q,
        md.max_seqlen_k if max_seqlen_k is None else max_seqlen_k,
        md.num_splits,
        int(md.pack_gqa),
    )
