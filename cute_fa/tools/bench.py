"""Forward/backward attention timing: cute_fa beside torch's SDPA backends and FlexAttention.

Run it as ``python -m cute_fa bench``. Modes:

* default: the standard grid (bf16, 16k tokens so batch = tokens / seqlen, hidden 2048 so
  heads = hidden / d, d in {64, 128, 256}, seqlen in {512 .. 16k}, causal in {0, 1}); every
  implementation is timed in the same process on the same inputs, the table is printed last,
  and a CSV (plus a PNG when matplotlib is importable) goes to ``--out``.
* ``--overhead``: host cost of a cached call (tiny shape, 2,000 back-to-back calls).
* ``--compile-time``: cold compile of one forward kernel, and the first call of a new process
  that finds it in the disk cache, each measured in a fresh subprocess.
* ``--ceilings``: a large bf16 matmul and a device copy on the same GPU, for scale.

Timing (see docs/performance.md, "Method"): ``triton.testing.do_bench`` median, or a median of
CUDA events when Triton is missing. Each timed call uses the next of several input sets, chosen
so that the sets together are at least three times the L2 cache, and the L2 is also flushed
before every timed call (Triton writes a 256 MB buffer; the fallback writes one twice the L2),
so no call finds its operands in L2 from the call before.

Importing this module needs neither CUDA nor the CuTe DSL; ``--help`` works anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

IMPLS = ("cute_fa", "flash", "cudnn", "flex", "fa4", "cute_fa_det")
IMPL_LABELS = {
    "fa4": "FA4",  # flash_attn.cute of flash-attn-4 (FA4's CuTe-DSL kernels), where installed
    "cute_fa": "cute_fa",
    "cute_fa_det": "cute_fa det",  # deterministic=True (only the backward differs)
    "flash": "SDPA FLASH",
    "cudnn": "SDPA CUDNN",
    "flex": "FlexAttention",
}
DEFAULT_PEERS = ("cute_fa", "flash", "cudnn", "flex", "fa4")
# A tuning variant of cute_fa (or cute_fa_det) in the same run: "cute_fa:SETTING[:SETTING]" with
# SETTING a typed tuning field, family.field=value (cute_fa/tuned.py; e.g.
# cute_fa:sm90_fwd.rescale_threshold=8), or one of the process-wide settings that pick a kernel
# family (CUTE_FA_FWD_ARCH=80, CUTE_FA_BWD_ARCH=80, CUTE_FA_BWD_DET_ORDER=chain). Each case then
# times the variant right after the plain implementation, on the same inputs, so the two see
# the same clocks (an A/B across processes differs by up to +-10 % on the H200 from run to
# run); the table adds "variant/cute_fa" columns.
VARIANT_SEP = ":"
GRID_D = (64, 128, 256)
GRID_SEQLEN = (512, 1024, 2048, 4096, 8192, 16384)
GRID_CAUSAL = (0, 1)
PROBE_TAG = "CUTE_FA_PROBE "
DEVICE = "cuda"


# --------------------------------------------------------------------------------------------
# FLOPs


def family_settings() -> tuple[str, ...]:
    """The process-wide settings a variant peer may set (they choose a kernel family)."""
    from cute_fa import settings

    return (settings.FWD_ARCH, settings.BWD_ARCH, settings.BWD_DET_ORDER)


@contextlib.contextmanager
def env_settings(values: dict[str, str]):
    """Environment variables set to ``values`` inside the block, restored (or removed) after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_variant(settings_: tuple[tuple[str, str], ...]) -> None:
    """ValueError unless every setting of a variant is a tuning field (family.field=value) or
    one of ``family_settings()``."""
    from cute_fa import tuned

    for name, value in settings_:
        if "." in name:
            tuned.parse_assignment(f"{name}={value}")
        elif name not in family_settings():
            raise ValueError(
                f"variant setting {name}={value}: expected family.field=value (a tuning field, "
                f"e.g. sm90_fwd.tile_n=80) or one of {', '.join(family_settings())}"
            )


@contextlib.contextmanager
def variant_context(settings_: tuple[tuple[str, str], ...]):
    """The tuning overrides and family settings of a variant, for the block; forward launch
    plans made under a family setting are dropped on entry and exit (the plan table is keyed
    by the tuning state, not by these settings)."""
    from cute_fa import ops, tuned

    overrides: dict[str, dict] = {}
    env = {}
    for name, value in settings_:
        if "." in name:
            family, field_, parsed = tuned.parse_assignment(f"{name}={value}")
            overrides.setdefault(family, {})[field_] = parsed
        else:
            env[name] = value
    with contextlib.ExitStack() as stack:
        if env:
            ops.clear_plans()
            stack.callback(ops.clear_plans)
            stack.enter_context(env_settings(env))
        stack.enter_context(tuned.tuning(**overrides))
        yield


