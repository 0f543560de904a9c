"""The torch API: ``flash_attn_func`` and ``flash_attn_varlen_func`` (drop-ins for
``flash_attn.cute``), their input checks, the ``cute_fa::fwd`` custom op and autograd.

Call path: argument normalisation (window, scale, unimplemented flash_attn.cute arguments) ->
``torch.ops.cute_fa.fwd`` (a ``torch.library`` op with a fake implementation, so
``torch.compile(fullgraph=True)`` traces it without graph breaks) -> checks -> dispatch by the
device's compute capability -> compile cache -> launch on torch's current CUDA stream.

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

Return convention (as flash_attn.cute): ``(out, lse)``; lse is fp32 (batch, nheads, seqlen_q),
or (nheads, total_q) for packed varlen queries, when ``return_lse=True`` or when an input
requires grad; otherwise ``lse`` is None.

Backward: ``cute_fa::bwd`` (a custom op with a fake implementation too, so torch.compile traces
forward and backward without graph breaks) runs ``cute_fa.backward.run_backward``: gradients
for q, k, v, also through a used ``lse`` (dLSE). ``deterministic=True`` makes the gradients
bitwise reproducible (dQ summed in a fixed order; dK and dV always are). For packed keys the
backward's grid needs ``max_seqlen_k``: pass it to ``flash_attn_varlen_func`` to avoid a host
sync (and under CUDA-graph capture, where that sync is not allowed).
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
from typing import NamedTuple

import torch

from . import dispatch

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "resolve_window", "WINDOW_INF"]

# Unbounded window side as passed to the kernels; equals cute_fa.dsl.mask.WINDOW_INF (kept
# here so that importing the torch layer does not import the DSL). Larger window ints are
# clamped to it: no sequence is that long.
WINDOW_INF = 1 << 29

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
MAX_HEAD_DIM = 256
ALIGN_BYTES = 16
STRIDE_MULTIPLE = 8  # elements: 16 bytes of a 16-bit dtype

SKIP_VALUE_CHECKS = os.environ.get("CUTE_FA_SKIP_CHECKS", "0").strip() not in ("", "0")


# --------------------------------------------------------------------------------------------
# Argument normalisation


def _as_window_int(value, name: str) -> int | None:
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
    left = _as_window_int(left, "window_size[0]")
    right = _as_window_int(right, "window_size[1]")
    if causal:
        right = 0
    if left is None and right is None:
        return False, False, None, None
    if left is None and right == 0:
        return True, False, None, 0
    return False, True, left, right


def _window_args(causal, window_size) -> tuple[bool, int | None, int | None]:
    """(causal, window_left, window_right) for the op; the common no-window case skips
    ``resolve_window``."""
    if window_size is None or (type(window_size) is tuple and window_size == (None, None)):
        return (True, None, 0) if causal else (False, None, None)
    causal, _, left, right = resolve_window(causal, window_size)
    return causal, left, right


def _kernel_window(local: bool, left: int | None, right: int | None) -> tuple[int, int]:
    if not local:
        return 0, 0
    left = WINDOW_INF if left is None else max(-WINDOW_INF, min(WINDOW_INF, left))
    right = WINDOW_INF if right is None else max(-WINDOW_INF, min(WINDOW_INF, right))
    return left, right


def _reject_unimplemented(**kwargs) -> None:
    for name, value in kwargs.items():
        if name == "num_splits":
            off = value is None or (isinstance(value, int) and value <= 1)
        elif name == "pack_gqa":
            off = value is None or value is False
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
                f"{dispatch.UNIMPLEMENTED_ARGUMENTS[name]}"
            )


def _resolve_scale(softmax_scale, head_dim: int) -> float:
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


def _kernel_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    # (Other dtypes, and non-tensors, are left for the input checks to reject by name.)
    if scale < 0 and isinstance(q, torch.Tensor) and q.dtype in (torch.float16, torch.bfloat16):
        return -q, -scale
    if scale == 0:
        return q, SCALE_FOR_ZERO
    return q, scale


def _resolve_softcap(softcap) -> float:
    value = 0.0 if softcap is None else softcap
    if not 0.0 <= value < math.inf:
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    return value


# --------------------------------------------------------------------------------------------
# Checks


class _Shapes(NamedTuple):
    batch: int
    seqlen_q: int  # per batch entry; the packed total for varlen q
    seqlen_k: int  # likewise
    nheads: int
    nheads_kv: int
    head_dim: int
    head_dim_v: int
    varlen_q: bool
    varlen_k: bool
    request: dispatch.FwdRequest  # what the call asks of a kernel (the compile key, less arch)


def _shape_str(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_int32_vector(t, name: str, length: int, what: str) -> None:
    _check_tensor(t, name)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D ({what}), got shape {_shape_str(t)}")
    if t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries ({what}), got {t.shape[0]}")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_strides(t: torch.Tensor, name: str) -> None:
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


def _check_metadata(
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
) -> _Shapes:
    """Checks that need no data: types, dtypes, ranks, extents, strides, sequence metadata."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(t, name)
    if q.dtype not in _DTYPE_NAMES:
        raise TypeError(f"q.dtype must be torch.float16 or torch.bfloat16, got {q.dtype}")
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype ({t.dtype}) differs from q.dtype ({q.dtype})")

    varlen_q = cu_seqlens_q is not None
    varlen_k = cu_seqlens_k is not None
    for t, name, varlen, cu in (
        (q, "q", varlen_q, "cu_seqlens_q"),
        (k, "k", varlen_k, "cu_seqlens_k"),
        (v, "v", varlen_k, "cu_seqlens_k"),
    ):
        want = 3 if varlen else 4
        if t.dim() != want:
            layout = "(total, nheads, head_dim)" if varlen else "(batch, seqlen, nheads, head_dim)"
            given = f"with {cu}" if varlen else f"without {cu}"
            raise ValueError(f"{name} must be {want}-D {layout} {given}, got shape {_shape_str(t)}")

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
        what = "total_k" if varlen_k else "(batch, seqlen_k)"
        raise ValueError(f"k and v must agree in {what}: k {_shape_str(k)}, v {_shape_str(v)}")
    if varlen_q:
        _check_tensor(cu_seqlens_q, "cu_seqlens_q")
        if cu_seqlens_q.dtype != torch.int32:
            raise TypeError(f"cu_seqlens_q must be torch.int32, got {cu_seqlens_q.dtype}")
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
            raise ValueError(
                f"cu_seqlens_q must be 1-D with batch + 1 >= 1 entries, got shape "
                f"{_shape_str(cu_seqlens_q)}"
            )
        batch = cu_seqlens_q.shape[0] - 1
        _check_int32_vector(cu_seqlens_q, "cu_seqlens_q", batch + 1, "batch + 1")
    else:
        batch = q.shape[0]
    if varlen_k:
        _check_tensor(cu_seqlens_k, "cu_seqlens_k")
        if varlen_q and cu_seqlens_k.dim() == 1 and cu_seqlens_k.shape[0] != batch + 1:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                f"{batch + 1} and {cu_seqlens_k.shape[0]}"
            )
        _check_int32_vector(cu_seqlens_k, "cu_seqlens_k", batch + 1, "batch + 1")
    elif k.shape[0] != batch:
        source = "len(cu_seqlens_q) - 1" if varlen_q else "q.shape[0]"
        raise ValueError(
            f"k.shape[0] ({k.shape[0]}) must equal the batch size ({source} = {batch})"
        )
    if seqused_q is not None:
        _check_int32_vector(seqused_q, "seqused_q", batch, "batch")
    if seqused_k is not None:
        _check_int32_vector(seqused_k, "seqused_k", batch, "batch")

    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_strides(t, name)

    request = dispatch.FwdRequest(
        dtype=_DTYPE_NAMES[q.dtype],
        head_dim=int(head_dim),
        head_dim_v=int(head_dim_v),
        causal=causal,
        local=local,
        has_softcap=softcap > 0,
        varlen_q=varlen_q,
        varlen_k=varlen_k,
        seqused_q=seqused_q is not None,
        seqused_k=seqused_k is not None,
    )
    dispatch.check_fwd_implementable_somewhere(request)
    return _Shapes(
        batch=batch,
        seqlen_q=q.shape[0] if varlen_q else q.shape[1],
        seqlen_k=k.shape[0] if varlen_k else k.shape[1],
        nheads=nheads,
        nheads_kv=nheads_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        varlen_q=varlen_q,
        varlen_k=varlen_k,
        request=request,
    )


