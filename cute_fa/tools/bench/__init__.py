"""Forward/backward attention timing: cute_fa beside torch's SDPA backends and FlexAttention.

Run it as ``python -m cute_fa bench``. One module per mode (``grid``, ``decode``, ``overhead``,
``compile_time``; ``common`` and ``impls`` what they share). Modes:

* default: the standard grid (bf16, 16k tokens so batch = tokens / seqlen, hidden 2048 so
  heads = hidden / d, d in {64, 128, 256}, seqlen in {512 .. 16k}, causal in {0, 1}); every
  implementation is timed in the same process on the same inputs, the table is printed last,
  and a CSV (plus a PNG when matplotlib is importable) goes to ``--out``.
* ``--decode``: decode attention, causal (bottom-right), forward: seqlen_q in {1, 4} against a
  K/V cache of 4k / 32k / 128k keys (``seqused_k``), batch in {1, 8, 64}, 32 query heads over 8
  K/V heads, d 128, K/V contiguous or paged (``page_table``, pages of 16 or 128 keys); cute_fa,
  FA4 and SDPA FLASH / CUDNN (contiguous only) on the same inputs. Per point and
  implementation: median us, K+V bytes read / time in TB/s (Q and O left out), that over the
  device-copy bandwidth measured at the start of the run, and cute_fa against the best peer;
  ``--batch``, ``--seqlen`` (cache lengths), ``--seqlen-q`` and ``--layouts`` pick subsets. The
  table is printed last and ``decode.csv`` goes to ``--out``.
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
    bandwidth_tbps,
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
from .decode import (
    DECODE_BATCH,
    DECODE_CACHE,
    DECODE_D,
    DECODE_LAYOUTS,
    DECODE_PEERS,
    DECODE_SEQLEN_Q,
    DecodeInputs,
    DecodePoint,
    DecodeResult,
    best_peer,
    cute_fa_over_best,
    decode_points,
    format_decode_table,
    make_inputs,
    make_page_table,
    page_size_of,
    run_decode,
    time_point,
    unavailable,
    write_decode_csv,
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
    time_rounds,
    write_csv,
    write_plot,
)
from .impls import Impl, ImplUnavailable, fa4_decode_splits
from .overhead import copy_bandwidth, run_ceilings, run_overhead

__all__ = [
    "Case", "DECODE_BATCH", "DECODE_CACHE", "DECODE_D", "DECODE_LAYOUTS", "DECODE_PEERS",
    "DECODE_SEQLEN_Q", "DEFAULT_PEERS", "DEVICE", "DecodeInputs", "DecodePoint", "DecodeResult",
    "ErrorLog", "FIRST_CALL_STEPS", "GRID_CAUSAL", "GRID_D", "GRID_SEQLEN", "IMPLS", "IMPL_LABELS",
    "IMPORT_SECONDS", "Impl", "ImplUnavailable", "Result", "Rotation", "VARIANT_SEP",
    "_PROBE_BOOTSTRAP", "attention_flops", "bandwidth_tbps", "best_peer", "build_parser",
    "compile_time_rows", "copy_bandwidth", "cute_fa_over_best", "decode_points", "env_settings",
    "environment", "fa4_decode_splits", "family_settings", "format_decode_table", "format_table",
    "grid_cases", "impl_label", "main", "make_inputs", "make_page_table", "median_ms",
    "num_input_sets", "page_size_of", "parse_args", "run_ceilings", "run_compile_time",
    "run_decode", "run_grid", "run_overhead", "split_impl", "time_case", "time_point",
    "time_rounds", "unavailable", "variant_context", "visible_pairs", "write_csv",
    "write_decode_csv", "write_plot",
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


def _positive_int_list(text: str) -> list[int]:
    """'1,8,64' (a k suffix multiplies by 1024); every value >= 1."""
    try:
        values = _int_list(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _layout_list(text: str) -> list[str]:
    """K/V layouts of --decode: 'contiguous' and 'pageN' (pages of N keys), e.g.
    'contiguous,page16'."""
    names = [p.strip() for p in text.replace(",", " ").split() if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--layouts takes contiguous and/or pageN, got nothing")
    for name in names:
        try:
            page_size_of(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"layouts named twice in {text!r}")
    return names


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
        help="sequence lengths, e.g. '8k' or '512,1024' (default 512..16k); with --decode the "
        "K/V cache lengths (default 4k,32k,128k)",
    )
    p.add_argument(
        "--causal", type=_int_list, default=None, help="'0', '1' or '0,1' (default both)"
    )
    p.add_argument(
        "--peers",
        type=_name_list,
        default=None,
        help=f"implementations to time (default {','.join(DEFAULT_PEERS)}; with --decode "
        f"{','.join(DECODE_PEERS)}; also cute_fa_det: "
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
        "--decode",
        action="store_true",
        help="decode: seqlen_q 1 and 4 against a K/V cache (seqused_k), causal, 32 query / 8 "
        "K/V heads, d 128 (--d), contiguous or paged K/V; time, K+V TB/s, its fraction of the "
        "device-copy bandwidth and cute_fa over the best peer; decode.csv to --out",
    )
    p.add_argument(
        "--batch",
        type=_positive_int_list,
        default=None,
        help=f"--decode batch sizes (default {','.join(map(str, DECODE_BATCH))})",
    )
    p.add_argument(
        "--seqlen-q",
        type=_positive_int_list,
        default=None,
        help=f"--decode query rows per sequence (default {','.join(map(str, DECODE_SEQLEN_Q))})",
    )
    p.add_argument(
        "--layouts",
        type=_layout_list,
        default=None,
        help="--decode K/V layouts: contiguous (batch, cache, heads, d) and pageN (pages of N "
        f"keys and a shuffled page_table) (default {','.join(DECODE_LAYOUTS)})",
    )
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


def _decode_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--decode's options checked against the rest (parser.error on a conflict) and its
    defaults filled in."""
    modes = (("--overhead", args.overhead), ("--compile-time", args.compile_time),
             ("--ceilings", args.ceilings))  # fmt: skip
    others = [option for option, on in modes if on]
    if others:
        parser.error(f"--decode and {', '.join(others)} are separate modes: pick one")
    if args.mode != "fwd":
        parser.error("--decode times the forward only (leave out --mode)")
    if args.causal_given:
        parser.error("--decode is causal, bottom-right aligned (leave out --causal)")
    if args.window is not None or args.softcap:
        parser.error("--decode takes neither --window nor --softcap")
    args.d = args.d or [DECODE_D]
    args.seqlen = args.seqlen or list(DECODE_CACHE)
    args.batch = args.batch or list(DECODE_BATCH)
    args.seqlen_q = args.seqlen_q or list(DECODE_SEQLEN_Q)
    args.layouts = args.layouts or list(DECODE_LAYOUTS)
    args.peers = args.peers or list(DECODE_PEERS)
    try:
        decode_points(args)
    except ValueError as e:
        parser.error(f"--decode: {e}")


