"""The torch side of the attention backward pass: the launch sequence preprocess -> main kernel
-> postprocess (``run_backward``); the compile keys come from ``cute_fa.planning``, the
compiled kernels from ``cute_fa.compile``.

Launch sequence (all on torch's current CUDA stream, no host sync unless noted):
  1. preprocess: ``delta = rowsum(dO * O) - dLSE`` (fp32, (b, h, sq)) and ``dQaccum = 0``
     (fp32, (b, h, sq, d); for the sm80 main kernel padded to whole query blocks and its tile
     head dim, and in its fragment order, Note [dQ accumulator in fragment order] in
     ``ampere/support.py``);
     Note [gradient of the LSE] says why dLSE folds into delta;
  2. main kernel (the backward protocol, ``cute_fa.dsl.fake.bwd_fake_args``): dK, dV per query
     head, dK already scaled by softmax_scale; dQ (unscaled) added into dQaccum with atomics
     (sm90: TMA reduce-adds; ``deterministic=True``: in key-block order, through zeroed int32
     semaphores, one per (batch, head, query block); the result is then bitwise reproducible);
  3. postprocess: ``dQ = (dQaccum * softmax_scale).to(dtype)`` (reordered to rows for sm80);
  4. GQA/MQA: each group of ``h / h_kv`` query heads' dK, dV is summed in fp32 into its kv head
     (``torch.sum(..., dtype=float32)``) and cast back; with ``h == h_kv`` the kernel writes the
     returned tensors directly.
Varlen tensors get a batch dim of 1, as in the forward. Nothing is launched when there is no
query or no key (the gradients are zero). The only host syncs: with packed keys, reading
cu_seqlens_k (or seqused_k) for the longest key sequence, which sizes the main kernel's grid;
it happens when ``max_seqlen_k`` is not given, or to check a given one when the forward's value
checks are on (not under ``CUTE_FA_SKIP_CHECKS=1`` nor during CUDA-graph capture); and with
packed queries on the sm80 kernel and no ``max_seqlen_q``, reading cu_seqlens_q (or seqused_q)
for the postprocess's grid.

Compile keys: ``BwdConfig`` (``cute_fa.config``, built by ``planning.bwd_config``) for the main
kernel, ``BwdPreConfig`` and ``BwdPostConfig`` (``cute_fa.ampere.flash_bwd_prepost``, next to
their kernels and fake arguments) for the small ones: neither depends on the mask flags or key
tiles, so one pre/post compile serves every mask variant of a head dim (the sm80 postprocess
depends on the main kernel's tile_m, warps and varlen_q, which fix its fragment order). Each
has its own
``CompileCache`` (TVM-FFI export to the on-disk store, as the forward).

Note [gradient of the LSE]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The forward returns ``lse_i = log sum_j exp(s_ij)`` (s the scaled, capped, masked scores) next
to ``O = P V``. With ``dP = dO V^T``, the score gradient through O is
``dS = P * (dP - delta)``, ``delta_i = sum_j P_ij dP_ij = rowsum(dO * O)_i``. The LSE adds
``d lse_i / d s_ij = P_ij``, so with an incoming ``dLSE``: ``dS = P * (dP - delta) + P * dLSE
= P * (dP - (delta - dLSE))``. The main kernel is unchanged; the preprocess writes
``delta - dLSE``. Rows that see no key have ``P = 0`` and stay at zero gradient whatever dLSE is.
"""

from __future__ import annotations

import torch

from . import selftest, settings, tuned
from .ampere.support import dq_accum_rows
from .checks import DTYPE_NAMES, check_values, kernel_window, resolve_window
from .compile import bwd_cache, bwd_post_cache, bwd_pre_cache
from .config import dq_accum_head_dim, target_for_capability
from .device import capability, sm_count, tuned_table
from .planning import bwd_config, coresident_fits, post_config, pre_config

__all__ = ["run_backward"]

_ALIGN_BYTES = 16
_STRIDE_MULTIPLE = 8  # elements: 16 bytes of a 16-bit dtype