def split_impl(name: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(base implementation, settings) of a peer name: ("cute_fa", ()) for "cute_fa",
    ("cute_fa", (("sm90_fwd.tile_n", "80"),)) for "cute_fa:sm90_fwd.tile_n=80"."""
    base, *parts = name.split(VARIANT_SEP)
    settings = tuple(tuple(p.split("=", 1)) for p in parts)
    return base, settings  # type: ignore[return-value]


def impl_label(name: str) -> str:
    """Column label of a peer: IMPL_LABELS, or for a variant its base and settings without the
    CUTE_FA_ prefix."""
    base, settings = split_impl(name)
    label = IMPL_LABELS.get(base, base)
    return " ".join([label] + [f"{k.removeprefix('CUTE_FA_')}={v}" for k, v in settings])


@functools.lru_cache(maxsize=256)
def visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """(query, key) pairs a sliding window (left, right) keeps, bottom-right aligned as the
    kernels mask (Note [bottom-right aligned masks] in cute_fa/dsl/mask.py)."""
    offset = seqlen_k - seqlen_q
    total = 0
    for i in range(seqlen_q):
        lo = max(0, i + offset - left)
        hi = min(seqlen_k - 1, i + offset + right)
        total += max(0, hi - lo + 1)
    return total


def attention_flops(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    causal: bool,
    mode: str = "fwd",
    head_dim_v: int | None = None,
    window: tuple[int, int] | None = None,
) -> float:
    """Matmul FLOPs of attention: 2 GEMMs of 2·sq·sk·d each forward, ×2.5 for backward.

    Forward counts QKᵀ (2·sq·sk·d) and PV (2·sq·sk·dv); causal halves it (the usual convention,
    exact in the limit sq = sk → ∞); a sliding ``window`` (left, right) counts the pairs it
    keeps exactly. Backward does 5 GEMMs against the forward's 2, hence ×2.5.
    """
    dv = head_dim if head_dim_v is None else head_dim_v
    if window is not None:
        pairs = visible_pairs(seqlen_q, seqlen_k, *window)
        flops = 2.0 * batch * heads * pairs * (head_dim + dv)
    else:
        flops = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim + dv)
    if causal and window is None:
        flops *= 0.5
    if mode == "bwd":
        flops *= 2.5
    elif mode != "fwd":
        raise ValueError(f"mode must be 'fwd' or 'bwd', got {mode!r}")
    return flops


# --------------------------------------------------------------------------------------------
# Timing


def _median_ms_cuda_events(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Median time of ``fn`` in ms from CUDA events, L2 flushed before every timed call."""
    import torch

    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size or (64 << 20)
    flush = torch.empty(2 * l2, dtype=torch.int8, device=DEVICE)
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    n = max(5, int(rep_ms / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends, strict=True):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def median_ms(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median GPU time of one call of ``fn`` in milliseconds (Triton's do_bench when present)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _median_ms_cuda_events(fn, warmup_ms, rep_ms)
    try:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except TypeError:  # Triton before return_mode
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])[0])


class Rotation:
    """A zero-argument callable that runs ``fns[i % n]`` on its i-th call."""

    def __init__(self, fns: Sequence[Callable[[], object]]):
        self.fns = list(fns)
        self.i = 0

    def __call__(self) -> object:
        fn = self.fns[self.i % len(self.fns)]
        self.i += 1
        return fn()


def num_input_sets(set_bytes: int, l2_bytes: int, max_sets: int = 16) -> int:
    """How many input sets to rotate so that together they are >= 3x the L2 (at least 2)."""
    return max(2, min(max_sets, math.ceil(3 * l2_bytes / max(set_bytes, 1))))


# --------------------------------------------------------------------------------------------
# Implementations


class ImplUnavailable(Exception):
    """The implementation cannot run this case (e.g. cute_fa has no backward yet): 'n/a'."""


@dataclass
class Impl:
    """One implementation under test: how it wants its inputs and how to call it."""

    name: str
    layout: str = "bshd"  # "bshd": (b, s, h, d) tensors; "bhsd": contiguous (b, h, s, d)
    state: dict = field(default_factory=dict)

    @property
    def base(self) -> str:
        """The implementation without a variant's settings."""
        return split_impl(self.name)[0]

    @contextlib.contextmanager
    def context(self):
        """Entered once around all timed calls of this implementation. A variant's tuning
        overrides (``cute_fa.tuning``) hold for the duration; launch plans are kept per tuning
        state, so neither its plans nor the plain implementation's leak across."""
        settings = split_impl(self.name)[1]
        if settings:
            with variant_context(settings):
                yield
        elif self.name in ("flash", "cudnn"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = (
                SDPBackend.FLASH_ATTENTION if self.name == "flash" else SDPBackend.CUDNN_ATTENTION
            )
            with sdpa_kernel(backend):
                yield
        else:
            yield

    def forward_fn(
        self, q, k, v, causal: bool, softcap: float = 0.0, window: tuple[int, int] | None = None
    ) -> Callable[[], object]:
        """Zero-argument forward on these tensors (layout ``self.layout``); returns out.
        ``softcap`` > 0: scores become softcap * tanh(scores / softcap); ``window``: a sliding
        window (left, right) (SDPA has neither: ImplUnavailable)."""
        if self.base in ("cute_fa", "cute_fa_det"):
            import cute_fa

            det = self.base == "cute_fa_det"
            window_size = window if window is not None else (None, None)

            def run():
                return cute_fa.flash_attn_func(
                    q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                    deterministic=det,
                )[0]  # fmt: skip

            return run
        if self.name in ("flash", "cudnn"):
            import torch.nn.functional as F

            if softcap:
                raise ImplUnavailable(f"{self.name}: SDPA has no softcap")
            if window is not None:
                raise ImplUnavailable(f"{self.name}: SDPA has no sliding window")
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        if self.name == "flex":
            import torch

            flex, block_mask = self._flex(
                q.shape[0], q.shape[2], k.shape[2], causal, q.device, window
            )
            if not softcap:
                return lambda: flex(q, k, v, block_mask=block_mask)

            def capped(score, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)

            return lambda: flex(q, k, v, block_mask=block_mask, score_mod=capped)
        if self.name == "fa4":
            try:
                from flash_attn.cute import flash_attn_func as fa4_func
            except ImportError as e:  # not installed (pip install flash-attn-4): 'n/a'
                raise ImplUnavailable(f"fa4: flash_attn.cute is not importable ({e})") from e
            window_size = window if window is not None else (None, None)

            def run():
                result = fa4_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap)
                return result[0] if isinstance(result, tuple) else result

            return run
        raise ValueError(f"unknown implementation {self.name!r}")

    def _flex(self, batch: int, seqlen_q: int, seqlen_k: int, causal: bool, device, window=None):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if "compiled" not in self.state:
            dynamo_config = torch._dynamo.config
            for limit in ("recompile_limit", "cache_size_limit"):
                if hasattr(dynamo_config, limit):
                    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 256))
            self.state["compiled"] = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        offset = seqlen_k - seqlen_q  # bottom-right aligned, as cute_fa
        mask = None
        if window is not None:
            left, right = window

            def mask(b, h, q_idx, kv_idx):
                return (kv_idx >= q_idx + offset - left) & (kv_idx <= q_idx + offset + right)

        elif causal:

            def mask(b, h, q_idx, kv_idx):
                return q_idx + offset >= kv_idx

        if mask is not None:
            block_mask = create_block_mask(
                mask, B=None, H=None, Q_LEN=seqlen_q, KV_LEN=seqlen_k, device=device
            )
        return self.state["compiled"], block_mask

    def backward_fn(
        self, q, k, v, causal: bool, softcap: float = 0.0, window: tuple[int, int] | None = None
    ) -> Callable[[], object]:
        """Zero-argument backward (dQ, dK, dV) of one forward done here; q/k/v are leaves."""
        import torch

        forward = self.forward_fn(q, k, v, causal, softcap, window)
        try:
            out = forward()
        except NotImplementedError as e:
            raise ImplUnavailable(str(e)) from e
        if not out.requires_grad:
            raise ImplUnavailable(f"{self.name}: output does not require grad")
        dout = torch.randn_like(out)

        def run():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        try:
            run()
        except NotImplementedError as e:
            raise ImplUnavailable(str(e)) from e
        return run


