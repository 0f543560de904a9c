"""The grid mode: every implementation timed on each case in one process; tables, CSV, plot."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .common import (
    DEVICE,
    Rotation,
    attention_flops,
    impl_label,
    median_ms,
    num_input_sets,
    split_impl,
)
from .impls import Impl, ImplUnavailable

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

    @property
    def label(self) -> str:
        """The case in a log line: 'd=128 s=8192 causal=1'."""
        return f"d={self.head_dim} s={self.seqlen} causal={int(self.causal)}"


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

    def report(self, impl: str, case, mode: str, exc: BaseException) -> str:
        """Print ``exc`` against ``impl`` unless that reason was printed before; return the
        reason. ``case`` is anything with a ``label`` (a grid ``Case``, a decode point)."""
        reason = (
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        )
        reason = reason[:300]
        key = (impl, reason)
        if key not in self.seen:
            self.seen.add(key)
            print(f"  [{impl}] {mode} {case.label}: {reason}", file=sys.stderr, flush=True)
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


def _settle(impl: Impl | None, case, mode: str, errors: ErrorLog) -> None:
    """Wait for the GPU and free cached blocks; an error there (e.g. a sticky launch error, after
    which later cells err too) is logged against ``impl``."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        errors.report(impl.name if impl else "bench", case, mode, e)


def time_rounds(
    prepared: list[tuple[Impl, list]],
    args: argparse.Namespace,
    failed: Callable[[Impl, BaseException], None],
) -> dict[str, float]:
    """Median ms of each prepared implementation (its calls rotated over its input sets): every
    round (``args.rounds``) times each of them in turn (A, B, C, A, B, C, ...), so with
    --rounds > 1 all of them see the same run of clocks. One that raises is passed to
    ``failed`` once, never timed again, and left out of the result."""
    round_ms: dict[str, list[float]] = {impl.name: [] for impl, _ in prepared}
    dead: set[str] = set()
    for _ in range(args.rounds):
        for impl, fns in prepared:
            if impl.name in dead:  # failed in an earlier round
                continue
            try:
                with impl.context():
                    round_ms[impl.name].append(median_ms(Rotation(fns), args.warmup, args.rep))
            except Exception as e:  # noqa: BLE001 - a failing peer is reported, never fatal
                dead.add(impl.name)
                failed(impl, e)
    return {name: statistics.median(ms) for name, ms in round_ms.items() if name not in dead}


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
    # Each implementation's calls are built once, then timed in rounds (time_rounds).
    prepared: list[tuple[Impl, list]] = []
    outcome: dict[str, Result] = {}
    fns = None

    def failed(impl: Impl, e: BaseException) -> None:
        outcome[impl.name] = _failed(mode, case, impl, e, errors)
        _settle(impl, case, mode, errors)

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
        for name, ms in time_rounds(prepared, args, failed).items():
            outcome[name] = Result(mode, case, name, ms)
    finally:
        del prepared, fns
        _settle(None, case, mode, errors)
    for impl in impls:
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
