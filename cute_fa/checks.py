"""Input checks and argument normalisation of the torch API (no launch, no compile here).

Checks, in order (each names the argument; all run before any compile or launch):
  1. metadata, also under torch.compile's fake tensors (``check_metadata``): tensor types,
     dtypes (TypeError), ranks, head dims, head counts, batch/sequence extents, strides
     (ValueError), cu_seqlens / seqused dtype, rank and length; then "no kernel on any GPU
     implements this" (NotImplementedError, e.g. head_dim 80);
  2. data pointers 16-byte aligned (``check_alignment``, ValueError);
  3. values of cu_seqlens / seqused, read on the host (one device sync,
     ``check_values_and_max_seqlen_q``), see ``cute_fa.api``'s module docstring;
  4. the device (``device_of``): every tensor on one CUDA device (ValueError; so CPU tensors
     pass 1-3 and fail here), then the device's compute capability (NotImplementedError, in
     planning).
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch

from . import planning, settings

__all__ = ["resolve_window", "WINDOW_INF"]

# Unbounded window side as passed to the kernels; equals cute_fa.dsl.mask.WINDOW_INF (kept
# here so that importing the torch layer does not import the DSL). Larger window ints are
# clamped to it: no sequence is that long.
WINDOW_INF = 1 << 29

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
MAX_HEAD_DIM = 256
ALIGN_BYTES = 16
STRIDE_MULTIPLE = 8  # elements: 16 bytes of a 16-bit dtype

# CUTE_FA_SKIP_CHECKS=1 (cute_fa.settings), read at import: skip the value checks.
SKIP_VALUE_CHECKS = settings.skip_value_checks()


# --------------------------------------------------------------------------------------------
# Argument normalisation


def as_window_int(value, name: str) -> int | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int or None, got {value!r}") from None


def resolve_window(
    causal: bool, window_size: tuple[int | None, int | None] | None
) -> tuple[bool, bool, int | None, int | None]:
    """Normalise (causal, window_size) to (causal, local, window_left, window_right).

    causal=True sets right = 0. A window of (None, 0) is causal; any other window with an int
    is local; (None, None) is no mask. Returned bounds: None for unbounded; causal -> (None, 0).
    """
    if window_size is None:
        window_size = (None, None)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(
            f"window_size must be a pair (left, right) of ints or None, got {window_size!r}"
        ) from None
    left = as_window_int(left, "window_size[0]")
    right = as_window_int(right, "window_size[1]")
    if causal:
        right = 0
    if left is None and right is None:
        return False, False, None, None
    if left is None and right == 0:
        return True, False, None, 0
    return False, True, left, right


def window_args(causal, window_size) -> tuple[bool, int | None, int | None]:
    """(causal, window_left, window_right) for the op; the common no-window case skips
    ``resolve_window``."""
    if window_size is None or (type(window_size) is tuple and window_size == (None, None)):
        return (True, None, 0) if causal else (False, None, None)
    causal, _, left, right = resolve_window(causal, window_size)
    return causal, left, right


def resolve_num_splits(num_splits) -> int:
    """flash_attn.cute's ``num_splits`` as the op takes it: 1 off, n > 1 that many, 0 the
    heuristic (for None, 0 and negative values)."""
    if num_splits is None:
        return 0
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None, got {num_splits!r}")
    return max(num_splits, 0)


def resolve_pack_gqa(pack_gqa) -> int:
    """flash_attn.cute's ``pack_gqa`` as the op takes it: -1 automatic (None), 0 off (False),
    1 on (True)."""
    if pack_gqa is None:
        return -1
    if not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be True, False or None, got {pack_gqa!r}")
    return int(pack_gqa)


def check_cu_seqlens_batch(cu_seqlens: torch.Tensor, name: str) -> int:
    """The batch size of a ``cu_seqlens`` that sets it (a tensor, int32, 1-D with batch + 1 >= 1
    entries, as ``check_int32_vector`` wants them); TypeError / ValueError naming ``name``."""
    check_tensor(cu_seqlens, name)
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"{name} must be 1-D with batch + 1 >= 1 entries, got shape {shape_str(cu_seqlens)}"
        )
    batch = cu_seqlens.shape[0] - 1
    check_int32_vector(cu_seqlens, name, batch + 1, "batch + 1")
    return batch


def kernel_window(local: bool, left: int | None, right: int | None) -> tuple[int, int]:
    if not local:
        return 0, 0
    left = WINDOW_INF if left is None else max(-WINDOW_INF, min(WINDOW_INF, left))
    right = WINDOW_INF if right is None else max(-WINDOW_INF, min(WINDOW_INF, right))
    return left, right


def reject_unimplemented(**kwargs) -> None:
    for name, value in kwargs.items():
        if name == "num_splits":
            off = value is None or (isinstance(value, int) and value <= 1)
        else:
            off = value is None
        if not off:
            if isinstance(value, torch.Tensor):
                given = f"a tensor of shape {tuple(value.shape)}"
            else:
                given = repr(value)[:80]
            raise NotImplementedError(
                f"cute_fa: {name} is not implemented yet (got {given}); the argument is "
                f"accepted for flash_attn.cute compatibility, pass "
                f"{planning.UNIMPLEMENTED_ARGUMENTS[name]}"
            )


def resolve_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    # Comparisons rather than math.isfinite: under torch.compile these may be symbolic floats.
    if not -math.inf < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return softmax_scale


# Note [softmax_scale the kernels take]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The kernels keep the running max of the unscaled scores and fold the scale into the exponent
# (Note [base-2 online softmax]); that max is the max of the scaled scores only for a scale >= 0.
# With a negative scale every p = exp2((s - max s) * scale_log2) would be >= 1 and overflow to
# inf once the scores of a row spread by more than ~128 / |scale_log2|. The scaled scores
# |scale| * ((-q) k^T) are exactly scale * (q k^T) (negation is exact), softcap included, so a
# call with a negative scale runs on -q and |scale|; autograd takes dq through the negation.
#
# A scale of 0 becomes SCALE_FOR_ZERO: the kernels mask a score by setting it to -inf before the
# scale multiplies it, and -inf * 0 is NaN. Scaled by 1e-30, every finite score (|s| < 1e8 here
# in practice) is 0 to fp32 precision in the exponent, so p = 1 exactly, as with a scale of 0,
# while a masked -inf stays -inf; the gradients w.r.t. q and k are ~1e-30 times those of scale
# 1 where scale 0 gives exactly 0.
SCALE_FOR_ZERO = 1e-30


def kernel_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    # (Other dtypes, and non-tensors, are left for the input checks to reject by name.)
    if scale < 0 and isinstance(q, torch.Tensor) and q.dtype in (torch.float16, torch.bfloat16):
        return -q, -scale
    if scale == 0:
        return q, SCALE_FOR_ZERO
    return q, scale


def resolve_softcap(softcap) -> float:
    value = 0.0 if softcap is None else softcap
    if not 0.0 <= value < math.inf:
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    return value


# --------------------------------------------------------------------------------------------
# Checks


class Shapes(NamedTuple):
    batch: int
    seqlen_q: int  # per batch entry; the packed total for varlen q
    seqlen_k: int  # likewise
    nheads: int
    nheads_kv: int
    head_dim: int
    head_dim_v: int
    varlen_q: bool
    varlen_k: bool
    request: planning.FwdRequest  # what the call asks of a kernel (the compile key, less arch)


def shape_str(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_int32_vector(t, name: str, length: int, what: str) -> None:
    check_tensor(t, name)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D ({what}), got shape {shape_str(t)}")
    if t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries ({what}), got {t.shape[0]}")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def check_page_table(page_table, batch: int, k) -> None:
    """page_table: int32 (batch, max_pages) with contiguous rows; k (num_pages, page_size, ...)
    with at least one page of at least one key (flash_attn.cute's paged layout)."""
    check_tensor(page_table, "page_table")
    if page_table.dtype != torch.int32:
        raise TypeError(f"page_table must be torch.int32, got {page_table.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(
            f"page_table must be 2-D (batch = {batch}, max_pages), got shape "
            f"{shape_str(page_table)}"
        )
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(
            f"page_table must be contiguous in its last dim, got strides {page_table.stride()}"
        )
    if k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError(
            f"paged k must have at least one page of at least one key (num_pages, page_size, "
            f"nheads_kv, head_dim), got shape {shape_str(k)}"
        )


def check_page_table_values(page_table, seqused_k, page_size: int, num_pages: int) -> None:
    """Every page a sequence uses (the first ceil(seqused_k / page_size) entries of its row;
    every entry without seqused_k) is in [0, num_pages). The value check reads one count."""
    used = page_table.shape[1]
    slots = torch.arange(used, device=page_table.device)
    if seqused_k is not None:
        pages_used = (seqused_k.to(page_table.device).long() + page_size - 1) // page_size
        in_use = slots[None, :] < pages_used[:, None]
    else:
        in_use = torch.ones_like(page_table, dtype=torch.bool)
    bad = ((page_table < 0) | (page_table >= num_pages)) & in_use
    count = int(bad.sum())
    if count:
        first = [int(x) for x in bad.nonzero()[0].tolist()]
        raise ValueError(
            f"page_table has {count} used entries outside [0, num_pages = {num_pages}), e.g. "
            f"page_table[{first[0]}, {first[1]}] = {int(page_table[first[0], first[1]])}"
        )


def check_strides(t: torch.Tensor, name: str) -> None:
    strides = t.stride()
    if t.shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dim (stride 1), got strides {strides}; "
            f"pass {name}.contiguous()"
        )
    for dim, s in enumerate(strides[:-1]):
        if s % STRIDE_MULTIPLE != 0:
            raise ValueError(
                f"{name}.stride({dim}) = {s} is not a multiple of {STRIDE_MULTIPLE} elements "
                f"(16 bytes), strides {strides}; pass {name}.contiguous()"
            )


