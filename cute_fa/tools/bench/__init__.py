"""Forward/backward attention timing: cute_fa beside torch's SDPA backends and FlexAttention.

Run it as ``python -m cute_fa bench``. One module per mode (``grid``, ``overhead``,
``compile_time``; ``common`` and ``impls`` what they share). Modes:

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
import sys
from collections.abc import Sequence

from .common import (
    DEFAULT_PEERS,
    DEVICE,
    GRID_CAUSAL,
    GRID_D,
    GRID_SEQLEN,
    IMPL_LABELS,
    IMPLS,
    VARIANT_SEP,
    Rotation,
    attention_flops,
    check_variant,
    env_settings,
    family_settings,
    impl_label,
    median_ms,
    num_input_sets,
    split_impl,
    variant_context,
    visible_pairs,
)
from .compile_time import (
    _PROBE_BOOTSTRAP,
    FIRST_CALL_STEPS,
    IMPORT_SECONDS,
    _probe_first_call,
    compile_time_rows,
    run_compile_time,
)
from .grid import (
    Case,
    ErrorLog,
    Result,
    environment,
    format_table,
    grid_cases,
    run_grid,
    time_case,
    write_csv,
    write_plot,
)
from .impls import Impl, ImplUnavailable
from .overhead import run_ceilings, run_overhead

__all__ = [
    "DEFAULT_PEERS", "DEVICE", "FIRST_CALL_STEPS", "GRID_CAUSAL", "GRID_D", "GRID_SEQLEN",
    "IMPLS", "IMPL_LABELS", "IMPORT_SECONDS", "VARIANT_SEP", "_PROBE_BOOTSTRAP", "Case",
    "ErrorLog", "Impl", "ImplUnavailable", "Result", "Rotation", "attention_flops",
    "build_parser", "compile_time_rows", "env_settings", "environment", "family_settings",
    "format_table", "grid_cases", "impl_label", "main", "median_ms", "num_input_sets",
    "run_ceilings", "run_compile_time", "run_grid", "run_overhead", "split_impl", "time_case",
    "variant_context", "visible_pairs", "write_csv", "write_plot",
]  # fmt: skip


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
