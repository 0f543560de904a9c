"""``python -m cute_fa <command>``: features | precompile | demo | selftest | bench | tune.

features    the feature matrix, generated from each kernel class's can_implement
precompile  fill the on-disk compile cache with the forward and backward kernels of a matrix
            of configs (no GPU needed)
demo        on a GPU: attention at a few shapes against the reference (PASS/FAIL);
            without one: cross-compile the forward each target runs (sm_80, sm_90a, sm_100a)
            and report registers, shared memory, spills and the SASS instruction mix
selftest    on a GPU: the first-use self-check of every forward variant precompile builds
            for it, as a table (``cute_fa.tools.selftest``)
bench       timing against torch SDPA, FlexAttention and FA4 (``cute_fa.tools.bench``)
tune        the sm80 forward (``--mode bwd``: backward) over candidate tile shapes, beside SDPA
            FLASH; ``--arch 90``: the sm90 forward's tuning fields as peers; ``--write`` keeps the
            winners in this GPU's tuned table, ``--show`` / ``--reset`` (``cute_fa.tools.tune``)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .demo import cmd_demo
from .precompile import ARCH_TARGETS, PRECOMPILE_MODES, VARIANT_FLAGS, cmd_precompile

DTYPES = ("bf16", "fp16")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str) -> list[int]:
    return [int(part) for part in _csv(text)]


# --------------------------------------------------------------------------------------------
# features


def cmd_features(args: argparse.Namespace) -> int:
    from .features import format_feature_matrix

    print(format_feature_matrix(markdown=args.markdown))
    return 0


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cute_fa", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("features", help="feature matrix by GPU architecture")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=cmd_features)

    p = sub.add_parser("precompile", help="fill the on-disk compile cache (no GPU needed)")
    p.add_argument(
        "--arch",
        default="auto",
        choices=sorted(ARCH_TARGETS),
        help="kernel family: auto (default) compiles what dispatch picks on the target (on "
        "sm_90a: the sm90 kernels where they implement the call); sm80 / sm90 force one",
    )
    p.add_argument(
        "--mode",
        default="both",
        choices=PRECOMPILE_MODES,
        help="the forward's kernels, the backward's (main, pre- and postprocess) or both (default)",
    )
    p.add_argument(
        "--target",
        help="compile target, e.g. sm_90a (default: this machine's GPU, else the arch's own)",
    )
    p.add_argument("--head-dims", type=_ints, default=[64, 96, 128, 192, 256])
    p.add_argument("--dtypes", type=_csv, default=list(DTYPES))
    p.add_argument(
        "--variants",
        type=_csv,
        default=["plain", "causal"],
        help="comma-separated; each a '+'-joined set of " + ", ".join(VARIANT_FLAGS),
    )
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.set_defaults(func=cmd_precompile)

    p = sub.add_parser("demo", help="check against the reference (GPU) or inspect cubins (CPU)")
    p.add_argument("--cpu", action="store_true", help="cross-compile and inspect even on a GPU")
    p.add_argument("--targets", type=_csv, default=["sm_80", "sm_90a", "sm_100a"])
    p.add_argument("--head-dims", type=_ints, default=[64, 128, 256])
    p.add_argument(
        "--mode",
        choices=("fwd", "bwd", "both"),
        default="fwd",
        help="CPU: the forward, the backward's main kernel, or both (default fwd)",
    )
    p.set_defaults(func=cmd_demo)

    from .selftest import add_arguments as add_selftest_arguments
    from .selftest import cmd_selftest

    p = sub.add_parser("selftest", help="first-use self-check of every forward variant (GPU)")
    add_selftest_arguments(p)
    p.set_defaults(func=cmd_selftest)

    sub.add_parser("bench", help="timing against torch SDPA and FlexAttention", add_help=False)
    sub.add_parser(
        "tune",
        help="time the sm80 kernels' tiles or (--arch 90) the sm90 forward's switches (GPU)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from . import bench

        return bench.main(argv[1:], prog="python -m cute_fa bench")
    if argv and argv[0] == "tune":
        from . import tune

        return tune.main(argv[1:], prog="python -m cute_fa tune")
    args = build_parser().parse_args(argv)
    if getattr(args, "dtypes", None):
        unknown = [d for d in args.dtypes if d not in DTYPES]
        if unknown:
            raise SystemExit(f"unknown dtypes {unknown}; choose from {DTYPES}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
