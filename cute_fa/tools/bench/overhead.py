"""``--overhead`` (host cost of a cached call) and ``--ceilings`` (matmul and copy ceilings)."""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from .common import DEVICE, bandwidth_tbps, impl_label, median_ms
from .grid import Case, ErrorLog, _torch_dtype, environment
from .impls import Impl

OVERHEAD_ROUNDS = 9


def run_overhead(args: argparse.Namespace) -> int:
    """Wall time per call of back-to-back cached calls on a tiny shape (host-bound)."""
    import torch

    dtype = _torch_dtype(args.dtype)
    d = args.d[0] if args.d_given else 64
    s = args.seqlen[0] if args.seqlen_given else 128
    causal = bool(args.causal[0]) if args.causal_given else False
    q, k, v = (torch.randn(1, s, 1, d, dtype=dtype, device=DEVICE) for _ in range(3))
    names = [n for n in ("cute_fa", "flash") if n in args.peers] or ["cute_fa", "flash"]
    print("# " + "  ".join(f"{k}={v}" for k, v in environment().items()))
    print(
        f"host overhead: b=1 s={s} h=1 d={d} causal={int(causal)}, {args.calls} back-to-back calls"
    )
    errors = ErrorLog()
    case = Case(d, s, causal, 1, 1)
    # Rounds interleave the implementations, so that a host that slows down or speeds up during
    # the run moves every column alike.
    fns, gpu_us, walls = {}, {}, {}
    for name in names:
        impl = Impl(name)
        try:
            with impl.context():
                fn = impl.forward_fn(q, k, v, causal)
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
                gpu_us[name] = median_ms(fn, args.warmup, args.rep) * 1e3
            fns[name] = (impl, fn)
            walls[name] = []
        except Exception as e:  # noqa: BLE001
            errors.report(name, case, "fwd", e)
    for _ in range(OVERHEAD_ROUNDS):
        for name, (impl, fn) in list(fns.items()):
            try:
                with impl.context():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    torch.cuda.synchronize()
                walls[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            except Exception as e:  # noqa: BLE001
                errors.report(name, case, "fwd", e)
                del fns[name]
    rows = []
    for name in names:
        if walls.get(name):
            rows.append(
                (impl_label(name), f"{statistics.median(walls[name]):.1f}",
                 f"{gpu_us[name]:.1f}")
            )  # fmt: skip
        else:
            rows.append((impl_label(name), "err", "err"))
    print()
    wall = f"wall us/call (median of {OVERHEAD_ROUNDS} rounds)"
    header = ("impl", wall, "GPU us/call (do_bench)")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for j, r in enumerate([header, *rows]):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    return 0


COPY_BYTES = 1 << 30


def copy_bandwidth(
    warmup_ms: float, rep_ms: float, nbytes: int = COPY_BYTES
) -> tuple[float, float]:
    """(TB/s, median ms) of a device-to-device copy of ``nbytes``, counting the bytes read and
    the bytes written (2 * nbytes); the buffers are freed on return."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    ms = median_ms(copy, warmup_ms, rep_ms)
    del copy, src, dst
    torch.cuda.empty_cache()
    return bandwidth_tbps(2 * nbytes, ms), ms


def run_ceilings(args: argparse.Namespace) -> int:
    """What this GPU reaches on plain work: a large dense matmul and a device-to-device copy."""
    import torch

    dtype = _torch_dtype(args.dtype)
    print("# " + "  ".join(f"{k}={v}" for k, v in environment().items()))
    n = 8192
    a, b = (torch.randn(n, n, dtype=dtype, device=DEVICE) for _ in range(2))
    ms = median_ms(lambda: torch.matmul(a, b), args.warmup, args.rep)
    matmul = 2 * n**3 / (ms * 1e-3) / 1e12
    bandwidth, ms_copy = copy_bandwidth(args.warmup, args.rep)
    print(f"{args.dtype} matmul {n}x{n}x{n}: {matmul:.1f} TFLOPs/s ({ms:.3f} ms)")
    print(f"device copy 1 GiB (read + write): {bandwidth:.2f} TB/s ({ms_copy:.3f} ms)")
    return 0
