"""The decode mode (``--decode``): a few query rows against a long K/V cache, as in generation.

Points: seqlen_q in {1, 4}, 32 query heads over 8 K/V heads (GQA), d = dv = 128, batch in
{1, 8, 64}, cache length in {4k, 32k, 128k}, and three K/V layouts: ``contiguous`` (K/V
(batch, cache_len, 8, d)) and ``page16`` / ``page128`` (K/V pages (num_pages, page_size, 8, d)
and an int32 ``page_table`` (batch, pages_per_seq) holding a shuffled permutation of the pages:
flash_attn.cute's paged layout). Every layout passes ``seqused_k`` = the cache length, and the
attention is causal with bottom-right alignment (each query row sees the cache up to its own
position at the end). Each point's inputs are built once and every implementation is timed on
them (``Impl.decode_fn``); they are freed before the next point.

Calls: cute_fa and FA4 (``flash_attn.cute``) get ``flash_attn_varlen_func(q, k, v,
max_seqlen_k=cache_len, seqused_k=..., page_table=... (paged only), causal=True, num_splits=0,
pack_gqa=None)``, except that FA4 gets num_splits=1 where its forward has no split-KV (sm80,
sm90, sm120: ``impls.fa4_decode_splits``). SDPA FLASH and CUDNN take the contiguous layout only,
with ``enable_gqa=True``; one query row needs no mask, more rows FLASH's own bottom-right causal
(torch's ``causal_lower_right``) and CUDNN an explicit boolean mask. An implementation that
cannot take a point (ImplUnavailable, NotImplementedError, ValueError, SDPA's 'No available
kernel') reads 'n/a', any other failure 'err'; the reasons of both go to stderr once each.
cute_fa reads ``seqused_k`` on the host in every call (its value checks, a sync inside the timed
call) unless ``CUTE_FA_SKIP_CHECKS=1``; the run prints which, and env.json records it.

Bandwidth: ``kv_bytes`` counts the K and V bytes read (batch * cache_len * heads_kv * (d + dv)
* 2 bytes), not Q, O, seqused_k or the page table (Q and O add 4 * seqlen_q / cache_len of it:
at most 0.4 % at these points). KV TB/s = kv_bytes / median time. ``/copy`` is that over the
device-copy bandwidth measured at the start of the same run (``overhead.copy_bandwidth``, the
copy of ``--ceilings``: 1 GiB, read + write counted), so 1.0 means the attention streamed its
cache as fast as a copy moves bytes. ``cute_fa/best`` is the best peer's time over cute_fa's
(> 1: cute_fa faster).

Input sets rotate as in the grid (``num_input_sets``), but down to one set where one set's
bytes are at least three times the L2: the largest point holds 32 GiB of K/V.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
import warnings
from dataclasses import dataclass

from .common import DEVICE, bandwidth_tbps, impl_label, num_input_sets, split_impl
from .grid import ErrorLog, _settle, _torch_dtype, environment, time_rounds
from .impls import Impl, ImplUnavailable
from .overhead import COPY_BYTES, copy_bandwidth

DECODE_SEQLEN_Q = (1, 4)
DECODE_BATCH = (1, 8, 64)
DECODE_CACHE = (4096, 32768, 131072)
DECODE_LAYOUTS = ("contiguous", "page16", "page128")
DECODE_PEERS = ("cute_fa", "fa4", "flash", "cudnn")
DECODE_HEADS = 32
DECODE_HEADS_KV = 8
DECODE_D = 128
CONTIGUOUS = "contiguous"

# --------------------------------------------------------------------------------------------
# Points


def page_size_of(layout: str) -> int | None:
    """None for 'contiguous', N for 'pageN' (N >= 1); ValueError for anything else."""
    if layout == CONTIGUOUS:
        return None
    size = layout.removeprefix("page")
    if layout.startswith("page") and size.isdigit() and int(size) >= 1:
        return int(size)
    raise ValueError(f"unknown K/V layout {layout!r}: expected {CONTIGUOUS} or pageN (e.g. page16)")


def length_label(n: int) -> str:
    """'32k' for 32768, '1000' for 1000."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    seqlen_q: int
    cache_len: int
    layout: str  # "contiguous" or "pageN"
    heads: int = DECODE_HEADS
    heads_kv: int = DECODE_HEADS_KV
    head_dim: int = DECODE_D
    head_dim_v: int | None = None  # None: head_dim
    elem_bytes: int = 2  # bf16 / fp16

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def page_size(self) -> int | None:
        return page_size_of(self.layout)

    @property
    def pages_per_seq(self) -> int | None:
        """Pages of one sequence (the page table's width); None for the contiguous layout."""
        return None if self.page_size is None else self.cache_len // self.page_size

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V read: every key of every sequence (seqused_k = cache_len)."""
        return (
            self.batch * self.cache_len * self.heads_kv
            * (self.head_dim + self.dv) * self.elem_bytes
        )  # fmt: skip

    @property
    def qo_bytes(self) -> int:
        """Bytes of Q read and O written (left out of the bandwidth)."""
        rows = self.batch * self.seqlen_q * self.heads
        return rows * (self.head_dim + self.dv) * self.elem_bytes

    @property
    def label(self) -> str:
        """The point in a log line: 'sq=1 b=8 cache=32k page16'."""
        return (
            f"sq={self.seqlen_q} b={self.batch} cache={length_label(self.cache_len)} {self.layout}"
        )


def decode_points(args: argparse.Namespace) -> list[DecodePoint]:
    """Every (seqlen_q, batch, cache length, layout) of ``args``, in that nesting; ValueError
    for a value no point can have (a cache length that is not a whole number of pages, a
    query longer than the cache)."""
    points = []
    for d in args.d:
        for sq in args.seqlen_q:
            for batch in args.batch:
                for cache in args.seqlen:
                    if cache < sq:
                        raise ValueError(f"cache length {cache} is shorter than seqlen_q {sq}")
                    for layout in args.layouts:
                        size = page_size_of(layout)
                        if size is not None and cache % size:
                            raise ValueError(
                                f"cache length {cache} is not a whole number of {layout} pages"
                            )
                        points.append(DecodePoint(batch, sq, cache, layout, head_dim=d,
                                                  head_dim_v=args.dv))  # fmt: skip
    return points


# --------------------------------------------------------------------------------------------
# Inputs


def make_page_table(batch: int, pages_per_seq: int, device=DEVICE, generator=None):
    """int32 (batch, pages_per_seq): a shuffled permutation of the batch * pages_per_seq pages,
    so that every page belongs to one sequence once and a sequence's pages lie scattered
    over the pool, as a cache allocator leaves them."""
    import torch

    perm = torch.randperm(batch * pages_per_seq, generator=generator, device=device)
    return perm.to(torch.int32).reshape(batch, pages_per_seq)


@dataclass
class DecodeInputs:
    q: object
    k: object
    v: object
    seqused_k: object
    page_table: object = None  # None: the contiguous layout


def make_inputs(point: DecodePoint, dtype, device=DEVICE, generator=None) -> DecodeInputs:
    """Random q and K/V of ``point``'s layout, seqused_k = the cache length for every sequence."""
    import torch

    q = torch.randn(
        point.batch, point.seqlen_q, point.heads, point.head_dim, dtype=dtype, device=device,
        generator=generator,
    )  # fmt: skip
    if point.page_size is None:
        lead = (point.batch, point.cache_len)
        page_table = None
    else:
        lead = (point.batch * point.pages_per_seq, point.page_size)
        page_table = make_page_table(point.batch, point.pages_per_seq, device, generator)
    k = torch.randn(*lead, point.heads_kv, point.head_dim, dtype=dtype, device=device,
                    generator=generator)  # fmt: skip
    v = torch.randn(*lead, point.heads_kv, point.dv, dtype=dtype, device=device,
                    generator=generator)  # fmt: skip
    seqused_k = torch.full((point.batch,), point.cache_len, dtype=torch.int32, device=device)
    return DecodeInputs(q, k, v, seqused_k, page_table)