def _check_alignment(q, k, v) -> None:
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.data_ptr() % ALIGN_BYTES != 0 and t.numel() > 0:
            raise ValueError(
                f"{name}.data_ptr() must be {ALIGN_BYTES}-byte aligned, got {t.data_ptr():#x} "
                f"(a view at an odd offset?); pass {name}.clone()"
            )


def _check_cu_seqlens(values: list[int], name: str, total: int, total_name: str) -> list[int]:
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


def _check_seqused(values: list[int], name: str, room: list[int], room_name: str) -> None:
    for b, (u, r) in enumerate(zip(values, room, strict=True)):
        if u < 0 or u > r:
            raise ValueError(f"{name}[{b}] = {u} is outside [0, {r}] ({room_name} of sequence {b})")


def _check_values_and_max_seqlen_q(
    shapes: _Shapes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, check: bool
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
        lens_q = _check_cu_seqlens(
            take(batch + 1), "cu_seqlens_q", shapes.seqlen_q, "total_q (q.shape[0])"
        )
    if cu_seqlens_k is not None:
        lens_k = _check_cu_seqlens(
            take(batch + 1), "cu_seqlens_k", shapes.seqlen_k, "total_k (k.shape[0])"
        )
    used_q = lens_q
    if seqused_q is not None:
        used_q = take(batch)
        room = "its cu_seqlens_q extent" if shapes.varlen_q else "seqlen_q, q.shape[1]"
        _check_seqused(used_q, "seqused_q", lens_q, room)
    if seqused_k is not None:
        room = "its cu_seqlens_k extent" if shapes.varlen_k else "seqlen_k, k.shape[1]"
        _check_seqused(take(batch), "seqused_k", lens_k, room)
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


def _device_of(*named_tensors) -> torch.device:
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


_device_facts: dict[int, tuple[tuple[int, int], int]] = {}  # index -> (capability, SMs)


def _facts(device: torch.device) -> tuple[tuple[int, int], int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    facts = _device_facts.get(index)
    if facts is None:
        props = torch.cuda.get_device_properties(index)
        facts = _device_facts[index] = ((props.major, props.minor), props.multi_processor_count)
    return facts


def _capability(device: torch.device) -> tuple[int, int]:
    return _facts(device)[0]


def _sm_count(device: torch.device) -> int:
    """SMs of the device (the CTAs of a persistent grid)."""
    return _facts(device)[1]


def _compiled_kernel(config):
    """The launchable kernel of a compile key (the compile cache: memory, disk, compile)."""
    from .cache import fwd_cache

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
    tile_counter: bool  # the kernel takes a zeroed work-unit counter (dynamic persistent grid)
    window_left: int
    window_right: int
    shapes: _Shapes
    # Allocation templates (Note [allocation templates]): one element each, expanded (stride 0)
    # to the shapes of out and lse.
    out_like: torch.Tensor
    lse_like: torch.Tensor


# Note [launch plans]
# ~~~~~~~~~~~~~~~~~~~
# The metadata checks, the device check, dispatch and the compile-cache lookup depend only on
# the input signature: shapes, strides, dtypes and devices of the tensors, plus the mask flags.
# ``_plans`` maps that signature to a ``_Plan`` made by the full, ordered checks on its first
# call; later calls with the same signature pay for the key, the pointer-alignment check, the
# value checks of varlen metadata (when present), two allocations and the launch. A plan is
# stored only once every check, the device check included, has passed. The table is bounded:
# it is cleared when it outgrows ``_MAX_PLANS`` (workloads with ever new shapes just re-check).
_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


@contextlib.contextmanager
def separate_launch_tables(tables: dict):
    """Inside the block, forward launch plans and the backward's kernels per request are looked
    up in and added to two tables kept in ``tables`` (made on first use) instead of the
    process-wide ones. A plan keeps the kernel chosen under the tuning switches
    (``CUTE_FA_...`` variables) set when it was made, so code that times one signature under
    several settings in one process (``bench --peers cute_fa:NAME=VALUE``) gives each setting
    its own tables. Not thread-safe: the tables are module globals."""
    global _plans
    from . import backward

    saved = _plans, backward._launch_kernels
    _plans = tables.setdefault("fwd", {})
    backward._launch_kernels = tables.setdefault("bwd", {})
    try:
        yield
    finally:
        _plans, backward._launch_kernels = saved


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
) -> tuple[_Plan, int]:
    """The full, ordered checks (module docstring); returns the plan and max_seqlen_q."""
    causal, local, window_left, window_right = resolve_window(causal, (window_left, window_right))
    shapes = _check_metadata(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        causal=causal, local=local, softcap=softcap,
    )  # fmt: skip
    _check_alignment(q, k, v)
    max_seqlen_q = _check_values_and_max_seqlen_q(
        shapes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, _check_values(q)
    )
    device = _device_of(
        (q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"),
        (cu_seqlens_k, "cu_seqlens_k"), (seqused_q, "seqused_q"), (seqused_k, "seqused_k"),
    )  # fmt: skip
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
    _, config = dispatch.fwd_plan(_capability(device), shapes.request, seqlen_hint)
    if getattr(config, "num_ctas", 0) and not no_work:  # persistent: one CTA an SM of it
        config = config.replace(num_ctas=_sm_count(device))
    kernel = None if no_work else _compiled_kernel(config)
    wl, wr = _kernel_window(local, window_left, window_right)
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
            t is not None for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ),
        no_work=no_work,
        tile_counter=getattr(config, "dynamic_tiles", False),
        window_left=wl,
        window_right=wr,
        shapes=shapes,
        out_like=torch.empty(1, dtype=q.dtype, device=device).expand(out_shape),
        lse_like=torch.empty(1, dtype=torch.float32, device=device).expand(lse_shape),
    )
    return plan, max_seqlen_q