# --------------------------------------------------------------------------------------------
# The grid


@dataclass(frozen=True)
class Case:
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    head_dim_v: int | None = None  # None: head_dim
    softcap: float = 0.0
    window: tuple[int, int] | None = None  # sliding window (left, right); None: none

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def d_label(self) -> str:
        """'128', or '192x128' when the value head dim differs."""
        return str(self.head_dim) if self.dv == self.head_dim else f"{self.head_dim}x{self.dv}"


@dataclass
class Result:
    mode: str
    case: Case
    impl: str
    ms: float | None = None
    status: str = "ok"  # "ok" | "err" | "n/a"
    reason: str = ""

    @property
    def tflops(self) -> float | None:
        if self.ms is None:
            return None
        c = self.case
        flops = attention_flops(
            c.batch, c.heads, c.seqlen, c.seqlen, c.head_dim, c.causal, self.mode, c.dv, c.window
        )
        return flops / (self.ms * 1e-3) / 1e12


def grid_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for d in args.d:
        if args.hidden % d:
            raise SystemExit(f"--hidden {args.hidden} is not a multiple of d={d}")
        for s in args.seqlen:
            batch = max(1, args.tokens // s)
            for causal in args.causal:
                cases.append(
                    Case(
                        d,
                        s,
                        bool(causal),
                        batch,
                        args.hidden // d,
                        args.dv,
                        args.softcap,
                        args.window,
                    )  # fmt: skip
                )
    return cases


class ErrorLog:
    """Prints each distinct failure reason of an implementation once."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def report(self, impl: str, case: Case, mode: str, exc: BaseException) -> str:
        reason = (
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        )
        reason = reason[:300]
        key = (impl, reason)
        if key not in self.seen:
            self.seen.add(key)
            print(
                f"  [{impl}] {mode} d={case.head_dim} s={case.seqlen} causal={int(case.causal)}: "
                f"{reason}",
                file=sys.stderr,
                flush=True,
            )
            if os.environ.get("CUTE_FA_BENCH_TRACEBACK"):
                traceback.print_exception(exc)
        return reason


def _make_sets(case: Case, dtype, n_sets: int, requires_grad: bool) -> list[tuple]:
    import torch

    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    shape_v = (*shape[:-1], case.dv)
    sets = []
    for _ in range(n_sets):
        q, k, v = (
            torch.randn(sh, dtype=dtype, device=DEVICE).requires_grad_(requires_grad)
            for sh in (shape, shape, shape_v)
        )
        sets.append((q, k, v))
    return sets


def _to_layout(sets: list[tuple], layout: str, requires_grad: bool) -> list[tuple]:
    if layout == "bshd":
        return sets
    return [
        tuple(t.detach().transpose(1, 2).contiguous().requires_grad_(requires_grad) for t in s)
        for s in sets
    ]


def _failed(mode: str, case: Case, impl: Impl, e: BaseException, errors: ErrorLog) -> Result:
    """The result of an implementation that raised: "n/a" when it cannot run the case, "err"
    (with the error logged) otherwise."""
    if isinstance(e, (ImplUnavailable, NotImplementedError)):
        return Result(mode, case, impl.name, None, "n/a", str(e)[:300])
    return Result(mode, case, impl.name, None, "err", errors.report(impl.name, case, mode, e))


def _settle(impl: Impl | None, case: Case, mode: str, errors: ErrorLog) -> None:
    """Wait for the GPU and free cached blocks; an error there (e.g. a sticky launch error, after
    which later cells err too) is logged against ``impl``."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        errors.report(impl.name if impl else "bench", case, mode, e)


def time_case(
    case: Case,
    mode: str,
    impls: list[Impl],
    dtype,
    args: argparse.Namespace,
    errors: ErrorLog,
) -> list[Result]:
    import torch

    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size or (64 << 20)
    elem = torch.empty((), dtype=dtype).element_size()
    per_tensor = case.batch * case.seqlen * case.heads * case.head_dim * elem
    # A backward set also touches out, dout, dq, dk, dv.
    set_bytes = per_tensor * (3 if mode == "fwd" else 8)
    n_sets = num_input_sets(set_bytes, l2)
    requires_grad = mode == "bwd"
    results = []
    try:
        base_sets = _make_sets(case, dtype, n_sets, requires_grad)
    except torch.cuda.OutOfMemoryError as e:
        for impl in impls:
            results.append(
                Result(mode, case, impl.name, None, "err", errors.report(impl.name, case, mode, e))
            )
        return results
    # Each implementation's calls are built once; then every round times each of them in turn
    # (A, B, C, A, B, C, ...), so with --rounds > 1 all of them see the same run of clocks.
    prepared: list[tuple[Impl, list]] = []
    outcome: dict[str, Result] = {}
    round_ms: dict[str, list[float]] = {impl.name: [] for impl in impls}
    fns = None
    try:
        for impl in impls:
            try:
                sets = _to_layout(base_sets, impl.layout, requires_grad)
                with impl.context():
                    extra = (case.softcap, case.window)
                    if mode == "fwd":
                        fns = [impl.forward_fn(q, k, v, case.causal, *extra) for q, k, v in sets]
                    else:
                        fns = [impl.backward_fn(q, k, v, case.causal, *extra) for q, k, v in sets]
                prepared.append((impl, fns))
            except Exception as e:  # noqa: BLE001 - a failing peer is reported, never fatal
                outcome[impl.name] = _failed(mode, case, impl, e, errors)
        for _ in range(args.rounds):
            for impl, fns in prepared:
                if impl.name in outcome:  # failed in an earlier round
                    continue
                try:
                    with impl.context():
                        round_ms[impl.name].append(median_ms(Rotation(fns), args.warmup, args.rep))
                except Exception as e:  # noqa: BLE001 - as above
                    outcome[impl.name] = _failed(mode, case, impl, e, errors)
                    _settle(impl, case, mode, errors)
    finally:
        del prepared, fns
        _settle(None, case, mode, errors)
    for impl in impls:
        if impl.name not in outcome:
            outcome[impl.name] = Result(
                mode, case, impl.name, statistics.median(round_ms[impl.name])
            )
        results.append(outcome[impl.name])
    del base_sets
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return results


# --------------------------------------------------------------------------------------------
# Output


def _cell(r: Result | None) -> str:
    if r is None:
        return "-"
    if r.status != "ok":
        return r.status
    return f"{r.tflops:.1f}"


def _ratio(a: Result | None, b: Result | None) -> str:
    if a is None or b is None or a.status != "ok" or b.status != "ok":
        return "-"
    return f"{a.tflops / b.tflops:.2f}"


def format_table(results: list[Result], mode: str, impl_names: list[str]) -> str:
    rows = [r for r in results if r.mode == mode]
    by_key = {(r.case, r.impl): r for r in rows}
    cases = list(dict.fromkeys(r.case for r in rows))
    header = ["d", "seqlen", "causal", "batch", "heads"] + [impl_label(n) for n in impl_names]
    ratios = [
        (a, b)
        for a, b in (
            ("cute_fa", "flash"),
            ("cute_fa", "cudnn"),
            ("cute_fa", "fa4"),
            ("cute_fa_det", "cute_fa"),
        )  # fmt: skip
        if a in impl_names and b in impl_names
    ]
    header += ["det/default" if a == "cute_fa_det" else f"{a}/{b.upper()}" for a, b in ratios]
    split = {n: split_impl(n) for n in impl_names}
    variants = [(n, base) for n, (base, settings) in split.items()
                if settings and base in impl_names]  # fmt: skip
    ratios += variants
    header += [f"{impl_label(a)}/{b}" for a, b in variants]
    lines = [header]
    for c in cases:
        line = [c.d_label, str(c.seqlen), str(int(c.causal)), str(c.batch), str(c.heads)]
        line += [_cell(by_key.get((c, n))) for n in impl_names]
        line += [_ratio(by_key.get((c, a)), by_key.get((c, b))) for a, b in ratios]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    options = []
    if cases and cases[0].softcap:
        options.append(f"softcap {cases[0].softcap:g}")
    if cases and cases[0].window:
        options.append(f"window {cases[0].window[0]},{cases[0].window[1]}")
    out = [f"{mode} TFLOPs/s (median{''.join(', ' + o for o in options)})"]
    for j, row in enumerate(lines):
        out.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_csv(path: str, results: list[Result], dtype_name: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "mode",
                "dtype",
                "impl",
                "head_dim",
                "seqlen",
                "causal",
                "batch",
                "heads",
                "ms",
                "tflops",
                "status",
                "reason",
                "head_dim_v",
                "softcap",
                "window_left",
                "window_right",
            ]
        )
        for r in results:
            c = r.case
            w.writerow(
                [
                    r.mode,
                    dtype_name,
                    r.impl,
                    c.head_dim,
                    c.seqlen,
                    int(c.causal),
                    c.batch,
                    c.heads,
                    "" if r.ms is None else f"{r.ms:.5f}",
                    "" if r.tflops is None else f"{r.tflops:.2f}",
                    r.status,
                    r.reason,
                    c.dv,
                    c.softcap,
                    "" if c.window is None else c.window[0],
                    "" if c.window is None else c.window[1],
                ]
            )