# --------------------------------------------------------------------------------------------
# Timing


@dataclass
class DecodeResult:
    point: DecodePoint
    impl: str
    ms: float | None = None
    status: str = "ok"  # "ok" | "err" | "n/a"
    reason: str = ""

    @property
    def us(self) -> float | None:
        return None if self.ms is None else self.ms * 1e3

    @property
    def kv_tbps(self) -> float | None:
        return None if self.ms is None else bandwidth_tbps(self.point.kv_bytes, self.ms)

    def of_copy(self, copy_tbps: float | None) -> float | None:
        """KV bandwidth over the device-copy bandwidth (None when either is missing)."""
        if self.kv_tbps is None or not copy_tbps:
            return None
        return self.kv_tbps / copy_tbps


def unavailable(e: BaseException) -> bool:
    """Whether an implementation's exception means it cannot take the point ('n/a'): our
    ImplUnavailable, NotImplementedError and ValueError (what cute_fa raises for a feature it
    lacks or arguments it refuses), and SDPA's 'No available kernel' for a shape none of its
    enabled kernels takes; anything else is an error ('err')."""
    if isinstance(e, (ImplUnavailable, NotImplementedError, ValueError)):
        return True
    return isinstance(e, RuntimeError) and _sdpa_refused(e)


def _sdpa_refused(e: BaseException) -> bool:
    """SDPA's error for a call none of its enabled kernels takes (its wording varies by torch
    version)."""
    return any(text in str(e) for text in ("No available kernel", "No viable backend"))