# --------------------------------------------------------------------------------------------
# The launch sequence


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the kernels can read it as it is (last dim contiguous, other strides multiples
    of 16 bytes, 16-byte aligned), else a contiguous copy (a transposed or expanded dout)."""
    strides = t.stride()
    ok = (
        (t.shape[-1] <= 1 or strides[-1] == 1)
        and all(s % _STRIDE_MULTIPLE == 0 for s in strides[:-1])
        and t.data_ptr() % _ALIGN_BYTES == 0
    )
    return t if ok else t.clone(memory_format=torch.contiguous_format)  # new, aligned memory


def _longest(cu_seqlens: torch.Tensor, seqused: torch.Tensor | None) -> int:
    """The longest sequence of packed rows, ``seqused`` where given (a host sync)."""
    if cu_seqlens.shape[0] < 2:
        return 0
    lengths = cu_seqlens[1:] - cu_seqlens[:-1] if seqused is None else seqused
    return int(lengths.max())


def _batch_dim(t: torch.Tensor | None, varlen: bool) -> torch.Tensor | None:
    """Packed varlen tensors get a leading batch dim of 1 for the kernels."""
    return t.unsqueeze(0) if t is not None and varlen else t


_launch_kernels: dict[tuple, tuple] = {}
_MAX_LAUNCH_KERNELS = 256


def _kernels(device, dtype, head_dim, head_dim_v, causal, local, has_softcap, varlen_q,
             varlen_k, seqused_q, seqused_k, deterministic, has_dlse, switches,
             det_fit=None):  # fmt: skip
    """(config, preprocess, main, postprocess) of a backward request, kept per request (the
    arguments; ``switches``: the backward's process-wide settings, CUTE_FA_BWD_ARCH and
    CUTE_FA_BWD_DET_ORDER, and the tuning state): a training step's backward calls then skip
    building the compile keys and the three cache lookups (~10-25 us of Python a call).
    ``det_fit`` (deterministic calls without a window): the longest key sequence, which with
    the device's SM count decides ``det_coresident``."""
    key = (device, dtype, head_dim, head_dim_v, causal, local, has_softcap, varlen_q, varlen_k,
           seqused_q, seqused_k, deterministic, has_dlse, switches, det_fit)  # fmt: skip
    found = _launch_kernels.get(key)
    if found is None:
        config = bwd_config(
            target_for_capability(*capability(device)), dtype, head_dim, head_dim_v,
            causal=causal, local=local, has_softcap=has_softcap, varlen_q=varlen_q,
            varlen_k=varlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
            deterministic=deterministic, table=tuned_table(device),
        )  # fmt: skip
        # (the SM count is read only where it matters: the sm80 kernel's deterministic mode)
        fit = det_fit is not None and config.arch == 80
        if fit and coresident_fits(config, det_fit, sm_count(device)):
            config = config.replace(det_coresident=True)
        found = _checked(_compiled(config, has_dlse), device, has_dlse)
        if len(_launch_kernels) >= _MAX_LAUNCH_KERNELS:
            _launch_kernels.clear()
        _launch_kernels[key] = found
    return found


def _compiled(config, has_dlse: bool) -> tuple:
    """(config, preprocess, main, postprocess): the compiled kernels of one main-kernel key."""
    return (
        config,
        bwd_pre_cache().get(pre_config(config, has_dlse)),
        bwd_cache().get(config),
        bwd_post_cache().get(post_config(config)),
    )


def _checked(found: tuple, device, has_dlse: bool) -> tuple:
    """``found`` when its main kernel may serve calls on ``device``: it needs no first-use
    self-check (``cute_fa.selftest``: a family never run on this GPU family, or forced) or
    passes it, with the launch sequence of ``_launch`` on the check's problems; else the sm80
    backward's kernels for the same request (one warning a process naming the variant and
    the error), or SelfCheckError when the failing kernel is the sm80 one."""
    config = found[0]
    if not selftest.needs_check(config):
        return found

    def launch(*args):
        return _launch(found, *args, dlse=None)

    error = selftest.bwd_failure(launch, config, device)
    if not error:
        return found
    if config.arch == 80:
        raise selftest.SelfCheckError(
            f"cute_fa: {config.name} failed its first-use self-check on this GPU ({error}) and "
            f"no other backward kernel implements the call; CUTE_FA_SELFTEST=0 runs it unchecked"
        )
    fallback = bwd_config(
        config.target, config.dtype, config.head_dim, config.head_dim_v, causal=config.causal,
        local=config.local, has_softcap=config.has_softcap, varlen_q=config.varlen_q,
        varlen_k=config.varlen_k, seqused_q=config.seqused_q, seqused_k=config.seqused_k,
        deterministic=config.deterministic, arch=80, table=tuned_table(device),
    )  # fmt: skip
    selftest.warn_fallback(config, error, fallback, device)
    return _checked(_compiled(fallback, has_dlse), device, has_dlse)


