"""``python -m cute_fa demo``: on a GPU, attention at a few shapes against the fp32 reference;
without one, the forward kernel of each target cross-compiled and inspected."""

from __future__ import annotations

import argparse
import time


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


def _demo_cpu(targets: list[str], head_dims: list[int], mode: str = "fwd") -> int:
    from cute_fa.config import capability_for_target
    from cute_fa.planning import FwdRequest, bwd_config, fwd_plan

    from .sass import compile_and_inspect

    what = {"fwd": "forward kernel", "bwd": "backward main kernel",
            "both": "forward and backward main kernels"}[mode]  # fmt: skip
    print(
        f"no CUDA GPU here: cross-compiling the {what} each target dispatches to (bf16) and "
        f"reading the cubins"
    )
    directions = ("fwd", "bwd") if mode == "both" else (mode,)
    ops = ("HMMA", "HGMMA", "UTCHMMA", "LDSM", "LDGSTS", "UTMALDG", "MUFU", "FFMA")
    header = [
        "target",
        "dir",
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
    cases = [(t, way, d, c) for t in targets for way in directions for d in head_dims
             for c in (False, True)]  # fmt: skip
    for target, way, d, causal in cases:
        t0 = time.perf_counter()
        try:
            if way == "fwd":
                request = FwdRequest(dtype="bf16", head_dim=d, head_dim_v=d, causal=causal)
                _, config = fwd_plan(capability_for_target(target), request)
            else:
                config = bwd_config(target, "bf16", d, d, causal=causal)
            info = compile_and_inspect(config)
        except Exception as e:
            failed += 1
            print(f"FAIL  {target} {way} d{d} causal={causal}: {type(e).__name__}: {e}")
            continue
        counts = info["sass_counts"]
        rows.append(
            [
                target, way, f"sm{config.arch}", str(d), str(int(causal)),
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
    return _demo_cpu(args.targets, args.head_dims, args.mode)