def _first_call(fn, sdpa: bool) -> None:
    """One call (compiles, autotunes, self-checks) and a sync. For SDPA (``sdpa``) a refusal
    ('No available kernel') comes back with the first warning torch gave for it (why its
    kernels refused); the others' warnings are left alone."""
    import torch

    if not sdpa:
        fn()
        torch.cuda.synchronize()
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
            torch.cuda.synchronize()
        except RuntimeError as e:
            if not _sdpa_refused(e) or not caught:
                raise
            why = str(caught[0].message).strip().splitlines()[0]
            first = str(e).strip().splitlines()[0]
            raise RuntimeError(f"{first} ({why})") from e


def time_point(
    point: DecodePoint, impls: list[Impl], dtype, args: argparse.Namespace, errors: ErrorLog
) -> list[DecodeResult]:
    """Every implementation on one point's inputs (built once, freed on return): each is
    prepared and called once, then all are timed in rounds (``grid.time_rounds``). One that
    cannot take the point reads 'n/a', one that fails 'err'; both reasons go to the error log."""
    import torch

    mode = "decode"
    outcome: dict[str, DecodeResult] = {}

    def failed(impl: Impl, e: BaseException) -> None:
        status = "n/a" if unavailable(e) else "err"
        outcome[impl.name] = DecodeResult(
            point, impl.name, None, status, errors.report(impl.name, point, mode, e)
        )
        _settle(impl, point, mode, errors)

    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size or (64 << 20)
    n_sets = num_input_sets(point.kv_bytes + point.qo_bytes, l2, min_sets=1)
    sets: list[DecodeInputs] = []
    prepared: list[tuple[Impl, list]] = []
    fns = None
    try:
        try:
            for _ in range(n_sets):
                sets.append(make_inputs(point, dtype, DEVICE))
        except torch.cuda.OutOfMemoryError as e:
            sets.clear()
            for impl in impls:
                failed(impl, e)
        if sets:
            for impl in impls:
                try:
                    with impl.context():
                        fns = [
                            impl.decode_fn(s.q, s.k, s.v, s.seqused_k, s.page_table,
                                           point.cache_len)
                            for s in sets
                        ]  # fmt: skip
                        _first_call(fns[0], sdpa=impl.name in ("flash", "cudnn"))
                    prepared.append((impl, fns))
                except Exception as e:  # noqa: BLE001 - a failing peer is reported, never fatal
                    failed(impl, e)
            for name, ms in time_rounds(prepared, args, failed).items():
                outcome[name] = DecodeResult(point, name, ms)
    finally:
        del prepared, fns, sets
        _settle(None, point, mode, errors)
    with contextlib.suppress(Exception):
        torch.cuda.empty_cache()
    return [outcome[impl.name] for impl in impls]


# --------------------------------------------------------------------------------------------
# Output


def _fmt(value: float | None, spec: str, status: str = "-") -> str:
    return status if value is None else format(value, spec)


def best_peer(results: list[DecodeResult]) -> DecodeResult | None:
    """The fastest timed result of one point that is not cute_fa (nor one of its variants)."""
    ours = ("cute_fa", "cute_fa_det")
    peers = [r for r in results if r.ms is not None and split_impl(r.impl)[0] not in ours]
    return min(peers, key=lambda r: r.ms) if peers else None


def cute_fa_over_best(results: list[DecodeResult]) -> float | None:
    """The best peer's time over cute_fa's at one point (> 1: cute_fa is faster)."""
    ours = next((r for r in results if r.impl == "cute_fa" and r.ms is not None), None)
    best = best_peer(results)
    return None if ours is None or best is None else best.ms / ours.ms


