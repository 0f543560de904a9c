"""What every bench mode shares: peers and their variants, FLOPs, the timing method."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
from collections.abc import Callable, Sequence

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
# FLOPs and bytes


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


def bandwidth_tbps(nbytes: float, ms: float) -> float:
    """TB/s (10^12 bytes a second) of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e12


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


def num_input_sets(set_bytes: int, l2_bytes: int, max_sets: int = 16, min_sets: int = 2) -> int:
    """How many input sets to rotate so that together they are >= 3x the L2 (at least
    ``min_sets``: the grid keeps two; decode, whose sets reach 32 GiB, one)."""
    return max(min_sets, min(max_sets, math.ceil(3 * l2_bytes / max(set_bytes, 1))))
