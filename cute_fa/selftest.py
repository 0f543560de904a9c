"""The first-use self-check of forward kernels on GPU families this project has never run them on.

Every sm100 kernel (``cute_fa.blackwell``: cross-compiled and checked by its SASS, never run on
a Blackwell GPU here) and the sm80 kernels on the 99 KiB shared-memory targets (sm_86, sm_89,
sm_120a: other tiles than the ones run on the A100 / H200) are checked on the user's GPU the
first time a compiled variant is used there: ``run_check`` launches the compiled kernel on two
small problems (``CHECK_PROBLEMS``: query and key tails, several passes around the K/V ring,
GQA; two sequences of other lengths for varlen, a window, a softcap, seqused when the variant
has them, with NaN in the K / V rows past seqused_k) and compares out and LSE with the fp32
reference on the same GPU (``cute_fa.reference.attention_ref`` and ``check_close``, the
tolerance of the GPU tests). It
costs one small launch per problem per variant per machine, and a compare on the GPU.

The result is recorded in the disk cache directory (``record_path``: one small JSON file per
GPU name, CUDA driver version and cache fingerprint, ``cute_fa.cache.fingerprint()``, which
covers the toolchain and every source file that shapes generated code), mapping the variant's
compile key (``entry_name``) to "pass" or "fail: <error>", so that later processes skip the
check. ``cute_fa.ops`` asks ``failure`` before it stores a launch plan; a variant that fails
gets one warning a process naming it and the error (``warn_fallback``), and that request is
planned again without the variant's family (``planning.try_plan(..., exclude=...)``): the
run-verified sm80 kernel. An sm80 variant that fails (sm86 / sm89 / sm120) has nothing to fall
back to: ``SelfCheckError``.

``CUTE_FA_SELFTEST`` (``cute_fa.settings``): ``0`` turns the check off, ``force`` checks every
variant (the sm80 and sm90 kernels too: the GPU tests use it on the H200). ``forced(...)``
adds families for the rest of a ``with`` block (tests). ``python -m cute_fa selftest`` runs the
check for every variant ``precompile`` would build for this GPU and prints a table.

A kernel that faults (an illegal address) leaves the CUDA context unusable: the check reports
the error, but no later launch in that process can succeed; the record is written before the
error is raised again, so the next process falls back.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from . import settings
from .cache import atomic_write, driver_cuda_version, entry_name, fingerprint
from .config import BwdConfig, FwdConfig
from .device import facts
from .reference import attention_ref, check_close, merge_splits

# Targets whose sm80 tiles have not run on hardware here (99 KiB of shared memory: their own
# tile table, ``config.SM80_FWD_TILES_SMALL_SMEM``).
SMALL_SMEM_TARGETS = ("sm_86", "sm_89", "sm_120a")
FORMAT = 1


class Problem(NamedTuple):
    """One check problem: ``seqlen`` query and key rows (split in two sequences for varlen),
    ``heads`` query heads over ``heads_kv`` key/value heads."""

    seqlen: int
    heads: int
    heads_kv: int


# 300 rows: a tail after one 256-row CTA and two 128-key blocks; 1,100 rows: five query tiles
# and nine key blocks (more than two passes around a 4-stage K/V ring), GQA.
CHECK_PROBLEMS = (Problem(300, 2, 2), Problem(1100, 2, 1))
# Runtime values the check passes for variants that take them.
CHECK_WINDOW = (100, 30)
CHECK_SOFTCAP = 8.0
CHECK_SEQUSED_Q_LESS = 5
CHECK_SEQUSED_K_LESS = 7
# Key splits of a split-KV variant (three: on 300 keys, 128-key blocks, one split is empty).
CHECK_SPLITS = 3

PASS = "pass"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FAIL = "fail: "


class SelfCheckError(RuntimeError):
    """A variant failed its self-check and no other kernel family implements the request."""


# --------------------------------------------------------------------------------------------
# Which variants are checked


_forced: set[int] = set()


@contextlib.contextmanager
def forced(*archs: int):
    """Check the variants of these kernel families (80, 90, 100) too, for the rest of the block
    (tests; ``CUTE_FA_SELFTEST=force`` does it for every family)."""
    added = set(archs) - _forced
    _forced.update(added)
    try:
        yield
    finally:
        _forced.difference_update(added)


def needs_check(config: FwdConfig | BwdConfig) -> bool:
    """Whether a compiled ``config`` is checked at its first use on a GPU: sm100 kernels, sm80
    kernels on SMALL_SMEM_TARGETS, families in ``forced``; every one with
    ``CUTE_FA_SELFTEST=force``, none with ``CUTE_FA_SELFTEST=0``."""
    mode = settings.selftest_mode()
    if mode == "off":
        return False
    if mode == "force" or config.arch in _forced:
        return True
    return config.arch == 100 or (config.arch == 80 and config.target in SMALL_SMEM_TARGETS)


# --------------------------------------------------------------------------------------------
# The check


def _lengths(config: FwdConfig, seqlen: int) -> tuple[list[int], list[int]]:
    """Query and key lengths of the sequences of one problem: one sequence, or two of other
    lengths when a side is varlen (a dense side keeps ``seqlen`` for both)."""
    if not (config.varlen_q or config.varlen_k):
        return [seqlen], [seqlen]
    a = seqlen // 3
    lens_q = [a, seqlen - a] if config.varlen_q else [seqlen, seqlen]
    lens_k = [seqlen - a, a] if config.varlen_k else [seqlen, seqlen]
    return lens_q, lens_k


def _rows(t: torch.Tensor, varlen: bool, cu: list[int], i: int) -> torch.Tensor:
    """Sequence ``i`` of a dense (b, s, h, d) or packed (total, h, d) tensor, as (1, s, h, d)."""
    return t[cu[i] : cu[i + 1]].unsqueeze(0) if varlen else t[i : i + 1]


class _Inputs(NamedTuple):
    """One problem's inputs in a variant's layout (``_inputs``)."""

    dtype: torch.dtype
    batch: int
    lens_q: list[int]
    lens_k: list[int]
    cu_q: list[int]
    cu_k: list[int]
    used_q: list[int]  # the lengths themselves without seqused
    used_k: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor | None


def _inputs(config, device: torch.device, problem: Problem, generator: torch.Generator,
            with_dout: bool = False) -> _Inputs:  # fmt: skip
    """Random q, k, v (and dout) of ``problem`` in the layout of ``config`` (dense, or packed
    sequences of ``_lengths``) with the check's seqused lengths; drawn from ``generator`` in
    that order."""
    dtype = DTYPES[config.dtype]
    d, dv, h, hk = config.head_dim, config.head_dim_v, problem.heads, problem.heads_kv
    lens_q, lens_k = _lengths(config, problem.seqlen)
    batch = len(lens_q)
    cu_q = [0, *(sum(lens_q[: i + 1]) for i in range(batch))]
    cu_k = [0, *(sum(lens_k[: i + 1]) for i in range(batch))]

    def randn(rows: list[int], heads: int, dim: int, varlen: bool) -> torch.Tensor:
        shape = (sum(rows), heads, dim) if varlen else (batch, rows[0], heads, dim)
        x = torch.randn(shape, generator=generator, dtype=torch.float32)
        return x.to(device=device, dtype=dtype)

    q = randn(lens_q, h, d, config.varlen_q)
    k = randn(lens_k, hk, d, config.varlen_k)
    v = randn(lens_k, hk, dv, config.varlen_k)
    dout = randn(lens_q, h, dv, config.varlen_q) if with_dout else None
    used_q = [n - CHECK_SEQUSED_Q_LESS for n in lens_q] if config.seqused_q else lens_q
    used_k = [n - CHECK_SEQUSED_K_LESS for n in lens_k] if config.seqused_k else lens_k
    return _Inputs(dtype, batch, lens_q, lens_k, cu_q, cu_k, used_q, used_k, q, k, v, dout)


def _check_problem(kernel, config: FwdConfig, device: torch.device, problem: Problem,
                   generator: torch.Generator) -> None:  # fmt: skip
    """Launch ``kernel`` on ``problem`` in ``config``'s layout and compare with the reference
    (AssertionError naming out or lse and the worst element)."""
    inputs = _inputs(config, device, problem, generator)
    dtype, batch, lens_q, lens_k, cu_q, cu_k, used_q, used_k, q, k, v, _ = inputs
    d, dv, h = config.head_dim, config.head_dim_v, problem.heads
    page_table = None
    if config.page_size:
        # Paged K/V: the keys padded to whole pages (random keys: inputs, unless seqused_k
        # leaves them out), stored as pages in a shuffled order.
        ps = config.page_size
        pages = -(-lens_k[0] // ps)
        k, v = (
            torch.cat([x, torch.randn((batch, pages * ps - lens_k[0], *x.shape[2:]),
                                      generator=generator).to(device=device, dtype=dtype)], 1)
            for x in (k, v)
        )  # fmt: skip
        lens_k = [pages * ps] * batch
        if not config.seqused_k:
            used_k = lens_k
        order = torch.randperm(batch * pages, generator=generator).to(device)
        page_table = order.reshape(batch, pages).to(torch.int32)
    if config.seqused_k:  # rows past seqused_k are not inputs: NaN must not reach out
        for x in (k, v):
            _poison_past(x, config.varlen_k, cu_k, used_k, math.nan)

    def int32(values: list[int] | None) -> torch.Tensor | None:
        return None if values is None else torch.tensor(values, dtype=torch.int32, device=device)

    scale = d**-0.5
    softcap = CHECK_SOFTCAP if config.has_softcap else 0.0
    window = CHECK_WINDOW if config.local else (None, 0) if config.causal else (None, None)
    wl, wr = CHECK_WINDOW if config.local else (0, 0)
    out_shape = (*q.shape[:-1], dv)
    lse_shape = (h, q.shape[0]) if config.varlen_q else (batch, h, lens_q[0])
    if config.seqused_q:  # rows past seqused_q are left to the caller (cute_fa.ops: 0, -inf)
        out = torch.zeros(out_shape, dtype=dtype, device=device)
        lse = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=device)
    else:  # poisoned: an element the kernel does not write fails
        out = torch.full(out_shape, math.nan, dtype=dtype, device=device)
        lse = torch.full(lse_shape, math.nan, dtype=torch.float32, device=device)
    q4, out4, lse3 = (q[None], out[None], lse[None]) if config.varlen_q else (q, out, lse)
    k4, v4 = (k[None], v[None]) if config.varlen_k else (k, v)
    if page_table is not None:  # logical page j of the batch stored at slot order[j]
        k4, v4 = (_to_pages(x, config.page_size, page_table) for x in (k, v))
    if config.split_kv:
        # CHECK_SPLITS key splits into NaN-poisoned fp32 partials (the layouts of Note
        # [split-KV launches] in cute_fa/ops.py), merged here by the LSE-weighted sum.
        part_out = torch.full((CHECK_SPLITS, *out_shape), math.nan, device=device)
        part_lse = torch.full((CHECK_SPLITS, *lse_shape), math.nan, device=device)
        if config.varlen_q:
            out4, lse3 = part_out, part_lse
        else:
            out4, lse3 = part_out.flatten(0, 1), part_lse.flatten(0, 1)
    kernel(
        q4, k4, v4, out4, lse3, scale, softcap, wl, wr,
        max(lens_q), int32(cu_q if config.varlen_q else None),
        int32(cu_k if config.varlen_k else None), int32(used_q if config.seqused_q else None),
        int32(used_k if config.seqused_k else None), page_table,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if config.split_kv:
        # (lse_partial as (S, ..., rows, h), like out_partial)
        merged, lse_rows = merge_splits(part_out, part_lse.movedim(-2, -1))
        lse_all = lse_rows.movedim(-1, -2)
        if config.seqused_q:  # rows past seqused_q: never written, left 0 / -inf
            _poison_past(merged, config.varlen_q, cu_q, used_q, 0.0)
            _poison_past(lse_all.movedim(-2, -1), config.varlen_q, cu_q, used_q, -math.inf)
        out.copy_(merged)
        lse.copy_(lse_all)

    # The expected out and lse in the kernel's layout: per sequence, the reference of its used
    # rows; rows past seqused_q 0 with LSE -inf.
    out_ref = torch.zeros(out_shape, dtype=torch.float32, device=device)
    out_pt = torch.zeros(out_shape, dtype=dtype, device=device)
    lse_ref = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=device)
    lse_pt = lse_ref.clone()
    for i in range(batch):
        qi = _rows(q, config.varlen_q, cu_q, i)[:, : used_q[i]]
        ki = _rows(k, config.varlen_k, cu_k, i)[:, : used_k[i]]
        vi = _rows(v, config.varlen_k, cu_k, i)[:, : used_k[i]]
        kw = dict(softmax_scale=scale, window_size=window, softcap=softcap)
        o_ref, l_ref = attention_ref(qi, ki, vi, upcast=True, **kw)
        o_pt, l_pt = attention_ref(qi, ki, vi, upcast=False, reorder_ops=True, **kw)
        n = used_q[i]
        for dst_o, dst_l, o, lv in ((out_ref, lse_ref, o_ref, l_ref), (out_pt, lse_pt, o_pt, l_pt)):
            if config.varlen_q:
                dst_o[cu_q[i] : cu_q[i] + n] = o[0]
                dst_l[:, cu_q[i] : cu_q[i] + n] = lv[0]
            else:
                dst_o[i, :n] = o[0]
                dst_l[i, :, :n] = lv[0]
    check_close(out, out_ref, out_pt, name="out")
    check_close(lse, lse_ref, lse_pt, atol=1e-4, name="lse")


def run_check(kernel, config: FwdConfig, device: torch.device) -> tuple[bool, str]:
    """Launch the compiled ``kernel`` of ``config`` on CHECK_PROBLEMS on ``device`` and compare
    with the fp32 reference: (True, "") or (False, the error). Never raises for what the kernel
    does (a launch error, a wrong element); the inputs are the same on every run (seeded)."""
    return _run_problems(_check_problem, kernel, config, device, seed=0)


def _run_problems(check_one, kernel, config, device: torch.device, seed: int) -> tuple[bool, str]:
    """``check_one`` on each of CHECK_PROBLEMS with one seeded generator: (True, "") or (False,
    the first problem's error, named by the problem)."""
    generator = torch.Generator().manual_seed(seed)
    problems = CHECK_PROBLEMS
    group = getattr(config, "pack_gqa", 0)
    if group:  # packed GQA: the group size is compiled in
        problems = tuple(p._replace(heads=p.heads_kv * group) for p in CHECK_PROBLEMS)
    for problem in problems:
        label = f"{problem.seqlen} rows, {problem.heads} heads / {problem.heads_kv} kv heads"
        try:
            check_one(kernel, config, device, problem, generator)
        except Exception as e:  # noqa: BLE001 - any failure of the kernel is the result
            message = " ".join(str(e).split())
            return False, f"{label}: {type(e).__name__}: {message}"
    return True, ""


def _to_pages(x: torch.Tensor, page_size: int, page_table: torch.Tensor) -> torch.Tensor:
    """(batch, pages * page_size, heads, d) -> (batch * pages, page_size, heads, d) with logical
    page j of sequence b at slot page_table[b, j] (flash_attn.cute's paged layout)."""
    b, s, h, d = x.shape
    out = torch.empty((b * (s // page_size), page_size, h, d), dtype=x.dtype, device=x.device)
    out[page_table.reshape(-1).long()] = x.reshape(-1, page_size, h, d)
    return out


def _poison_past(x: torch.Tensor, varlen: bool, cu: list[int], used: list[int], value) -> None:
    """Fill each sequence's rows from ``used[i]`` on with ``value`` (rows that are not inputs)."""
    for i in range(len(used)):
        if varlen:
            x[cu[i] + used[i] : cu[i + 1]] = value
        else:
            x[i, used[i] :] = value


def _check_bwd_problem(launch, config: BwdConfig, device: torch.device, problem: Problem,
                       generator: torch.Generator) -> None:  # fmt: skip
    """One backward problem: the reference's out and LSE in, dq, dk, dv out, compared with the
    fp32 autograd of the reference (``check_close``); rows past seqused read as 0. NaN in the
    q / k / v rows past seqused (not inputs), 0 in those rows of dout and out."""
    inputs = _inputs(config, device, problem, generator, with_dout=True)
    dtype, batch, lens_q, lens_k, cu_q, cu_k, used_q, used_k, q, k, v, dout = inputs
    d, h = config.head_dim, problem.heads
    scale = d**-0.5
    softcap = CHECK_SOFTCAP if config.has_softcap else 0.0
    window = CHECK_WINDOW if config.local else (None, 0) if config.causal else (None, None)
    kw = dict(softmax_scale=scale, window_size=window, softcap=softcap)

    out = torch.zeros(dout.shape, dtype=dtype, device=device)
    lse_shape = (h, q.shape[0]) if config.varlen_q else (batch, h, lens_q[0])
    lse = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=device)
    expected = []  # per sequence: (fp32 reference grads, kernel-precision grads)
    for i in range(batch):
        qi = _rows(q, config.varlen_q, cu_q, i)[:, : used_q[i]]
        ki = _rows(k, config.varlen_k, cu_k, i)[:, : used_k[i]]
        vi = _rows(v, config.varlen_k, cu_k, i)[:, : used_k[i]]
        doi = _rows(dout, config.varlen_q, cu_q, i)[:, : used_q[i]]
        o, lv = attention_ref(qi, ki, vi, **kw)
        n = used_q[i]
        if config.varlen_q:
            out[cu_q[i] : cu_q[i] + n] = o[0].to(dtype)
            lse[:, cu_q[i] : cu_q[i] + n] = lv[0]
        else:
            out[i, :n] = o[0].to(dtype)
            lse[i, :, :n] = lv[0]
        grads = []
        for upcast in (True, False):
            # The check runs inside autograd's backward (grad mode off there).
            with torch.enable_grad():
                leaves = [t.detach().to(torch.float32 if upcast else dtype).requires_grad_()
                          for t in (qi, ki, vi)]  # fmt: skip
                o_ref, _ = attention_ref(*leaves, upcast=upcast, reorder_ops=not upcast, **kw)
                grads.append(torch.autograd.grad(o_ref, leaves, doi.to(o_ref.dtype)))
        expected.append(grads)
    for x, varlen, cu, used in ((q, config.varlen_q, cu_q, used_q), (k, config.varlen_k, cu_k,
                                used_k), (v, config.varlen_k, cu_k, used_k)):  # fmt: skip
        _poison_past(x, varlen, cu, used, math.nan)
    _poison_past(dout, config.varlen_q, cu_q, used_q, 0.0)

    def int32(values: list[int] | None) -> torch.Tensor | None:
        return None if values is None else torch.tensor(values, dtype=torch.int32, device=device)

    wl, wr = CHECK_WINDOW if config.local else (None, 0) if config.causal else (None, None)
    dq, dk, dv_ = launch(
        dout, q, k, v, out, lse, int32(cu_q if config.varlen_q else None),
        int32(cu_k if config.varlen_k else None), int32(used_q if config.seqused_q else None),
        int32(used_k if config.seqused_k else None), max(lens_q), max(lens_k), scale, wl, wr,
        softcap,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for i, (ref, pt) in enumerate(expected):
        for g, varlen, cu, used, r, p, name in (
            (dq, config.varlen_q, cu_q, used_q, ref[0], pt[0], "dq"),
            (dk, config.varlen_k, cu_k, used_k, ref[1], pt[1], "dk"),
            (dv_, config.varlen_k, cu_k, used_k, ref[2], pt[2], "dv"),
        ):
            rows = _rows(g, varlen, cu, i)
            check_close(rows[:, : used[i]], r, p, name=f"{name} of sequence {i}")
            past = rows[:, used[i] :]
            if not bool((past == 0).all()):
                raise AssertionError(f"{name} of sequence {i}: rows past seqused are not 0")


def run_bwd_check(launch, config: BwdConfig, device: torch.device) -> tuple[bool, str]:
    """``run_check`` of a backward variant: ``launch`` runs the backward's launch sequence
    with the compiled kernels of ``config`` (``cute_fa.backward``) on CHECK_PROBLEMS; dq, dk,
    dv are compared with the fp32 autograd of the reference on ``device``."""
    return _run_problems(_check_bwd_problem, launch, config, device, seed=1)


# --------------------------------------------------------------------------------------------
# The record


class RecordKey(NamedTuple):
    """What a record's results hold for: the GPU, its driver, the toolchain and sources."""

    gpu: str
    driver: int  # cuDriverGetVersion, 0 when unknown
    fingerprint: str  # cute_fa.cache.fingerprint()


def gpu_name(device: torch.device) -> str:
    return facts(device).name


def record_key(device: torch.device) -> RecordKey:
    return RecordKey(gpu_name(device), driver_cuda_version() or 0, fingerprint())


def record_path(key: RecordKey) -> Path:
    """``<cache dir>/selftest/<gpu>-driver<version>-<fingerprint>.json``."""
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", key.gpu).strip("-").lower() or "gpu"
    name = f"{gpu}-driver{key.driver}-{key.fingerprint}.json"
    return settings.cache_base_dir() / "selftest" / name


def variant_key(config: FwdConfig) -> str:
    """A variant's name in the record: its compile key's disk-cache entry name (name and
    digest of every field)."""
    return entry_name(config).removesuffix(".bin")


_records: dict[RecordKey, dict[str, str]] = {}
_lock = threading.Lock()
_warned: set[tuple[RecordKey, str]] = set()


def _read(key: RecordKey) -> dict[str, str]:
    if not settings.disk_cache_enabled():
        return {}
    try:
        data = json.loads(record_path(key).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or (data.get("format"), data.get("key")) != (FORMAT, list(key)):
        return {}
    results = data.get("results")
    if not isinstance(results, dict):
        return {}
    return {str(k): str(v) for k, v in results.items()}


def results(key: RecordKey) -> dict[str, str]:
    """The recorded results for ``key`` (variant -> "pass" / "fail: ..."), read once a process."""
    with _lock:
        found = _records.get(key)
        if found is None:
            found = _records[key] = _read(key)
        return found


def record(key: RecordKey, variant: str, result: str) -> None:
    """Record ``result`` for ``variant`` in memory and, when the disk cache is on, in the file
    (read again first: another process may have added variants)."""
    with _lock:
        merged = {**_records.get(key, {}), **_read(key), variant: result}
        _records[key] = merged
    if not settings.disk_cache_enabled():
        return
    path = record_path(key)
    data = {"format": FORMAT, "key": list(key), "results": dict(sorted(merged.items()))}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, (json.dumps(data, indent=1) + "\n").encode())
    except OSError as e:
        _warn_once(("unwritable", str(path)), f"cute_fa: self-check record not written: {e}")


def forget_loaded() -> None:
    """Drop the records and warnings read in this process (tests)."""
    with _lock:
        _records.clear()
        _warned.clear()


def _warn_once(tag: tuple, message: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def check(kernel, config: FwdConfig | BwdConfig, device: torch.device, *, force: bool = False,
          runner=None) -> tuple[str, bool]:  # fmt: skip
    """(result, ran): the recorded result of ``config`` on this GPU, or the check run now and
    recorded ("pass" or "fail: <error>"); ``force`` runs it again. ``runner``: ``run_check``
    (a forward kernel, the default) or ``run_bwd_check`` (``kernel`` is then the backward's
    launch sequence). A first check during CUDA-graph capture raises SelfCheckError: it would
    launch and synchronize inside the capture."""
    key = record_key(device)
    variant = variant_key(config)
    found = None if force else results(key).get(variant)
    if found is not None:
        return found, False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise SelfCheckError(
            f"cute_fa: {config.name} has not passed its first-use self-check on this GPU yet "
            f"and a CUDA graph is being captured: run one call outside the capture first (or "
            f"python -m cute_fa selftest); CUTE_FA_SELFTEST=0 runs it unchecked"
        )
    ok, error = (runner or run_check)(kernel, config, device)
    result = PASS if ok else _FAIL + error
    record(key, variant, result)
    return result, True


def error_of(result: str) -> str:
    """ "" for a passing result, else its error (the text after "fail: ")."""
    return "" if result == PASS else result.removeprefix(_FAIL)


def failure(kernel, config: FwdConfig, device: torch.device) -> str:
    """ "" when the compiled ``config`` may serve calls on ``device`` (its recorded result, or
    the check run now), else the error."""
    result, _ = check(kernel, config, device)
    return "" if result == PASS else result.removeprefix(_FAIL)


def bwd_failure(launch, config: BwdConfig, device: torch.device) -> str:
    """``failure`` of a backward variant; ``launch`` is its launch sequence
    (``run_bwd_check``)."""
    result, _ = check(launch, config, device, runner=run_bwd_check)
    return "" if result == PASS else result.removeprefix(_FAIL)


def warn_fallback(bad, error: str, fallback, device: torch.device) -> None:
    """One warning a process for a variant that failed its check: which, the error, and the
    kernel its calls run instead."""
    key = record_key(device)
    _warn_once(
        (key, variant_key(bad)),
        f"cute_fa: {bad.name} failed its first-use self-check on {key.gpu} (recorded in "
        f"{record_path(key)}): {error}. Its calls run {getattr(fallback, 'name', fallback)} "
        f"instead; please report "
        f"this (docs/blackwell.md).",
    )
