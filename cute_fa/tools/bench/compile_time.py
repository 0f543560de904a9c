"""``--compile-time`` and the first-call probe: what a first call of a new process costs."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from .common import DEVICE, PROBE_TAG
from .grid import _torch_dtype


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
