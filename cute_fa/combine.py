"""``flash_attn_combine``: merge the partial outputs and LSEs of split-KV attention (the
``flash_attn.cute`` function of that name), and the launch the split forward uses.

Layouts (FA4's), S the number of splits:
  out_partial  (S, batch, seqlen, nheads, d)  or packed (S, total, nheads, d); fp32, bf16, fp16
  lse_partial  (S, batch, seqlen, nheads)     or packed (S, total, nheads); fp32, natural log
  out          (batch, seqlen, nheads, d)     or packed (total, nheads, d)
  lse          (batch, seqlen, nheads)        or packed (total, nheads): a transposed view of
               a (batch, nheads, seqlen) / (nheads, total) tensor, as flash_attn.cute returns it
Per row: lse = log(sum_s exp(lse_s)) and out = sum_s exp(lse_s - lse) * out_s; splits with
lse_s = -inf add nothing; a row whose splits are all -inf gets out 0 and lse -inf. The kernel's
docstring (``ampere/flash_combine.py``) is the protocol.

``cu_seqlens`` (int32, batch + 1; packed input only) and ``seqused`` (int32, batch) say which
rows count: rows of sequence b past seqused[b] are not written (an ``out`` passed in keeps its
values there; one allocated here holds 0, and the LSE -inf). Without seqused every row is
combined (cu_seqlens is then only checked). Checks, in order: types and dtypes (TypeError),
ranks, extents, strides, alignment (ValueError), metadata values (one host read, skipped as in
the attention functions), devices (ValueError), compute capability (NotImplementedError).
"""

from __future__ import annotations

import math

import torch

from . import selftest
from .ampere.support import COMBINE_MAX_HEAD_DIM, COMBINE_VEC, CombineConfig
from .checks import (
    ALIGN_BYTES,
    check_cu_seqlens,
    check_cu_seqlens_batch,
    check_int32_vector,
    check_seqused,
    check_tensor,
    check_values,
    device_of,
    shape_str,
)
from .compile import combine_cache
from .config import target_for_capability
from .device import capability
from .reference import merge_splits
from .settings import selftest_mode

# dtype names of the combine's compile key (CombineConfig).
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
MIN_CAPABILITY = (8, 0)


def _check_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _DTYPES:
        raise TypeError(
            f"{name} must be torch.float32, torch.bfloat16 or torch.float16, got {t.dtype}"
        )


def _check_rows_tensor(t: torch.Tensor, name: str) -> None:
    """Last dim contiguous, other strides multiples of 4 elements, pointer 16-byte aligned."""
    strides = t.stride()
    if t.shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dim (stride 1), got strides {strides}"
        )
    for dim, s in enumerate(strides[:-1]):
        if s % COMBINE_VEC:
            raise ValueError(
                f"{name}.stride({dim}) = {s} is not a multiple of {COMBINE_VEC} elements, strides "
                f"{strides}; pass {name}.contiguous()"
            )
    if t.numel() and t.data_ptr() % ALIGN_BYTES:
        raise ValueError(f"{name}.data_ptr() must be {ALIGN_BYTES}-byte aligned")


