"""``python -m cute_fa precompile``: the kernels a target runs, compiled into the disk cache
(in parallel with ``--jobs``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
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