def check_metadata(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    *,
    causal=False,
    local=False,
    softcap=0.0,
    page_table=None,
) -> Shapes:
    """Checks that need no data: types, dtypes, ranks, extents, strides, sequence metadata.
    ``page_table``: paged K/V (k and v (num_pages, page_size, nheads_kv, d)), flash_attn.cute's
    layout; its values are checked with the other metadata (``check_values_and_max_seqlen_q``)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_tensor(t, name)
    if q.dtype not in DTYPE_NAMES:
        raise TypeError(f"q.dtype must be torch.float16 or torch.bfloat16, got {q.dtype}")
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype ({t.dtype}) differs from q.dtype ({q.dtype})")

    varlen_q = cu_seqlens_q is not None
    varlen_k = cu_seqlens_k is not None
    paged = page_table is not None
    if paged and varlen_k:
        raise ValueError(
            "page_table and cu_seqlens_k cannot be used together (as in flash_attn.cute): with "
            "pages, seqused_k gives each sequence's key count"
        )
    for t, name, varlen, cu in (
        (q, "q", varlen_q, "cu_seqlens_q"),
        (k, "k", varlen_k, "cu_seqlens_k"),
        (v, "v", varlen_k, "cu_seqlens_k"),
    ):
        want = 3 if varlen else 4
        if t.dim() != want:
            layout = "(total, nheads, head_dim)" if varlen else "(batch, seqlen, nheads, head_dim)"
            given = f"with {cu}" if varlen else f"without {cu}"
            if paged and name != "q":
                layout, given = "(num_pages, page_size, nheads_kv, head_dim)", "with page_table"
            raise ValueError(f"{name} must be {want}-D {layout} {given}, got shape {shape_str(t)}")

    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(
            f"k.shape[-1] ({k.shape[-1]}) must equal q.shape[-1] ({head_dim}), the head dim"
        )
    for dim, name in (
        (head_dim, "head_dim (q.shape[-1])"),
        (head_dim_v, "head_dim_v (v.shape[-1])"),
    ):
        if dim <= 0 or dim % 8 != 0 or dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{name} must be a positive multiple of 8 and at most {MAX_HEAD_DIM}, got {dim}"
            )

    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != nheads_kv:
        raise ValueError(f"v has {v.shape[-2]} heads, k has {nheads_kv}; they must match")
    if nheads_kv < 1 or nheads < 1:
        raise ValueError(f"need at least one head, got nheads={nheads}, nheads_kv={nheads_kv}")
    if nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads ({nheads}, q.shape[-2]) must be a multiple of nheads_kv ({nheads_kv}, "
            f"k.shape[-2])"
        )

    # Batch and sequence extents.
    if k.shape[:-2] != v.shape[:-2]:
        what = "total_k" if varlen_k else "(num_pages, page_size)" if paged else "(batch, seqlen_k)"
        raise ValueError(f"k and v must agree in {what}: k {shape_str(k)}, v {shape_str(v)}")
    if varlen_q:
        batch = check_cu_seqlens_batch(cu_seqlens_q, "cu_seqlens_q")
    else:
        batch = q.shape[0]
    if varlen_k:
        check_tensor(cu_seqlens_k, "cu_seqlens_k")
        if varlen_q and cu_seqlens_k.dim() == 1 and cu_seqlens_k.shape[0] != batch + 1:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                f"{batch + 1} and {cu_seqlens_k.shape[0]}"
            )
        check_int32_vector(cu_seqlens_k, "cu_seqlens_k", batch + 1, "batch + 1")
    elif paged:
        check_page_table(page_table, batch, k)
    elif k.shape[0] != batch:
        source = "len(cu_seqlens_q) - 1" if varlen_q else "q.shape[0]"
        raise ValueError(
            f"k.shape[0] ({k.shape[0]}) must equal the batch size ({source} = {batch})"
        )
    if seqused_q is not None:
        check_int32_vector(seqused_q, "seqused_q", batch, "batch")
    if seqused_k is not None:
        check_int32_vector(seqused_k, "seqused_k", batch, "batch")

    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_strides(t, name)

    request = planning.FwdRequest(
        dtype=DTYPE_NAMES[q.dtype],
        head_dim=int(head_dim),
        head_dim_v=int(head_dim_v),
        causal=causal,
        local=local,
        has_softcap=softcap > 0,
        varlen_q=varlen_q,
        varlen_k=varlen_k,
        seqused_q=seqused_q is not None,
        seqused_k=seqused_k is not None,
        page_size=int(k.shape[1]) if paged else 0,
    )
    planning.check_fwd_implementable_somewhere(request)
    seqlen_k = k.shape[0] if varlen_k else k.shape[1]
    if paged:  # every sequence's room: its row of the page table
        seqlen_k = page_table.shape[1] * k.shape[1]
    return Shapes(
        batch=batch,
        seqlen_q=q.shape[0] if varlen_q else q.shape[1],
        seqlen_k=seqlen_k,
        nheads=nheads,
        nheads_kv=nheads_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        varlen_q=varlen_q,
        varlen_k=varlen_k,
        request=request,
    )


def check_alignment(q, k, v) -> None:
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.data_ptr() % ALIGN_BYTES != 0 and t.numel() > 0:
            raise ValueError(
                f"{name}.data_ptr() must be {ALIGN_BYTES}-byte aligned, got {t.data_ptr():#x} "
                f"(a view at an odd offset?); pass {name}.clone()"
            )


def check_cu_seqlens(values: list[int], name: str, total: int, total_name: str) -> list[int]:
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:], strict=True)]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(
                f"{name} must be non-decreasing; {name}[{i + 1}] = {values[i + 1]} < "
                f"{name}[{i}] = {values[i]}"
            )
    if values[-1] != total:
        raise ValueError(
            f"{name}[-1] ({values[-1]}) must equal {total_name} ({total}): every packed row "
            f"belongs to a sequence"
        )
    return lengths


def check_seqused(values: list[int], name: str, room: list[int], room_name: str) -> None:
    for b, (u, r) in enumerate(zip(values, room, strict=True)):
        if u < 0 or u > r:
            raise ValueError(f"{name}[{b}] = {u} is outside [0, {r}] ({room_name} of sequence {b})")


def check_values_and_max_seqlen_q(
    shapes: Shapes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, check: bool
) -> int:
    """Check the values of the sequence metadata (when ``check``); return max_seqlen_q.

    One device-to-host copy of all the int32 metadata together when checking; without checks
    a varlen call with no max_seqlen_q still reads cu_seqlens_q to size the grid.
    """
    if not check:
        if not shapes.varlen_q:
            return shapes.seqlen_q
        if max_seqlen_q is not None:
            return max_seqlen_q
        return int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if shapes.batch > 0 else 0
    parts = [t for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) if t is not None]
    if not parts:
        return shapes.seqlen_q
    if len({t.device for t in parts}) > 1:  # mixed devices: the device check names them next
        parts = [t.cpu() for t in parts]
    values = iter(torch.cat([t.reshape(-1) for t in parts]).tolist())
    batch = shapes.batch

    def take(n: int) -> list[int]:
        return [next(values) for _ in range(n)]

    lens_q = [shapes.seqlen_q] * batch
    lens_k = [shapes.seqlen_k] * batch
    if cu_seqlens_q is not None:
        lens_q = check_cu_seqlens(
            take(batch + 1), "cu_seqlens_q", shapes.seqlen_q, "total_q (q.shape[0])"
        )
    if cu_seqlens_k is not None:
        lens_k = check_cu_seqlens(
            take(batch + 1), "cu_seqlens_k", shapes.seqlen_k, "total_k (k.shape[0])"
        )
    used_q = lens_q
    if seqused_q is not None:
        used_q = take(batch)
        room = "its cu_seqlens_q extent" if shapes.varlen_q else "seqlen_q, q.shape[1]"
        check_seqused(used_q, "seqused_q", lens_q, room)
    if seqused_k is not None:
        room = "its cu_seqlens_k extent" if shapes.varlen_k else "seqlen_k, k.shape[1]"
        if shapes.request.page_size:
            room = "its page_table row, max_pages * page_size"
        check_seqused(take(batch), "seqused_k", lens_k, room)
    if not shapes.varlen_q:
        return shapes.seqlen_q
    longest = max(used_q, default=0)
    if max_seqlen_q is None:
        return longest
    if max_seqlen_q < longest:
        raise ValueError(
            f"max_seqlen_q ({max_seqlen_q}) is smaller than the longest query sequence ({longest})"
        )
    return max_seqlen_q


def device_of(*named_tensors) -> torch.device:
    """The one CUDA device of all given tensors (ValueError otherwise)."""
    device = None
    for t, name in named_tensors:
        if t is None:
            continue
        if t.device.type != "cuda":
            hint = "" if torch.cuda.is_available() else " (this torch build or machine has no CUDA)"
            raise ValueError(
                f"cute_fa runs on CUDA GPUs: {name} is on {t.device}; move the inputs to a CUDA "
                f"device{hint}"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}: use one device")
    return device


def check_learnable_sink(sink, nheads: int, q: torch.Tensor) -> None:
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor, got {type(sink).__name__}")
    if sink.dim() != 1 or sink.shape[0] != nheads:
        raise ValueError(
            f"learnable_sink must have shape (nheads,) = ({nheads},), got {tuple(sink.shape)}"
        )
    if not sink.dtype.is_floating_point:
        raise TypeError(f"learnable_sink must be a floating-point tensor, got {sink.dtype}")
    if sink.device != q.device:
        raise ValueError(f"learnable_sink is on {sink.device}, q on {q.device}")


def check_values(q) -> bool:
    """Whether to read and check the varlen metadata values (a host sync) on this call."""
    return not SKIP_VALUE_CHECKS and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