def _check_metadata(out_partial, lse_partial, out, out_dtype, cu_seqlens, seqused):
    """Type and shape checks; returns (packed, batch, out_dtype)."""
    check_tensor(out_partial, "out_partial")
    check_tensor(lse_partial, "lse_partial")
    _check_dtype(out_partial, "out_partial")
    if lse_partial.dtype != torch.float32:
        raise TypeError(f"lse_partial must be torch.float32, got {lse_partial.dtype}")
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise TypeError(
            f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype}"
        )
    if out is not None:
        check_tensor(out, "out")
        _check_dtype(out, "out")
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out.dtype ({out.dtype}) differs from out_dtype ({out_dtype})")
        out_dtype = out.dtype
    if out_dtype is None:
        out_dtype = out_partial.dtype
    if out_partial.dim() not in (4, 5):
        raise ValueError(
            "out_partial must be 5-D (num_splits, batch, seqlen, nheads, head_dim) or 4-D "
            f"(num_splits, total, nheads, head_dim), got shape {shape_str(out_partial)}"
        )
    packed = out_partial.dim() == 4
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(
            f"lse_partial must have shape {tuple(out_partial.shape[:-1])} (out_partial's without "
            f"head_dim), got {shape_str(lse_partial)}"
        )
    head_dim = out_partial.shape[-1]
    if head_dim <= 0 or head_dim % 8 or head_dim > COMBINE_MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim (out_partial.shape[-1]) must be a positive multiple of 8 up to "
            f"{COMBINE_MAX_HEAD_DIM}, got {head_dim}"
        )
    if out is not None and tuple(out.shape) != tuple(out_partial.shape[1:]):
        raise ValueError(
            f"out must have shape {tuple(out_partial.shape[1:])}, got {shape_str(out)}"
        )
    _check_rows_tensor(out_partial, "out_partial")
    if out is not None:
        _check_rows_tensor(out, "out")
    if lse_partial.numel() and lse_partial.data_ptr() % 4:
        raise ValueError("lse_partial.data_ptr() must be 4-byte aligned")
    if cu_seqlens is not None:
        if not packed:
            raise ValueError(
                "cu_seqlens goes with packed input: out_partial (num_splits, total, nheads, "
                f"head_dim), got shape {shape_str(out_partial)}"
            )
        batch = check_cu_seqlens_batch(cu_seqlens, "cu_seqlens")
    elif packed:
        if seqused is not None:
            raise ValueError(
                "seqused with packed out_partial (num_splits, total, nheads, head_dim) needs "
                "cu_seqlens (where each sequence starts)"
            )
        batch = 1
    else:
        batch = out_partial.shape[1]
    if seqused is not None:
        check_int32_vector(seqused, "seqused", batch, "batch")
    return packed, batch, out_dtype


def _check_values(out_partial, packed, cu_seqlens, seqused) -> None:
    """cu_seqlens and seqused values (one host read)."""
    parts = [t for t in (cu_seqlens, seqused) if t is not None]
    if not parts or not check_values(out_partial):
        return
    values = torch.cat([t.reshape(-1).cpu() for t in parts]).tolist()
    if cu_seqlens is not None:
        total = out_partial.shape[1]
        n = cu_seqlens.shape[0]
        lens = check_cu_seqlens(values[:n], "cu_seqlens", total, "total (out_partial.shape[1])")
        values = values[n:]
        room_name = "its cu_seqlens extent"
    else:
        lens = [out_partial.shape[2]] * out_partial.shape[1]
        room_name = "seqlen, out_partial.shape[2]"
    if seqused is not None:
        check_seqused(values, "seqused", lens, room_name)


def _used_rows(t: torch.Tensor, packed: bool, cu_seqlens, seqused) -> torch.Tensor:
    """Boolean mask broadcasting over ``t`` ((batch, seqlen, nheads, ...) or (total, nheads,
    ...)): the rows the combine writes (all of them without seqused)."""
    rows = t.shape[1] if not packed else t.shape[0]
    shape = [1] * t.dim()
    if seqused is None:
        return torch.ones(shape, dtype=torch.bool, device=t.device)
    pos = torch.arange(rows, device=t.device, dtype=torch.int32)
    if packed:  # position of each packed row within its sequence
        seq = torch.searchsorted(cu_seqlens, pos, right=True) - 1
        keep = pos - cu_seqlens[seq] < seqused[seq]
        shape[0] = rows
    else:
        keep = pos[None, :] < seqused[:, None]
        shape[0], shape[1] = t.shape[0], rows
    return keep.reshape(shape)