def write_plot(
    path: str, results: list[Result], mode: str, impl_names: list[str], title: str = ""
) -> str | None:
    """PNG of TFLOPs against seqlen, one panel per (d, causal). Returns a note when skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no plot written"
    rows = [r for r in results if r.mode == mode]
    ds = sorted({r.case.head_dim for r in rows})
    causals = sorted({r.case.causal for r in rows})
    if not ds:
        return None
    fig, axes = plt.subplots(
        len(ds), len(causals), figsize=(5 * len(causals), 3.5 * len(ds)), squeeze=False
    )
    for i, d in enumerate(ds):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            for name in impl_names:
                pts = sorted(
                    (r.case.seqlen, r.tflops)
                    for r in rows
                    if r.impl == name
                    and r.case.head_dim == d
                    and r.case.causal == causal
                    and r.tflops is not None
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        marker="o",
                        label=impl_label(name),
                    )
            ax.set_xscale("log", base=2)
            ticks = sorted({r.case.seqlen for r in rows})
            ax.set_xticks(ticks, [f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in ticks])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{mode} d={d} causal={int(causal)}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOPs/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def environment() -> dict:
    import torch

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
    for mod in ("cute_fa", "cutlass", "triton"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as e:  # noqa: BLE001
            env[mod] = f"not importable ({type(e).__name__})"
    return env


# --------------------------------------------------------------------------------------------
# Modes


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def run_grid(args: argparse.Namespace, results_out: list | None = None) -> int:
    """The grid of ``args``; its ``Result`` rows are also appended to ``results_out``."""
    dtype = _torch_dtype(args.dtype)
    impls = [Impl(n, layout="bhsd" if n == "flex" else "bshd") for n in args.peers]
    modes = ["fwd", "bwd"] if args.mode == "both" else [args.mode]
    cases = grid_cases(args)
    env = environment()
    print("# " + "  ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    errors = ErrorLog()
    results: list[Result] = []
    for mode in modes:
        for case in cases:
            rs = time_case(case, mode, impls, dtype, args, errors)
            results.extend(rs)
            print(
                f"{mode} d={case.d_label} s={case.seqlen} causal={int(case.causal)}"
                + (f" window={case.window[0]},{case.window[1]}" if case.window else "")
                + " "
                f"b={case.batch} h={case.heads}: "
                + "  ".join(f"{impl_label(r.impl)}={_cell(r)}" for r in rs),
                flush=True,
            )
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "bench.csv")
    write_csv(csv_path, results, args.dtype)
    with open(os.path.join(args.out, "env.json"), "w") as f:
        json.dump({**env, "argv": sys.argv[1:]}, f, indent=2)
    notes = [f"wrote {csv_path}"]
    for mode in modes:
        png = os.path.join(args.out, f"bench_{mode}.png")
        title = f"{env['gpu']}, {args.dtype}, {args.tokens} tokens, hidden {args.hidden}"
        if args.softcap:
            title += f", softcap {args.softcap:g}"
        if args.window:
            title += f", window {args.window[0]},{args.window[1]}"
        note = write_plot(png, results, mode, list(args.peers), title)
        notes.append(note if note else f"wrote {png}")
    for note in dict.fromkeys(notes):
        print(note)
    print()
    for mode in modes:
        print(format_table(results, mode, list(args.peers)))
        print()
    if results_out is not None:
        results_out.extend(results)
    return 0


OVERHEAD_ROUNDS = 9


def run_overhead(args: argparse.Namespace) -> int:
    """Wall time per call of back-to-back cached calls on a tiny shape (host-bound)."""
    import torch

    dtype = _torch_dtype(args.dtype)
    d = args.d[0] if args.d_given else 64
    s = args.seqlen[0] if args.seqlen_given else 128
    causal = bool(args.causal[0]) if args.causal_given else False
    q, k, v = (torch.randn(1, s, 1, d, dtype=dtype, device=DEVICE) for _ in range(3))
    names = [n for n in ("cute_fa", "flash") if n in args.peers] or ["cute_fa", "flash"]
    print("# " + "  ".join(f"{k}={v}" for k, v in environment().items()))
    print(
        f"host overhead: b=1 s={s} h=1 d={d} causal={int(causal)}, {args.calls} back-to-back calls"
    )
    errors = ErrorLog()
    case = Case(d, s, causal, 1, 1)
    # Rounds interleave the implementations, so that a host that slows down or speeds up during
    # the run moves every column alike.
    fns, gpu_us, walls = {}, {}, {}
    for name in names:
        impl = Impl(name)
        try:
            with impl.context():
                fn = impl.forward_fn(q, k, v, causal)
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
                gpu_us[name] = median_ms(fn, args.warmup, args.rep) * 1e3
            fns[name] = (impl, fn)
            walls[name] = []
        except Exception as e:  # noqa: BLE001
            errors.report(name, case, "fwd", e)
    for _ in range(OVERHEAD_ROUNDS):
        for name, (impl, fn) in list(fns.items()):
            try:
                with impl.context():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    torch.cuda.synchronize()
                walls[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            except Exception as e:  # noqa: BLE001
                errors.report(name, case, "fwd", e)
                del fns[name]
    rows = []
    for name in names:
        if walls.get(name):
            rows.append(
                (impl_label(name), f"{statistics.median(walls[name]):.1f}",
                 f"{gpu_us[name]:.1f}")
            )  # fmt: skip
        else:
            rows.append((impl_label(name), "err", "err"))
    print()
    wall = f"wall us/call (median of {OVERHEAD_ROUNDS} rounds)"
    header = ("impl", wall, "GPU us/call (do_bench)")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for j, r in enumerate([header, *rows]):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    return 0


def run_ceilings(args: argparse.Namespace) -> int:
    """What this GPU reaches on plain work: a large dense matmul and a device-to-device copy."""
    import torch

    dtype = _torch_dtype(args.dtype)
    print("# " + "  ".join(f"{k}={v}" for k, v in environment().items()))
    n = 8192
    a, b = (torch.randn(n, n, dtype=dtype, device=DEVICE) for _ in range(2))
    ms = median_ms(lambda: torch.matmul(a, b), args.warmup, args.rep)
    matmul = 2 * n**3 / (ms * 1e-3) / 1e12
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms_copy = median_ms(lambda: dst.copy_(src), args.warmup, args.rep)
    bandwidth = 2 * nbytes / (ms_copy * 1e-3) / 1e12
    print(f"{args.dtype} matmul {n}x{n}x{n}: {matmul:.1f} TFLOPs/s ({ms:.3f} ms)")
    print(f"device copy 1 GiB (read + write): {bandwidth:.2f} TB/s ({ms_copy:.3f} ms)")
    return 0


class _GcPauses:
    """Seconds the cyclic garbage collector ran while installed (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.passes = 0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.passes += 1

    @contextlib.contextmanager
    def counting(self):
        gc.callbacks.append(self._callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._callback)


def _timed_call(fn: Callable[[], object]) -> float:
    import torch

    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# A probe process starts here rather than at ``python -m cute_fa.bench``, which would import
# torch and cute_fa before anything could time them.
_PROBE_BOOTSTRAP = """\
import sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import cute_fa
t2 = time.perf_counter()
from cute_fa.tools import bench
bench.IMPORT_SECONDS.update(torch=t1 - t0, cute_fa=t2 - t1)
sys.exit(bench.main(sys.argv[1:]))
"""
IMPORT_SECONDS: dict[str, float] = {}  # set by _PROBE_BOOTSTRAP


def _probe_first_call(args: argparse.Namespace) -> int:
    """Runs in a new process: the first and second cute_fa call, what the first one spent its
    time on, and the first call of torch's SDPA after them for scale.

    ``--probe-staged`` runs a first call's steps one at a time instead (dispatch and the cache
    lookup, then the call itself, whose kernel is then in memory), so that the launch can be
    told apart from the lookup; the sum of the stages is close to an end-to-end first call.
    """
    import torch

    import cute_fa

    t_import = time.perf_counter()
    dtype = _torch_dtype(args.dtype)
    d = args.d[0]
    causal = bool(args.causal[0])
    # The CUDA context, torch's CUDA state and its first kernels: what any CUDA library's first
    # call finds already paid here, and what the clock below does not count.
    q, k, v = (torch.randn(2, 256, 4, d, dtype=dtype, device=DEVICE) for _ in range(3))
    torch.cuda.synchronize()
    t_cuda = time.perf_counter()
    # The garbage collector's debt: a full pass over every object is due once enough objects
    # survived since the last one, and importing torch leaves the process near that point, so
    # it would land on whichever call allocates next. Paid here, and shown, instead.
    gc.collect()
    t_gc = time.perf_counter()
    report = {
        "import_torch_s": IMPORT_SECONDS.get("torch", float("nan")),
        "import_cute_fa_s": IMPORT_SECONDS.get("cute_fa", float("nan")),
        "cuda_init_s": t_cuda - t_import,
        "gc_debt_s": t_gc - t_cuda,
    }

    def call():
        cute_fa.flash_attn_func(q, k, v, causal=causal)

    gc_pauses = _GcPauses()
    if args.probe_staged:
        with gc_pauses.counting():
            t1 = time.perf_counter()
            from cute_fa import ops

            # The call's own plan: dispatch (its tile, grid and tuning choices for this shape)
            # and the compile cache's lookup.
            ops._make_plan(q, k, v, None, None, None, None, None, causal, None, None, 0.0)
            report["plan_load_s"] = time.perf_counter() - t1
            report["first_call_s"] = _timed_call(call)
    else:
        with gc_pauses.counting():
            report["first_call_s"] = _timed_call(call)
    report["gc_s"] = gc_pauses.seconds
    report["second_call_s"] = _timed_call(call)
    report["dsl_imported"] = "cutlass" in sys.modules  # by the first call (dispatch, compile)
    from cute_fa import cache

    fwd = cache.fwd_cache()
    report["kernels"] = [getattr(key, "name", repr(key)) for key in fwd.keys()]
    report["compiles"] = fwd.compiles
    report["disk_hits"] = fwd.disk_hits
    report["steps_s"] = cache.step_seconds()
    if not args.probe_staged:  # torch's own attention, first call in this process, for scale
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def sdpa():
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        report["sdpa_first_call_s"] = _timed_call(sdpa)
        report["sdpa_second_call_s"] = _timed_call(sdpa)
    print(PROBE_TAG + json.dumps(report), flush=True)
    return 0


# What a first call spends its time on: the names of cute_fa.cache.step_seconds(), in order.
FIRST_CALL_STEPS = (
    "import DSL",
    "cute.compile",
    "export",
    "link",
    "fingerprint",
    "import tvm_ffi",
    "load",
)


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for j, r in enumerate([header, *rows]):
        cells = (
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        print("  ".join(cells))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def compile_time_rows(reports: Sequence[tuple[str, dict | None]]) -> list[list[list[str]]]:
    """The three tables of ``--compile-time`` (summary, the first call's steps, the staged
    run), from (label, probe report or None) pairs."""
    summary, steps, staged = [], [], []
    for label, m in reports:
        if m is None:
            summary.append([label, "err", *["-"] * 7])
            continue
        summary.append(
            [
                label,
                f"{m['first_call_s']:.3f}",
                f"{m['second_call_s'] * 1e3:.2f}",
                f"{m['import_cute_fa_s']:.3f}",
                f"{m['cuda_init_s']:.3f}",
                _ms(m["gc_debt_s"]),
                "yes" if m["dsl_imported"] else "no",
                f"{m['compiles']}/{m['disk_hits']}",
                ", ".join(m["kernels"]) or "-",
            ]
        )
        if "plan_load_s" in m:
            staged.append(
                [
                    label,
                    _ms(m["plan_load_s"]),
                    _ms(m["first_call_s"]),
                    _ms(m["plan_load_s"] + m["first_call_s"]),
                    _ms(m["gc_s"]),
                ]
            )
            continue
        done = [m["steps_s"].get(name, 0.0) for name in FIRST_CALL_STEPS]
        rest = m["first_call_s"] - sum(done)
        steps.append(
            [
                label,
                _ms(m["first_call_s"]),
                *(_ms(x) for x in done),
                _ms(rest),
                _ms(m["gc_s"]),
                _ms(m.get("sdpa_first_call_s")),
            ]
        )
    return [summary, steps, staged]


def run_compile_time(args: argparse.Namespace) -> int:
    """Cold compile and disk-cache hit of one forward kernel, each in a fresh process."""
    d = args.d[0] if args.d_given else 128
    causal = int(args.causal[0]) if args.causal_given else 0
    probe = [
        sys.executable,
        "-c",
        _PROBE_BOOTSTRAP,
        "--probe-first-call",
        "--d",
        str(d),
        "--causal",
        str(causal),
        "--dtype",
        args.dtype,
    ]
    # The DSL's own file cache is switched off so that only cute_fa's cache is measured
    # (``cute.compile`` bypasses it anyway: it compiles with ``no_cache``).
    base_env = {**os.environ, "CUTE_DSL_DISABLE_FILE_CACHING": "1"}
    base_env.pop("CUTE_FA_CACHE", None)
    reports: list[tuple[str, dict | None]] = []
    with tempfile.TemporaryDirectory(prefix="cute-fa-bench-cache-") as cache_dir:
        runs = [
            ("cold, CUTE_FA_CACHE=0", {"CUTE_FA_CACHE": "0"}, []),
            ("cold, empty cache dir", {}, []),
            ("disk hit, new process", {}, []),
            ("disk hit, staged", {}, ["--probe-staged"]),
        ]
        print(f"compile time: fwd {args.dtype} d={d} causal={causal}, one new process per row")
        for label, extra, flags in runs:
            env = {**base_env, "CUTE_FA_CACHE_DIR": cache_dir, **extra}
            proc = subprocess.run(
                probe + flags, env=env, capture_output=True, text=True, check=False
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PROBE_TAG)]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
                print(f"  {label}: err (exit {proc.returncode})\n    " + "\n    ".join(tail))
                reports.append((label, None))
                continue
            reports.append((label, json.loads(lines[-1][len(PROBE_TAG) :])))
    summary, steps, staged = compile_time_rows(reports)
    print()
    _print_table(
        (
            "run",
            "first call s",
            "second call ms",
            "import cute_fa s",
            "CUDA init s",
            "GC debt ms",
            "DSL imported",
            "compiles/disk hits",
            "kernel",
        ),
        summary,
    )
    print("\nwhere the first call's time went (ms; steps of cute_fa.cache.step_seconds()):\n")
    _print_table(
        ("run", "first call", *FIRST_CALL_STEPS, "rest", "GC", "SDPA 1st"),
        steps,
    )
    if staged:
        print("\nthe disk hit one step at a time (ms):\n")
        _print_table(("run", "plan + load", "first call", "sum", "GC"), staged)
    print(
        "\nfirst call: flash_attn_func from its start to the end of a device sync, in a new "
        "process whose CUDA context is already up (CUDA init: the torch.randn calls and the "
        "sync before it, which any CUDA library's first call needs) and whose garbage "
        "collector has just run a full pass (GC debt: gc.collect() after importing torch; "
        "that pass is due soon after the import and would otherwise land on whichever call "
        "comes next, cute_fa's or any other). Steps: import DSL (the "
        "CuTe DSL and the kernel's modules), cute.compile (tracing, MLIR passes, NVVM, "
        "ptxas), export (host code to an object file), link (ld -shared), fingerprint (the "
        "cache directory's name), import tvm_ffi, load (the kernel's shared library). rest: "
        "the checks, dispatch, the cache lookup's file work, allocating out and lse, and the "
        "launch, whose first one loads the kernel into the CUDA context. GC: the garbage "
        "collector's pauses inside the first call (already inside the other columns). SDPA "
        "1st: torch's scaled_dot_product_attention, first call in the same process after "
        "cute_fa's, for scale. Staged: dispatch and the cache lookup (importing the cache "
        "module, fingerprint, import tvm_ffi, load) first, then the call, which then finds "
        "its kernel in memory: checks, allocation and the first launch. DSL imported: whether "
        "the first call imported the CuTe DSL (a disk hit does not need it: Note [loading "
        "without the DSL] in cute_fa/cache.py)."
    )
    return 0


# --------------------------------------------------------------------------------------------
# CLI


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    out = []
    for part in text.replace(",", " ").split():
        part = part.lower()
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return out


def _window(text: str) -> tuple[int, int]:
    parts = [p for p in text.replace(",", " ").split() if p]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT (two integers), got {text!r}")
    try:
        return int(parts[0]), int(parts[1])
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--window takes two integers, got {text!r}") from e


def _name_list(text: str) -> list[str]:
    names = [p.strip() for p in text.replace(",", " ").split() if p.strip()]
    bad = [n for n in names if split_impl(n)[0] not in IMPLS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {bad}; choose from {IMPLS}")
    for n in names:
        base, settings = split_impl(n)
        if not settings:
            continue
        if base not in ("cute_fa", "cute_fa_det"):
            raise argparse.ArgumentTypeError(f"{n}: only cute_fa and cute_fa_det take settings")
        if any(len(setting) != 2 for setting in settings):
            raise argparse.ArgumentTypeError(f"{n}: expected {VARIANT_SEP}NAME=VALUE settings")
        try:
            check_variant(settings)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"{n}: {e}") from None
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"implementations named twice in {text!r}")
    return names


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Time cute_fa against torch SDPA (FLASH = CUDA FA2, CUDNN) and FlexAttention in one "
            "run. Default: the standard grid (bf16, 16k tokens: batch = 16384 / seqlen; hidden "
            "2048: heads = 2048 / d; d 64,128,256; seqlen 512..16k; causal 0,1). The table is "
            "printed last; bench.csv, env.json and bench_<mode>.png go to --out."
        ),
    )
    p.add_argument(
        "--mode", choices=("fwd", "bwd", "both"), default="fwd", help="(default %(default)s)"
    )
    p.add_argument(
        "--dtype", choices=("bf16", "fp16"), default="bf16", help="(default %(default)s)"
    )
    p.add_argument(
        "--d",
        type=_int_list,
        default=None,
        help=f"head dims, e.g. '64,128' (default {','.join(map(str, GRID_D))})",
    )
    p.add_argument(
        "--dv",
        type=int,
        default=None,
        help="value head dim (default: each --d), e.g. 128 with --d 192",
    )
    p.add_argument(
        "--softcap",
        type=float,
        default=0.0,
        help="scores become softcap * tanh(scores / softcap) (default 0: off; SDPA has none, "
        "FlexAttention gets it as a score_mod)",
    )
    p.add_argument(
        "--window",
        type=_window,
        default=None,
        help="sliding window LEFT,RIGHT (e.g. '256,0'; bottom-right aligned; replaces --causal, "
        "FLOPs count the kept pairs exactly; SDPA has none)",
    )
    p.add_argument(
        "--seqlen",
        type=_int_list,
        default=None,
        help="sequence lengths, e.g. '8k' or '512,1024' (default 512..16k)",
    )
    p.add_argument(
        "--causal", type=_int_list, default=None, help="'0', '1' or '0,1' (default both)"
    )
    p.add_argument(
        "--peers",
        type=_name_list,
        default=list(DEFAULT_PEERS),
        help=f"implementations to time (default {','.join(DEFAULT_PEERS)}; also cute_fa_det: "
        "cute_fa with deterministic=True; and tuning variants timed beside cute_fa in the same "
        "run, e.g. cute_fa:sm90_fwd.rescale_threshold=8 (a typed tuning field) or "
        "cute_fa:CUTE_FA_FWD_ARCH=80, several settings joined by ':')",
    )
    p.add_argument(
        "--tokens", type=int, default=16384, help="batch = tokens / seqlen (default %(default)s)"
    )
    p.add_argument(
        "--hidden", type=int, default=2048, help="heads = hidden / d (default %(default)s)"
    )
    p.add_argument(
        "--warmup", type=float, default=25.0, help="warm-up per case, ms (default %(default)s)"
    )
    p.add_argument(
        "--rep",
        type=float,
        default=100.0,
        help="timed repetitions per case, ms (default %(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=_positive_int,
        default=1,
        help="time every implementation of a case this many times, in turns (A, B, A, B, ...; "
        "each turn a full --warmup and --rep), and report the median of the turns: peers then "
        "see the same run of clocks, which on a power-capped GPU move by several percent "
        "(default %(default)s)",
    )
    p.add_argument("--out", default="bench-out", help="output folder (default %(default)s)")
    p.add_argument(
        "--overhead",
        action="store_true",
        help="host overhead of a cached call: b1 s128 h1 d64, back-to-back calls, "
        "cute_fa beside SDPA FLASH",
    )
    p.add_argument(
        "--calls",
        type=int,
        default=2000,
        help="calls per --overhead measurement (default %(default)s)",
    )
    p.add_argument(
        "--compile-time",
        action="store_true",
        help="cold compile of one forward kernel and a disk-cache hit in a new "
        "process (subprocesses; --d/--causal pick the kernel, default d128)",
    )
    p.add_argument(
        "--ceilings",
        action="store_true",
        help="what the GPU reaches on plain work: 8192^3 matmul TFLOPs/s and "
        "device-copy bandwidth (the ceilings of docs/performance.md)",
    )
    p.add_argument("--probe-first-call", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe-staged", action="store_true", help=argparse.SUPPRESS)
    return p


def main(
    argv: Sequence[str] | None = None, prog: str | None = None, results_out: list | None = None
) -> int:
    """The command; a grid run also appends its ``Result`` rows to ``results_out``."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.d_given, args.seqlen_given, args.causal_given = (
        args.d is not None,
        args.seqlen is not None,
        args.causal is not None,
    )
    args.d = args.d or list(GRID_D)
    args.seqlen = args.seqlen or list(GRID_SEQLEN)
    args.causal = args.causal or list(GRID_CAUSAL)
    if any(c not in (0, 1) for c in args.causal):
        parser.error("--causal takes 0 and/or 1")
    if args.window is not None:
        if args.causal_given and args.causal != [0]:
            parser.error("--window replaces --causal (a causal window is --window LEFT,0)")
        args.causal = [0]

    import torch

    if not torch.cuda.is_available():
        print(
            "cute_fa bench needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2
    if args.probe_first_call:
        return _probe_first_call(args)
    if args.compile_time:
        return run_compile_time(args)
    if args.ceilings:
        return run_ceilings(args)
    if args.overhead:
        return run_overhead(args)
    return run_grid(args, results_out)


if __name__ == "__main__":
    sys.exit(main())