# Note [allocation templates]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``torch.empty(shape, dtype=..., device=...)`` parses three arguments on every call;
# ``torch.empty_like(t)`` takes all of them from ``t`` and costs about half as much host time.
# A plan keeps one-element tensors expanded to the shapes of out and lse: not dense (stride 0),
# so ``empty_like`` gives them contiguous strides, the layout the fake implementation promises.


def _check_values(q) -> bool:
    """Whether to read and check the varlen metadata values (a host sync) on this call."""
    return not SKIP_VALUE_CHECKS and not (q.is_cuda and torch.cuda.is_current_stream_capturing())


def _fwd_impl(
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    softmax_scale, causal, window_left, window_right, softcap,
):  # fmt: skip
    if cu_seqlens_q is None and cu_seqlens_k is None and seqused_q is None and seqused_k is None:
        # The common batched call: a shorter key (device indices; a CPU tensor gives -1).
        key = (
            q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
            v.dtype, q.get_device(), k.get_device(), v.get_device(),
            causal, window_left, window_right, softcap > 0,
        )  # fmt: skip
    else:
        key = (
            _tensor_key(q), _tensor_key(k), _tensor_key(v), _tensor_key(cu_seqlens_q),
            _tensor_key(cu_seqlens_k), _tensor_key(seqused_q), _tensor_key(seqused_k),
            causal, window_left, window_right, softcap > 0,
        )  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        plan, max_seqlen_q = _make_plan(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
            causal, window_left, window_right, softcap,
        )  # fmt: skip
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    else:
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGN_BYTES:
            _check_alignment(q, k, v)
        if plan.has_int_metadata:
            max_seqlen_q = _check_values_and_max_seqlen_q(
                plan.shapes, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                _check_values(q),
            )  # fmt: skip
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
    # A persistent grid with a dynamic schedule counts its work units from zero on each call.
    counter = torch.zeros(1, dtype=torch.int32, device=plan.device) if plan.tile_counter else None
    plan.kernel(
        q4, k4, v4, out4, lse3, softmax_scale, softcap, plan.window_left, plan.window_right,
        max_seqlen_q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, counter,
    )  # fmt: skip
    return out, lse