def combine_kernel(device: torch.device, dtype_partial, dtype, head_dim: int, has_lse: bool,
                   varlen: bool, seqused: bool):  # fmt: skip
    """The compiled combine kernel for these choices on ``device`` (compile cache)."""
    cap = capability(device)
    if cap < MIN_CAPABILITY:
        raise NotImplementedError(
            f"cute_fa needs an NVIDIA GPU of compute capability 8.0 or newer for "
            f"flash_attn_combine; this one has {cap[0]}.{cap[1]}"
        )
    config = CombineConfig(
        arch=80, target=target_for_capability(*cap), dtype_partial=_DTYPES[dtype_partial],
        dtype=_DTYPES[dtype], head_dim=head_dim, has_lse=has_lse, varlen=varlen and seqused,
        seqused=seqused,
    )  # fmt: skip
    kernel = combine_cache().get(config)
    error = _failure(kernel, config, device)
    if error:
        selftest.warn_fallback(config, error, "a torch combine", device)
        return torch_combine
    return kernel


def torch_combine(out_partial, lse_partial, out, lse, cu_seqlens, seqused) -> None:
    """The combine of the module docstring in torch ops, on the kernel-side views of
    ``launch_combine`` (the first-use self-check's reference, and what a combine kernel that
    failed its check is replaced by)."""
    merged, lse_all = merge_splits(out_partial, lse_partial)
    if seqused is None:
        keep = torch.ones((1,) * out.dim(), dtype=torch.bool, device=out.device)
    elif cu_seqlens is not None:  # packed: a batch dim of 1 over the rows
        keep = _used_rows(out[0], True, cu_seqlens, seqused).unsqueeze(0)
    else:
        keep = _used_rows(out, False, None, seqused)
    out.copy_(torch.where(keep, merged.to(out.dtype), out))
    if lse is not None:
        lse.copy_(torch.where(keep[..., 0], lse_all, lse))


def launch_combine(kernel, out_partial, lse_partial, out, lse, cu_seqlens, seqused) -> None:
    """Run a compiled combine kernel on the kernel-side views: out_partial (S, B, Sq, H, D),
    lse_partial (S, B, Sq, H), out (B, Sq, H, D), lse (B, Sq, H) or None; cu_seqlens only with
    seqused (the kernel's compile key says so)."""
    kernel(out_partial, lse_partial, out, lse, cu_seqlens if seqused is not None else None,
           seqused)  # fmt: skip


