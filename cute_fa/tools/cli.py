"""``python -m cute_fa <command>``: features | precompile | demo | selftest | bench | tune.

features    the feature matrix, generated from each kernel class's can_implement
precompile  fill the on-disk compile cache with the forward and backward kernels of a matrix
            of configs (no GPU needed)
demo        on a GPU: attention at a few shapes against the reference (PASS/FAIL);
            without one: cross-compile the sm80 kernels and report registers, shared
            memory, spills and the SASS instruction mix
selftest    on a GPU: the first-use self-check of every forward variant precompile builds
            for it, as a table (``cute_fa.tools.selftest``)
bench       timing against torch SDPA and FlexAttention (``cute_fa.bench``)
tune        the sm80 forward (``--mode bwd``: backward) over candidate tile shapes, beside SDPA
            FLASH; ``--arch 90``: the sm90 forward's tuning switches as peers (``cute_fa.tune``)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

VARIANT_FLAGS = {
    "plain": {},
    "causal": {"causal": True},
    "local": {"local": True},
    "softcap": {"has_softcap": True},
    "varlen": {"varlen_q": True, "varlen_k": True},
    "varlen_q": {"varlen_q": True},
    "varlen_k": {"varlen_k": True},
    "seqused_q": {"seqused_q": True},
    "seqused_k": {"seqused_k": True},
}
# Kernel families precompile can be asked for, with the target each compiles for when neither
# --target nor a GPU says otherwise. "auto": the kernels dispatch picks for the target (on
# sm_90a the sm90 forward and backward where they implement the call, the sm80 ones for the
# rest), i.e. what a call on such a GPU would compile.
ARCH_TARGETS = {"auto": "sm_80", "sm80": "sm_80", "sm90": "sm_90a"}
PRECOMPILE_MODES = ("fwd", "bwd", "both")
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
# precompile


def _variant_flags(variant: str) -> dict:
    flags: dict = {}
    for part in variant.split("+"):
        if part not in VARIANT_FLAGS:
            raise SystemExit(f"unknown variant part {part!r}; choose from {sorted(VARIANT_FLAGS)}")
        flags.update(VARIANT_FLAGS[part])
    return flags


def _default_target(arch: str) -> str:
    try:
        import torch

        if torch.cuda.is_available():
            from cute_fa.config import target_for_capability

            return target_for_capability(*torch.cuda.get_device_capability())
    except Exception:  # no usable torch CUDA: cross-compile for the arch's own target
        pass
    return ARCH_TARGETS[arch]


# A query length past every length threshold of the tile choice (precompile covers both sides).
LONG_SEQLEN_HINT = 1 << 20
SHORT_SEQLEN_HINT = 1


def seqlen_hints() -> list[int]:
    """Query lengths that together meet every forward plan sm90 dispatch makes: the shortest
    and a very long one, and each length where ``hopper/support.py`` changes the plan (the
    persistent grid's limits, its one-Q-stage causal range, three consumers for causal d 64)."""
    from cute_fa.hopper import support as sm90

    return sorted({
        SHORT_SEQLEN_HINT, LONG_SEQLEN_HINT, sm90.SM90_FWD_PERSISTENT_MAX_SEQLEN,
        sm90.SM90_FWD_PERSISTENT_MAX_SEQLEN_CAUSAL, *sm90.SM90_FWD_PERSISTENT_ONE_Q_STAGE_CAUSAL,
        sm90.SM90_FWD_3WG_CAUSAL_MIN_SEQLEN,
    })  # fmt: skip


def _seqlen_kind(hint: int) -> str:
    return {SHORT_SEQLEN_HINT: "short", LONG_SEQLEN_HINT: "long"}.get(hint, f"{hint}-row")


def _fwd_config(arch: str, target: str, request, seqlen_q: int | None, table=None):
    """(config, "") of the forward kernel ``arch`` asks for on ``target``, else (None, why);
    ``table``: the GPU's tuned table, when compiling for it."""
    from cute_fa.config import capability_for_target
    from cute_fa.planning import SM80_FWD, SM90_FWD, fwd_config_for_target, fwd_plan

    if arch == "auto":
        try:
            return fwd_plan(capability_for_target(target), request, seqlen_q, table)[1], ""
        except (NotImplementedError, ValueError) as e:  # (ValueError: an unknown target)
            return None, str(e)
    spec = {"sm80": SM80_FWD, "sm90": SM90_FWD}[arch]
    return fwd_config_for_target(spec, target, request, seqlen_q, table)


def _local_tuned_table(target: str):
    """This machine's GPU's tuned table when ``target`` is that GPU's target, else None: a
    precompile for the local GPU builds the kernels its calls will ask for."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from cute_fa.config import target_for_capability
        from cute_fa.device import tuned_table

        device = torch.device("cuda", torch.cuda.current_device())
        if target_for_capability(*torch.cuda.get_device_capability(device)) != target:
            return None
        return tuned_table(device)
    except Exception:  # noqa: BLE001 - no usable GPU: built-in defaults
        return None


def _bwd_tasks(arch: str, target: str, request, table=None) -> tuple[list, str]:
    """(tasks, "") of the backward's main, preprocess (with and without dLSE) and postprocess
    kernels of ``request`` on ``target``, else ([], why)."""
    from cute_fa.compile import PrecompileTask
    from cute_fa.planning import bwd_config, post_config, pre_config

    flags = {f: getattr(request, f) for f in BWD_REQUEST_FLAGS}
    try:
        config = bwd_config(
            target, request.dtype, request.head_dim, request.head_dim_v,
            arch=None if arch == "auto" else int(arch[2:]), table=table, **flags,
        )  # fmt: skip
    except NotImplementedError as e:
        return [], str(e)
    tasks = [PrecompileTask("bwd", config)]
    tasks += [PrecompileTask("bwd-pre", pre_config(config, dlse)) for dlse in (False, True)]
    tasks.append(PrecompileTask("bwd-post", post_config(config)))
    return tasks, ""


# FwdRequest fields that are backward flags of the same name.
BWD_REQUEST_FLAGS = (
    "causal", "local", "has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k",
)  # fmt: skip


def precompile_configs(
    arch: str, target: str, head_dims, dtypes, variants, mode: str = "fwd", table=None
) -> list:
    """(task or None, label, reason) for every kernel of every combination (``mode``: the
    forward's, the backward's or both); None where unsupported. A kernel that several
    combinations share (the backward's pre- and postprocess) is listed once. ``table``: the
    tuned table whose choices planning applies (the local GPU's)."""
    from cute_fa.compile import PrecompileTask
    from cute_fa.planning import FwdRequest

    plans, seen = [], set()

    def add(task, label, reason=""):
        if task is None or task not in seen:
            plans.append((task, label, reason))
            if task is not None:
                seen.add(task)

    for dtype in dtypes:
        for d in head_dims:
            for variant in variants:
                request = FwdRequest(
                    dtype=dtype, head_dim=d, head_dim_v=d, **_variant_flags(variant)
                )
                label = f"{dtype} d{d} {variant}"
                if mode in ("fwd", "both"):
                    config, reason = _fwd_config(arch, target, request, None, table)
                    add(PrecompileTask("fwd", config) if config else None, f"fwd {label}", reason)
                    # What dispatch picks only for some query lengths (the sm90 d64 causal
                    # tile, the persistent grid for SM90_SMS SMs: an H100 SXM or H200; another
                    # count compiles its own at the first call).
                    for hint in seqlen_hints():
                        other, _ = _fwd_config(arch, target, request, hint, table)
                        if other is not None and other != config:
                            add(PrecompileTask("fwd", other),
                                f"fwd {label} ({_seqlen_kind(hint)} sequences)")  # fmt: skip
                if mode in ("bwd", "both"):
                    tasks, reason = _bwd_tasks(arch, target, request, table)
                    if not tasks:
                        add(None, f"bwd {label}", reason)
                    for task in tasks:
                        add(task, f"{task.kind} {label}")
    return plans


def cmd_precompile(args: argparse.Namespace) -> int:
    from cute_fa.cache import disk_cache_enabled
    from cute_fa.compile import fwd_cache

    if not disk_cache_enabled():
        print("precompile: the disk cache is off (CUTE_FA_CACHE=0)", file=sys.stderr)
        return 2
    target = args.target or _default_target(args.arch)
    plans = precompile_configs(
        args.arch, target, args.head_dims, args.dtypes, args.variants, args.mode,
        _local_tuned_table(target),
    )  # fmt: skip
    todo = [(task, label) for task, label, _ in plans if task is not None]
    for task, label, reason in plans:
        if task is None:
            print(f"skip  {label}: {reason}")
    print(
        f"precompile: {len(todo)} kernels ({args.mode}, {args.arch}) for {target} into "
        f"{fwd_cache().directory}",
        flush=True,
    )
    return 1 if precompile(todo, args.jobs) else 0


def precompile(todo: list, jobs: int, worker: Callable | None = None) -> int:
    """Put every ``(task, label)`` of ``todo`` into the disk cache, in ``jobs`` processes;
    returns how many failed. ``worker(task) -> (status, seconds)`` (default
    ``cute_fa.cache.precompile_task``, for ``PrecompileTask`` items) must be importable by
    name: spawned workers unpickle it.

    When a worker process dies (the pool breaks: killed for memory, or a crash), the configs
    left unfinished are compiled again one at a time, each in a fresh process, so that a config
    that kills its process fails alone.
    """
    if worker is None:
        from cute_fa.compile import precompile_task as worker
    jobs = max(1, min(jobs, len(todo)))
    if jobs == 1:
        return sum(_report(label, config, partial(worker, config)) for config, label in todo)
    failed, unfinished = _precompile_pool(todo, jobs, worker)
    if unfinished:
        print(
            f"precompile: a worker process died (killed for memory, or crashed); compiling the "
            f"{len(unfinished)} unfinished configs one at a time, each in a fresh process "
            f"(a lower --jobs uses less memory)",
            flush=True,
        )
        for item in unfinished:
            failed += _precompile_pool([item], 1, worker, retry_broken=False)[0]
    return failed


def _precompile_pool(
    todo: list, jobs: int, worker: Callable, retry_broken: bool = True
) -> tuple[int, list]:
    """(failed, unfinished) of ``todo`` run in a pool of ``jobs`` spawned processes. A config
    whose worker process died is unfinished, or failed when ``retry_broken`` is False."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    failed, unfinished = 0, []
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [(config, label, pool.submit(worker, config)) for config, label in todo]
        for config, label, future in futures:
            if retry_broken and isinstance(future.exception(), BrokenProcessPool):
                unfinished.append((config, label))
            else:
                failed += _report(label, config, future.result)
    return failed, unfinished


def _report(label: str, config, result: Callable) -> int:
    from concurrent.futures.process import BrokenProcessPool

    try:
        status, seconds = result()
    except BrokenProcessPool:
        print(f"FAIL  {label} ({config.name}): its worker process died", flush=True)
        return 1
    except Exception as e:
        print(f"FAIL  {label} ({config.name}): {type(e).__name__}: {e}", flush=True)
        return 1
    print(f"{status:8s} {label} ({config.name}) {seconds:.1f} s", flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# demo


def _demo_gpu() -> int:
    import torch

    from cute_fa import flash_attn_func, flash_attn_varlen_func
    from cute_fa.planning import capability_name
    from cute_fa.reference import attention_ref, attention_varlen_ref, check_close

    cap = torch.cuda.get_device_capability()
    print(f"demo on {torch.cuda.get_device_name()} ({capability_name(cap)})")
    torch.manual_seed(0)
    cases = [
        dict(b=2, sq=1024, sk=1024, h=8, hk=8, d=64, causal=False),
        dict(b=2, sq=1024, sk=1024, h=8, hk=2, d=128, causal=True),
        dict(b=1, sq=333, sk=777, h=4, hk=4, d=256, causal=True),
        dict(b=2, sq=500, sk=500, h=8, hk=8, d=128, causal=False, window=(128, 0)),
    ]
    failed = 0
    for case in cases:
        window = case.get("window", (None, None))
        q = torch.randn(
            case["b"], case["sq"], case["h"], case["d"], device="cuda", dtype=torch.bfloat16
        )
        k, v = (
            torch.randn(
                case["b"], case["sk"], case["hk"], case["d"], device="cuda", dtype=torch.bfloat16
            )
            for _ in range(2)
        )
        kw = dict(causal=case["causal"], window_size=window)
        out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
        out_ref, lse_ref = attention_ref(q, k, v, upcast=True, **kw)
        out_pt, lse_pt = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
        failed += _demo_check(str(case), out, lse, out_ref, lse_ref, out_pt, lse_pt, check_close)
    lens_q, lens_k = [17, 300, 0, 129], [300, 17, 5, 129]
    cu_q = torch.tensor(
        [0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    cu_k = torch.tensor(
        [0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True
    )
    out_ref, lse_ref = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=True)
    out_pt, lse_pt = attention_varlen_ref(
        q, k, v, cu_q, cu_k, causal=True, upcast=False, reorder_ops=True
    )
    label = f"varlen lens_q={lens_q} lens_k={lens_k} causal"
    failed += _demo_check(label, out, lse, out_ref, lse_ref, out_pt, lse_pt, check_close)
    print("demo:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


def _demo_check(label, out, lse, out_ref, lse_ref, out_pt, lse_pt, check_close) -> int:
    err = float((out.float() - out_ref).abs().max()) if out.numel() else 0.0
    try:
        check_close(out, out_ref, out_pt, name="out")
        check_close(lse, lse_ref, lse_pt, atol=1e-4, name="lse")
    except AssertionError as e:
        print(f"FAIL  {label}: max|out - ref| {err:.2e}\n      {e}")
        return 1
    print(f"PASS  {label}: max|out - ref| {err:.2e}")
    return 0


def _demo_cpu(targets: list[str], head_dims: list[int]) -> int:
    from cute_fa.config import capability_for_target
    from cute_fa.planning import FwdRequest, fwd_plan

    from .sass import compile_and_inspect

    print(
        "no CUDA GPU here: cross-compiling the forward kernel each target dispatches to (bf16) "
        "and reading the cubins"
    )
    ops = ("HMMA", "HGMMA", "UTCHMMA", "LDSM", "LDGSTS", "UTMALDG", "MUFU", "FFMA")
    header = [
        "target",
        "kernel",
        "d",
        "causal",
        "tile",
        "regs",
        "smem",
        "stack",
        "LDL+STL",
        *ops,
        "compile s",
    ]
    rows, failed = [], 0
    for target in targets:
        for d in head_dims:
            for causal in (False, True):
                t0 = time.perf_counter()
                try:
                    request = FwdRequest(dtype="bf16", head_dim=d, head_dim_v=d, causal=causal)
                    _, config = fwd_plan(capability_for_target(target), request)
                    info = compile_and_inspect(config)
                except Exception as e:
                    failed += 1
                    print(f"FAIL  {target} d{d} causal={causal}: {type(e).__name__}: {e}")
                    continue
                counts = info["sass_counts"]
                rows.append(
                    [
                        target, f"sm{config.arch}", str(d), str(int(causal)),
                        f"{config.tile_m}x{config.tile_n}w{config.num_warps}",
                        str(info["regs"]), f"{info['smem_tiles'] // 1024}K", str(info["stack"]),
                        str(info["spills"]), *(str(counts[op]) for op in ops),
                        f"{time.perf_counter() - t0:.1f}",
                    ]
                )  # fmt: skip
                print("  ".join(rows[-1]), flush=True)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for j, row in enumerate([header, *rows]):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print("\nsmem: Q/K/V tile bytes (dynamic shared memory); LDL+STL: local-memory spill traffic")
    return 1 if failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    if torch.cuda.is_available() and not args.cpu:
        return _demo_gpu()
    return _demo_cpu(args.targets, args.head_dims)


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