def _fwd_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    softmax_scale, causal, window_left, window_right, softcap,
):  # fmt: skip
    causal, local, _, _ = resolve_window(causal, (window_left, window_right))
    shapes = _check_metadata(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        causal=causal, local=local, softcap=softcap,
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
    "bool causal, int? window_left, int? window_right, float softcap) -> (Tensor, Tensor)"
)
# CPU too, so that CPU tensors reach the checks and get a clear error instead of a dispatcher
# message.
_lib.impl("fwd", _fwd_impl, "CUDA")
_lib.impl("fwd", _fwd_impl, "CPU")
torch.library.register_fake("cute_fa::fwd", _fwd_fake, lib=_lib)
_fwd_op = torch.ops.cute_fa.fwd.default


def _bwd_impl(
    dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
    deterministic,
):  # fmt: skip
    from .backward import run_backward

    _device_of(
        (dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"), (dlse, "dlse"),
    )  # fmt: skip
    return run_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
        deterministic, dlse=dlse,
    )  # fmt: skip


def _bwd_fake(
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
_lib.impl("bwd", _bwd_impl, "CUDA")
_lib.impl("bwd", _bwd_impl, "CPU")
torch.library.register_fake("cute_fa::bwd", _bwd_fake, lib=_lib)
_bwd_op = torch.ops.cute_fa.bwd.default


def _eager_cuda(t) -> bool:
    """A plain CUDA tensor outside any tracing or dispatch/function mode: the op's CUDA
    implementation may be called directly (Note [eager fast path])."""
    return (
        type(t) is torch.Tensor
        and t.is_cuda
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._is_torch_function_mode_enabled()
    )


class _FlashAttnForward(torch.autograd.Function):
    """Forward through ``cute_fa::fwd``; backward through ``cute_fa::bwd``.

    Gradients are not materialised (``set_materialize_grads(False)``): an unused ``lse`` gives
    ``dlse = None`` and costs nothing; a used one folds into the backward's delta (Note
    [gradient of the LSE] in cute_fa/backward.py). Only ``out`` unused gives ``dout`` zeros.
    """

    @staticmethod
    def forward(
        ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
        softmax_scale, causal, window_left, window_right, softcap, max_seqlen_k, deterministic,
    ):  # fmt: skip
        out, lse = _fwd_op(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
            softmax_scale, causal, window_left, window_right, softcap,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.params = (
            max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
            deterministic,
        )  # fmt: skip
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
        dq, dk, dv = _bwd_impl(*args) if _eager_cuda(dout) else _bwd_op(*args)
        return dq, dk, dv, *([None] * 12)


def _requires_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _check_learnable_sink(sink, nheads: int, q: torch.Tensor) -> None:
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


def _forward(requires_grad: bool, q, k, v, *args, max_seqlen_k=None, deterministic=False):
    """Forward with autograd when needed; eager calls on plain CUDA tensors skip the
    dispatcher (Note [eager fast path]). ``max_seqlen_k`` and ``deterministic`` only concern
    the backward."""
    if requires_grad:
        return _FlashAttnForward.apply(q, k, v, *args, max_seqlen_k, deterministic)
    if _eager_cuda(q):
        return _fwd_impl(q, k, v, *args)
    return _fwd_op(q, k, v, *args)


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
    ``softcap * tanh(scores / softcap)``; masks as in the module docstring. Arguments of
    flash_attn.cute that cute_fa does not implement yet raise NotImplementedError when set
    (``python -m cute_fa features`` lists them). ``deterministic`` only concerns the backward.
    """
    if not (
        qv is None
        and gather_kv_indices is None
        and num_splits == 1
        and not pack_gqa
        and score_mod is None
        and score_mod_bwd is None
        and mask_mod is None
        and aux_tensors is None
        and aux_scalars is None
        and block_sparse_tensors is None
        and block_sparse_tensors_bwd is None
    ):
        _reject_unimplemented(
            qv=qv,
            gather_kv_indices=gather_kv_indices,
            num_splits=num_splits,
            pack_gqa=pack_gqa,
            score_mod=score_mod,
            score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod,
            aux_tensors=aux_tensors,
            aux_scalars=aux_scalars,
            block_sparse_tensors=block_sparse_tensors,
            block_sparse_tensors_bwd=block_sparse_tensors_bwd,
        )
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        _check_tensor(q, "q")
        _check_tensor(k, "k")
        _check_tensor(v, "v")
    causal, window_left, window_right = _window_args(causal, window_size)
    scale = _resolve_scale(softmax_scale, q.shape[-1] if q.dim() else 0)
    requires_grad = _requires_grad(q, k, v)
    q, scale = _kernel_scale(q, scale)
    if learnable_sink is not None:
        _check_learnable_sink(learnable_sink, q.shape[-2] if q.dim() else 0, q)
    out, lse = _forward(
        requires_grad, q, k, v, None, None, None, None, None,
        scale, causal, window_left, window_right, _resolve_softcap(softcap),
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
    ``min_seqlen_k`` and ``disable_scheduler_metadata`` are accepted and not needed. Sequence
    metadata rules and checks: see the module docstring.
    """
    if not (
        qv is None
        and gather_kv_indices is None
        and page_table is None
        and num_splits == 1
        and not pack_gqa
        and score_mod is None
        and score_mod_bwd is None
        and mask_mod is None
        and block_sparse_tensors is None
        and aux_tensors is None
        and aux_scalars is None
        and scheduler_metadata is None
        and seqlen_k_per_split is None
    ):
        _reject_unimplemented(
            qv=qv,
            gather_kv_indices=gather_kv_indices,
            page_table=page_table,
            num_splits=num_splits,
            pack_gqa=pack_gqa,
            score_mod=score_mod,
            score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod,
            block_sparse_tensors=block_sparse_tensors,
            aux_tensors=aux_tensors,
            aux_scalars=aux_scalars,
            scheduler_metadata=scheduler_metadata,
            seqlen_k_per_split=seqlen_k_per_split,
        )
    _check_tensor(q, "q")
    _check_tensor(k, "k")
    _check_tensor(v, "v")
    if max_seqlen_q is not None:
        max_seqlen_q = int(max_seqlen_q)
        if max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    if max_seqlen_k is not None:
        max_seqlen_k = int(max_seqlen_k)
        if max_seqlen_k < 0:
            raise ValueError(f"max_seqlen_k must be >= 0, got {max_seqlen_k}")
    causal, window_left, window_right = _window_args(causal, window_size)
    scale = _resolve_scale(softmax_scale, q.shape[-1] if q.dim() else 0)
    requires_grad = _requires_grad(q, k, v)
    q, scale = _kernel_scale(q, scale)
    if learnable_sink is not None:
        _check_learnable_sink(learnable_sink, q.shape[-2] if q.dim() else 0, q)
    out, lse = _forward(
        requires_grad, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
        scale, causal, window_left, window_right, _resolve_softcap(softcap),
        max_seqlen_k=max_seqlen_k, deterministic=bool(deterministic),
    )  # fmt: skip
    if learnable_sink is not None:
        out, lse = _apply_learnable_sink(out, lse, learnable_sink)
        requires_grad = requires_grad or (torch.is_grad_enabled() and learnable_sink.requires_grad)
    return out, (lse if return_lse or requires_grad else None)