def flash_attn_combine(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    cu_seqlens: torch.Tensor | None = None,
    seqused: torch.Tensor | None = None,
    virtual_batch_idx: torch.Tensor | None = None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine the outputs and LSEs of key splits (``flash_attn.cute.flash_attn_combine``).

    out_partial (num_splits, batch, seqlen, nheads, d) or packed (num_splits, total, nheads, d),
    fp32 / bf16 / fp16; lse_partial (num_splits, batch, seqlen, nheads) or (num_splits, total,
    nheads), fp32. Returns ``(out, lse)``: out (batch, seqlen, nheads, d) or (total, nheads, d)
    in ``out_dtype`` (default out_partial's dtype; ``out``, when given, is written and
    returned), lse fp32 (batch, seqlen, nheads) or (total, nheads) (a transposed view), or None
    with ``return_lse=False``. Module docstring: semantics, seqused, checks. No autograd.
    ``virtual_batch_idx`` (a persistent scheduler's batch order in flash_attn.cute) is not
    implemented: anything but None raises NotImplementedError.
    """
    if virtual_batch_idx is not None:
        raise NotImplementedError(
            "cute_fa does not implement flash_attn_combine(virtual_batch_idx=...) yet (it has no "
            "persistent split scheduler that reorders batches); pass None"
        )
    packed, batch, out_dtype = _check_metadata(
        out_partial, lse_partial, out, out_dtype, cu_seqlens, seqused
    )
    _check_values(out_partial, packed, cu_seqlens, seqused)
    device = device_of(
        (out_partial, "out_partial"), (lse_partial, "lse_partial"), (out, "out"),
        (cu_seqlens, "cu_seqlens"), (seqused, "seqused"),
    )  # fmt: skip
    rows_shape = tuple(out_partial.shape[1:-1])  # (batch, seqlen, nheads) or (total, nheads)
    # Rows past seqused are not written: an allocated out holds 0 there, the LSE -inf.
    fill = seqused is not None
    if out is None:
        make = torch.zeros if fill else torch.empty
        out = make(tuple(out_partial.shape[1:]), dtype=out_dtype, device=device)
    lse = None
    if return_lse:
        # Stored (batch, nheads, seqlen) / (nheads, total), returned transposed.
        lse_store = (*rows_shape[:-2], rows_shape[-1], rows_shape[-2])
        if fill:
            lse = torch.full(lse_store, float("-inf"), dtype=torch.float32, device=device)
        else:
            lse = torch.empty(lse_store, dtype=torch.float32, device=device)
        lse = lse.transpose(-1, -2)
    if out.numel() == 0:
        return out, lse
    if out_partial.shape[0] == 0:  # no splits: every row sees nothing (no launch on empty data)
        out.masked_fill_(_used_rows(out, packed, cu_seqlens, seqused), 0.0)
        if lse is not None:
            lse.masked_fill_(_used_rows(lse, packed, cu_seqlens, seqused), float("-inf"))
        return out, lse
    kernel = combine_kernel(
        device, out_partial.dtype, out.dtype, out_partial.shape[-1], lse is not None,
        cu_seqlens is not None, seqused is not None,
    )  # fmt: skip
    if packed:  # the kernel's batch dim of 1
        op, lp, o = out_partial.unsqueeze(1), lse_partial.unsqueeze(1), out.unsqueeze(0)
        lo = lse.unsqueeze(0) if lse is not None else None
    else:
        op, lp, o, lo = out_partial, lse_partial, out, lse
    launch_combine(kernel, op, lp, o, lo, cu_seqlens, seqused)
    return out, lse


def run_check(kernel, config: CombineConfig, device: torch.device) -> tuple[bool, str]:
    """The first-use self-check of a combine kernel (``cute_fa.selftest.check``'s runner):
    3 splits of 2 x 37 rows x 3 heads, some splits and one whole row at LSE -inf, against
    ``torch_combine``; rows past seqused must keep the value they had."""
    generator = torch.Generator().manual_seed(2)
    dtypes = {name: dtype for dtype, name in _DTYPES.items()}
    splits, batch, rows, heads, d = 3, 2, 37, 3, config.head_dim
    try:
        part = torch.randn((splits, batch, rows, heads, d), generator=generator)
        lse_part = torch.randn((splits, batch, rows, heads), generator=generator) * 3
        lse_part[1, :, ::3] = -math.inf  # a split that saw no key for some rows
        lse_part[:, 0, 5] = -math.inf  # a row no split saw
        part = part.to(device=device, dtype=dtypes[config.dtype_partial])
        lse_part = lse_part.to(device)
        used = torch.tensor([30, 11], dtype=torch.int32, device=device)
        cu = torch.tensor([0, rows, 2 * rows], dtype=torch.int32, device=device)
        if config.varlen:  # packed rows: (S, 1, batch * rows, heads, d)
            part, lse_part = part.flatten(1, 2).unsqueeze(1), lse_part.flatten(1, 2).unsqueeze(1)
        results = []
        for combine in (kernel, torch_combine):
            out = torch.full(part.shape[1:], 7.0, dtype=dtypes[config.dtype], device=device)
            lse = torch.full(lse_part.shape[1:], 7.0, device=device) if config.has_lse else None
            launch_combine(combine, part, lse_part, out, lse, cu if config.varlen else None,
                           used if config.seqused else None)  # fmt: skip
            results.append((out, lse))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        (out, lse), (out_ref, lse_ref) = results
        tol = {"fp32": 1e-5, "bf16": 2**-7, "fp16": 2**-10}[config.dtype]
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=tol, atol=1e-6)
        if lse is not None:
            torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    except Exception as e:  # noqa: BLE001 - any failure of the kernel is the result
        return False, f"{type(e).__name__}: {' '.join(str(e).split())}"
    return True, ""


def _failure(kernel, config: CombineConfig, device: torch.device) -> str:
    """The error of a combine kernel's first-use self-check ("" when it passed), checked until
    the kernel has run on a GPU; ``CUTE_FA_SELFTEST=0``: not checked."""
    if selftest_mode() == "off":
        return ""
    result, _ = selftest.check(kernel, config, device, runner=run_check)
    return selftest.error_of(result)