def run_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    seqused_q: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    softmax_scale: float,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    deterministic: bool,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention; arguments as ``cute_fa::fwd`` saved them, plus ``dout`` (the
    gradient of ``out``, any strides) and ``dlse`` (the gradient of the returned LSE, or None).

    q, k, v, out and lse are the forward's own tensors (already checked there). The returned
    gradients are contiguous, shaped and typed like q, k, v. ``max_seqlen_q`` sizes the sm80
    postprocess's grid (read from cu_seqlens_q when None).
    """
    if dout.shape != out.shape:
        raise ValueError(f"dout has shape {tuple(dout.shape)}, out {tuple(out.shape)}")
    dtype = q.dtype
    causal, local, window_left, window_right = resolve_window(causal, (window_left, window_right))
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]

    if q.numel() == 0 or k.numel() == 0:  # no query or no key: nothing flows back
        return (
            torch.zeros(q.shape, dtype=dtype, device=q.device),
            torch.zeros(k.shape, dtype=dtype, device=k.device),
            torch.zeros(v.shape, dtype=dtype, device=v.device),
        )

    if dout.dtype != dtype:
        dout = dout.to(dtype)
    dout = _kernel_ready(dout)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    if not varlen_k:
        max_seqlen_k = k.shape[1]
    elif max_seqlen_k is None or check_values(q):
        longest = _longest(cu_seqlens_k, seqused_k)
        if max_seqlen_k is None:
            max_seqlen_k = longest
        elif max_seqlen_k < longest:
            raise ValueError(
                f"max_seqlen_k ({max_seqlen_k}) is smaller than the longest key sequence "
                f"({longest})"
            )

    det_fit = max_seqlen_k if deterministic and not local else None
    found = _kernels(
        q.device, DTYPE_NAMES[dtype], head_dim, head_dim_v, causal, local, softcap > 0, varlen_q,
        varlen_k, seqused_q is not None, seqused_k is not None, deterministic, dlse is not None,
        (settings.forced_bwd_arch(), settings.deterministic_chain_order(), tuned.state()),
        det_fit,
    )  # fmt: skip
    return _launch(
        found, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap, dlse=dlse,
    )  # fmt: skip


def _launch(
    found: tuple, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    max_seqlen_q: int | None, max_seqlen_k: int, softmax_scale: float, window_left,
    window_right, softcap: float, *, dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The launch sequence of the module docstring with the kernels ``found`` ((config, pre,
    main, post)) on checked arguments: ``dout`` kernel-ready in q's dtype, ``max_seqlen_k`` the
    longest key sequence, the window as ``resolve_window`` returns it (the mask flags are
    the config's)."""
    config, pre, main, post = found
    dtype, varlen_q, varlen_k = q.dtype, cu_seqlens_q is not None, cu_seqlens_k is not None
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    device = q.device
    q4, out4, dout4 = (_batch_dim(t, varlen_q) for t in (q, out, dout))
    lse3, dlse3 = _batch_dim(lse, varlen_q), _batch_dim(dlse, varlen_q)
    k4, v4 = _batch_dim(k, varlen_k), _batch_dim(v, varlen_k)
    batch4, rows = q4.shape[0], q4.shape[1]

    delta = torch.empty(lse3.shape, dtype=torch.float32, device=device)
    num_seqs = cu_seqlens_q.shape[0] - 1 if varlen_q else batch4
    # The sm80 kernel's dQaccum is in fragment order, padded to whole query blocks (Note [dQ
    # accumulator in fragment order]); its postprocess walks packed sequences block by block.
    fragments = config.arch == 80
    packed_blocks = fragments and varlen_q
    acc_rows = dq_accum_rows(rows, num_seqs, config.tile_m, varlen_q) if fragments else rows
    # (sm80: as wide as the kernel's tile head dim, Note [rounded head dims] in config.py)
    acc_cols = dq_accum_head_dim(config.arch, head_dim)
    dq_accum = torch.empty((batch4, nheads, acc_rows, acc_cols), dtype=torch.float32, device=device)
    pre(out4, dout4, dlse3, delta, dq_accum)

    # dK, dV per query head. Keys the kernel never visits (past seqused_k) must read as 0.
    alloc = torch.zeros if seqused_k is not None else torch.empty
    grouped = nheads != nheads_kv
    dk_shape = (*k.shape[:-2], nheads, head_dim)
    dv_shape = (*v.shape[:-2], nheads, head_dim_v)
    dk = alloc(dk_shape if grouped else k.shape, dtype=dtype, device=device)
    dv = alloc(dv_shape if grouped else v.shape, dtype=dtype, device=device)
    window_left, window_right = kernel_window(config.local, window_left, window_right)
    semaphores = None
    if config.deterministic:  # a counter per (batch, head, query block): Note [deterministic dQ]
        blocks = -(-rows // config.tile_m)  # a bound on any sequence's query blocks
        semaphores = torch.zeros((num_seqs, nheads, blocks), dtype=torch.int32, device=device)
    main(
        q4, k4, v4, dout4, lse3, delta, dq_accum, _batch_dim(dk, varlen_k),
        _batch_dim(dv, varlen_k), softmax_scale, softcap, window_left, window_right,
        max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, semaphores,
    )  # fmt: skip

    # Packed, the postprocess runs over each sequence's query blocks, the longest being
    # max_seqlen_q rows; that bound may count only seqused_q rows, whose dQ stays 0 past them.
    alloc = torch.zeros if packed_blocks and seqused_q is not None else torch.empty
    dq = alloc(q.shape, dtype=dtype, device=device)
    if packed_blocks and max_seqlen_q is None:
        max_seqlen_q = _longest(cu_seqlens_q, seqused_q)
    post(dq_accum, _batch_dim(dq, varlen_q), softmax_scale,
         cu_seqlens_q if packed_blocks else None, max_seqlen_q or 0)  # fmt: skip

    if grouped:
        # One reduction kernel each: torch sums 16-bit tensors in fp32 and rounds the result
        # once (as an fp32 sum then a cast would, without the cast's kernel and buffer).
        group = nheads // nheads_kv
        dk = dk.unflatten(-2, (nheads_kv, group)).sum(-2)
        dv = dv.unflatten(-2, (nheads_kv, group)).sum(-2)
    return dq, dk, dv