def format_decode_table(
    results: list[DecodeResult], impl_names: list[str], copy_tbps: float | None
) -> str:
    """The decode table: a row per point; per implementation its median us, K+V TB/s and that
    over ``copy_tbps`` (under the implementation's label), then the best peer and cute_fa
    over it."""
    by_point: dict[DecodePoint, list[DecodeResult]] = {}
    for r in results:
        by_point.setdefault(r.point, []).append(r)
    fixed = ["sq", "batch", "cache", "layout"]
    header = fixed + ["us", "TB/s", "/copy"] * len(impl_names)
    has_ratio = "cute_fa" in impl_names
    if has_ratio:
        header += ["best peer", "cute_fa/best"]
    lines = [header]
    for point, rs in by_point.items():
        by_impl = {r.impl: r for r in rs}
        line = [str(point.seqlen_q), str(point.batch), length_label(point.cache_len),
                point.layout]  # fmt: skip
        for name in impl_names:
            r = by_impl.get(name)
            if r is None:
                line += ["-", "-", "-"]
                continue
            line += [
                _fmt(r.us, ".1f", r.status),
                _fmt(r.kv_tbps, ".2f"),
                _fmt(r.of_copy(copy_tbps), ".2f"),
            ]
        if has_ratio:
            best = best_peer(rs)
            line += [
                "-" if best is None else impl_label(best.impl),
                _fmt(cute_fa_over_best(rs), ".2f"),
            ]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    # A row of implementation labels above each one's three columns (widened to fit).
    groups = []
    for j, name in enumerate(impl_names):
        first = len(fixed) + 3 * j
        label = impl_label(name)
        span = sum(widths[first : first + 3]) + 4
        widths[first + 2] += max(0, len(label) - span)
        groups.append(label.rjust(sum(widths[first : first + 3]) + 4))
    top = [" " * w for w in widths[: len(fixed)]] + groups
    point = next(iter(by_point), None)
    shape = (
        ""
        if point is None
        else f", heads {point.heads}/{point.heads_kv}, d {point.head_dim}"
        + ("" if point.dv == point.head_dim else f"x{point.dv}")
    )
    copy = "not measured" if not copy_tbps else f"{copy_tbps:.2f} TB/s"
    out = [
        f"decode forward{shape}, causal: median us; TB/s = K+V bytes read / time; /copy = that "
        f"over the device copy ({copy}, 1 GiB read + write, this run)",
        "  ".join(top).rstrip(),
    ]
    for j, row in enumerate(lines):
        out.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_decode_csv(
    path: str, results: list[DecodeResult], dtype_name: str, copy_tbps: float | None
) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["mode", "dtype", "impl", "batch", "seqlen_q", "cache_len", "layout", "page_size",
             "heads", "heads_kv", "head_dim", "head_dim_v", "kv_bytes", "ms", "us", "kv_tbps",
             "copy_tbps", "of_copy", "status", "reason"]
        )  # fmt: skip
        for r in results:
            p = r.point
            w.writerow(
                [
                    "decode", dtype_name, r.impl, p.batch, p.seqlen_q, p.cache_len, p.layout,
                    "" if p.page_size is None else p.page_size, p.heads, p.heads_kv,
                    p.head_dim, p.dv, p.kv_bytes, _fmt(r.ms, ".5f", ""),
                    _fmt(r.us, ".2f", ""), _fmt(r.kv_tbps, ".4f", ""),
                    _fmt(copy_tbps, ".4f", ""), _fmt(r.of_copy(copy_tbps), ".4f", ""),
                    r.status, r.reason,
                ]
            )  # fmt: skip


def _cell(r: DecodeResult) -> str:
    if r.ms is None:
        return r.status
    return f"{r.us:.1f}us {r.kv_tbps:.2f}TB/s"


# --------------------------------------------------------------------------------------------
# The mode


def run_decode(args: argparse.Namespace, results_out: list | None = None) -> int:
    """The decode points of ``args``; its ``DecodeResult`` rows also go to ``results_out``."""
    import torch

    from cute_fa import checks

    dtype = _torch_dtype(args.dtype)
    points = decode_points(args)
    impls = [Impl(n) for n in args.peers]
    env = environment()
    print("# " + "  ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    value_checks = not checks.SKIP_VALUE_CHECKS
    if value_checks:
        print(
            "# cute_fa reads seqused_k on the host in every call (its value checks: a sync "
            "inside the timed call); CUTE_FA_SKIP_CHECKS=1 times it without",
            flush=True,
        )
    errors = ErrorLog()
    copy_tbps = None
    try:
        copy_tbps, copy_ms = copy_bandwidth(args.warmup, args.rep)
        print(
            f"device copy {COPY_BYTES / (1 << 30):g} GiB (read + write): {copy_tbps:.2f} TB/s "
            f"({copy_ms:.3f} ms)",
            flush=True,
        )
    except Exception as e:  # noqa: BLE001 - the ratios read '-' without it
        print(f"device copy not measured: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    results: list[DecodeResult] = []
    for point in points:
        rs = time_point(point, impls, dtype, args, errors)
        results.extend(rs)
        print(
            f"decode {point.label}: " + "  ".join(f"{impl_label(r.impl)}={_cell(r)}" for r in rs),
            flush=True,
        )
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "decode.csv")
    write_decode_csv(csv_path, results, args.dtype, copy_tbps)
    with open(os.path.join(args.out, "env.json"), "w") as f:
        json.dump(
            {**env, "copy_tbps": copy_tbps, "cute_fa_value_checks": value_checks,
             "argv": sys.argv[1:]},
            f,
            indent=2,
        )  # fmt: skip
    print(f"wrote {csv_path}")
    print()
    print(format_decode_table(results, list(args.peers), copy_tbps))
    print()
    if results_out is not None:
        results_out.extend(results)
    return 0
