"""``python -m cute_fa selftest``: the first-use self-check (``cute_fa.selftest``) of every
forward variant ``precompile`` would build for this machine's GPU, as a table.

Each variant is compiled (or loaded from the disk cache), launched on the check's two small
problems and compared with the fp32 reference on the GPU; the result is recorded as a first use
would record it, so calls after this find it. A variant already recorded shows its recorded
result unless ``--force``. Variants that dispatch checks at first use on this GPU (sm100
kernels; sm80 kernels on sm86 / sm89 / sm120) are marked; the others (run-verified) are checked
too: the command is a quick end-to-end test of the installation on any GPU.

Exit status: 0 all pass, 1 a variant failed (or did not compile), 2 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import _csv, _ints
    from .precompile import VARIANT_FLAGS

    p.add_argument("--head-dims", type=_ints, default=[64, 96, 128, 192, 256])
    p.add_argument("--dtypes", type=_csv, default=["bf16", "fp16"])
    p.add_argument(
        "--variants",
        type=_csv,
        default=["plain", "causal"],
        help="comma-separated; each a '+'-joined set of " + ", ".join(VARIANT_FLAGS),
    )
    p.add_argument("--force", action="store_true", help="check recorded variants again")


def _variants(args: argparse.Namespace, device) -> tuple[list, list]:
    """([(label, config)], [(label, reason)]): the forward variants precompile builds for the
    device's target (persistent grids sized for its SMs, as a call sizes them), and the rows
    no kernel implements."""
    from cute_fa.config import target_for_capability
    from cute_fa.device import capability, sm_count

    from .precompile import _local_tuned_table, precompile_configs

    target = target_for_capability(*capability(device))
    plans = precompile_configs(
        "auto", target, args.head_dims, args.dtypes, args.variants, "fwd",
        _local_tuned_table(target),
    )  # fmt: skip
    variants, skipped, seen = [], [], set()
    for task, label, reason in plans:
        if task is None:
            skipped.append((label, reason))
            continue
        config = task.config
        if getattr(config.tuning, "num_ctas", 0):
            config = config.with_tuning(num_ctas=sm_count(device))
        if config not in seen:
            seen.add(config)
            variants.append((label.removeprefix("fwd "), config))
    return variants, skipped


def cmd_selftest(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print(
            "selftest: no CUDA GPU here. The self-check launches each kernel on the GPU it "
            "checks; on a machine without one, `python -m cute_fa demo --cpu` cross-compiles "
            "the kernels and reads their SASS.",
            file=sys.stderr,
        )
        return 2
    from cute_fa import selftest
    from cute_fa.compile import fwd_cache

    device = torch.device("cuda", torch.cuda.current_device())
    key = selftest.record_key(device)
    variants, skipped = _variants(args, device)
    print(f"selftest on {key.gpu} (driver {key.driver}): {len(variants)} forward variants")
    rows, errors = [], []
    for label, config in variants:
        t0 = time.perf_counter()
        try:
            kernel = fwd_cache().get(config)
            t1 = time.perf_counter()
            result, ran = selftest.check(kernel, config, device, force=args.force)
        except Exception as e:  # noqa: BLE001 - a compile error is this variant's result
            t1 = time.perf_counter()
            result, ran = f"fail: {type(e).__name__}: {e}", False
        ok = result == selftest.PASS
        shown = ("pass" if ok else "FAIL") + ("" if ran else " (recorded)")
        if not ok:
            errors.append((config.name, result.removeprefix("fail: ")))
        first_use = "yes" if selftest.needs_check(config) else "no"
        rows.append([label, config.name, first_use, shown, f"{t1 - t0:.1f}",
                     f"{time.perf_counter() - t1:.2f}"])  # fmt: skip
        print("  ".join(rows[-1]), flush=True)
    header = ["variant", "kernel", "at first use", "result", "load s", "check s"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for j, row in enumerate([header, *rows]):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
    for label, reason in skipped:
        print(f"skip  {label}: {reason}")
    for name, error in errors:
        print(f"\nFAIL  {name}:\n      {error}")
    print(f"\nrecord: {selftest.record_path(key)}")
    print("at first use: whether dispatch checks the variant before its first call on this GPU")
    return 1 if errors else 0