def parse_args(argv: Sequence[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """The command line checked (argparse's error and exit on a bad one) and every default of
    its mode filled in; needs no GPU."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.d_given, args.seqlen_given, args.causal_given = (
        args.d is not None,
        args.seqlen is not None,
        args.causal is not None,
    )
    if args.decode:
        _decode_args(parser, args)
    else:
        given = [
            option
            for option, value in (
                ("--batch", args.batch),
                ("--seqlen-q", args.seqlen_q),
                ("--layouts", args.layouts),
            )
            if value is not None
        ]
        if given:
            parser.error(f"{', '.join(given)}: only with --decode")
        args.peers = args.peers or list(DEFAULT_PEERS)
    args.d = args.d or list(GRID_D)
    args.seqlen = args.seqlen or list(GRID_SEQLEN)
    args.causal = args.causal or list(GRID_CAUSAL)
    if any(c not in (0, 1) for c in args.causal):
        parser.error("--causal takes 0 and/or 1")
    if args.window is not None:
        if args.causal_given and args.causal != [0]:
            parser.error("--window replaces --causal (a causal window is --window LEFT,0)")
        args.causal = [0]
    return args


def main(
    argv: Sequence[str] | None = None, prog: str | None = None, results_out: list | None = None
) -> int:
    """The command; a grid or decode run also appends its result rows to ``results_out``."""
    args = parse_args(argv, prog)

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
    if args.decode:
        return run_decode(args, results_out)
    return run_grid(args, results_out)


if __name__ == "__main__":
    sys.exit(main())
