"""``python -m cute_fa tune``: time the sm80 forward (or, ``--mode bwd``, backward) kernel over
candidate tile shapes.

The tuned table in ``cute_fa/config.py`` (``SM80_FWD_TILES``) records, per head dim, the tile
that won such a sweep on the H200 and the numbers that decided it. This command reruns the sweep
on the GPU at hand, with SDPA FLASH (the CUDA FlashAttention-2) in the same process: for every
(d, seqlen, causal) of the request it compiles each candidate ``(tile_m, tile_n, num_warps)``
that the kernel can implement, checks it against the fp32 reference on a small problem, times
it with the benchmark's method (``cute_fa.bench.median_ms``, inputs rotated past L2) and prints
TFLOPs per candidate. Nothing is written back: copy a winner into the table by hand, with its
reason.

``--arch 90`` times the sm90 forward's tuning switches instead (``sm90_fwd_variants``): per
head dim, one benchmark run (``cute_fa.bench``) with the default, each switch set against its
default as a peer in the same process, and SDPA CUDNN; the first variant is the default config
under another name, so the run shows its own noise floor. The defaults and their measurements
are in ``hopper/support.py``; the table, CSV and plot go to ``--out``/d<d>.

``--mode bwd`` does the same for the sm80 backward (``SM80_BWD_TILES`` and
``SM80_BWD_TILES_LARGE_SMEM``): each candidate runs through the real backward
(``CUTE_FA_BWD_TILE`` set for the call, and ``CUTE_FA_BWD_ARCH=80`` so that Hopper runs it
too), its dQ, dK, dV are checked against fp32 autograd of the reference on a small problem
first, and the whole backward is timed beside SDPA FLASH's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# (tile_m, tile_n, num_warps) candidates per head dim.
CANDIDATES = {
    64: [(128, 64, 4), (128, 128, 4), (128, 128, 8), (64, 128, 4)],
    96: [(128, 64, 4), (128, 64, 8), (64, 64, 4)],
    128: [(128, 64, 4), (128, 64, 8), (64, 128, 4), (128, 128, 8), (64, 64, 4)],
    192: [(128, 64, 8), (64, 64, 4), (128, 32, 4)],
    256: [(128, 64, 8), (64, 64, 4), (64, 32, 4)],
}


# Backward candidates per head dim: dK and dV of tile_n keys live in registers (2 * tile_n * d
# fp32 over the CTA), which bounds tile_n * d for 8 warps.
BWD_CANDIDATES = {
    64: [(64, 128, 8), (128, 128, 8), (64, 64, 4)],
    96: [(64, 128, 8), (64, 64, 8), (64, 64, 4)],
    128: [(64, 128, 8), (64, 64, 8), (64, 64, 4), (128, 64, 8)],
    192: [(64, 64, 8)],
    256: [(64, 64, 8), (32, 64, 8)],
}


def bwd_candidate_tiles(head_dim: int, target: str, causal: bool) -> list[tuple[int, int, int]]:
    """The backward candidates the sm80 kernel implements on ``target``."""
    from .ampere.support import bwd_can_implement
    from .config import BwdConfig

    tiles = []
    for tile_m, tile_n, warps in BWD_CANDIDATES.get(head_dim, []):
        config = BwdConfig(
            arch=80, target=target, dtype="bf16", head_dim=head_dim, head_dim_v=head_dim,
            tile_m=tile_m, tile_n=tile_n, num_warps=warps, causal=causal,
        )  # fmt: skip
        if bwd_can_implement(config)[0]:
            tiles.append((tile_m, tile_n, warps))
    return tiles


# Key blocks of the sm90 forward worth timing against the default, by head dim.
SM90_FWD_TILE_N_ALTERNATIVES = {128: (176,), 192: (96,), 256: (80,)}


def sm90_fwd_variants(head_dim: int) -> list[str]:
    """Benchmark peers (``cute_fa`` and ``cute_fa:NAME=VALUE`` variants) of the sm90 forward's
    tuning switches at ``head_dim``, each setting the opposite of (or an alternative to) the
    default. The first variant, ``CUTE_FA_FWD_ARCH=90``, changes nothing on Hopper: the
    default config under another name, the run's noise floor."""
    from .config import SMEM_CAPACITY, FwdConfig
    from .dispatch import FWD_ARCH_ENV
    from .hopper import support as sm90

    defer = "0" if head_dim in sm90.SM90_FWD_DEFER_RESCALE_DEFAULT else "1"
    threshold = "0" if sm90.SM90_FWD_RESCALE_THRESHOLD_DEFAULT.get(head_dim) else "8"
    settings = [
        f"{FWD_ARCH_ENV}=90",
        f"{sm90.DEFER_RESCALE_ENV}={defer}",
        f"{sm90.DEFER_RESCALE_ENV}=2",  # the vote-guarded wait: the design under either ptxas
        f"{sm90.RESCALE_THRESHOLD_ENV}={threshold}",
        f"{sm90.PERSISTENT_ENV}=0",
        f"{sm90.PERSISTENT_ENV}=1",
        f"{sm90.PERSISTENT_ENV}=2",  # the dynamic schedule
    ]
    settings += [f"{sm90.PINGPONG_ENV}=0", f"{sm90.OVERLAP_ENV}=0", f"{sm90.TMA_STORE_ENV}=1",
                 f"{sm90.P_SMEM_ENV}=1"]  # fmt: skip
    if head_dim <= sm90.SM90_FWD_Q_RMEM_MAX_D:
        settings.append(f"{sm90.Q_RMEM_ENV}=1")
    if head_dim in sm90.SM90_FWD_PINGPONG_OFF_DEFAULT:  # off by default for some calls
        settings.append(f"{sm90.PINGPONG_ENV}=1")
    if head_dim in sm90.SM90_FWD_OVERLAP_OFF_DEFAULT:  # likewise the overlap
        settings.append(f"{sm90.OVERLAP_ENV}=1")
    three = f"{sm90.TILE_M_ENV}={sm90.SM90_FWD_TILE_M_3WG}"
    max_keys = sm90.SM90_FWD_3WG_MAX_TILE_N.get(head_dim, 0)
    if max_keys >= sm90.SM90_FWD_TILE_N[head_dim]:  # three consumers at the default keys
        settings += [f"{sm90.TILE_M_ENV}={sm90.SM90_FWD_TILE_M}", three,
                     f"{three}:{sm90.PERSISTENT_ENV}=1"]  # fmt: skip
    elif max_keys:  # three consumers hold fewer keys than the default (d 128: 64 or 80)
        settings += [f"{three}:{sm90.TILE_N_ENV}={n}" for n in (64, max_keys)]
    config = FwdConfig(
        arch=90, target="sm_90a", dtype="bf16", head_dim=head_dim, head_dim_v=head_dim,
        tile_m=sm90.SM90_FWD_TILE_M, tile_n=sm90.SM90_FWD_TILE_N[head_dim],
        num_warps=sm90.SM90_FWD_WARPS,
    )  # fmt: skip
    if sm90.fwd_smem_bytes(config, 3) <= SMEM_CAPACITY["sm_90a"]:  # Q + 3 K/V stages fit
        settings.append(f"{sm90.KV_STAGES_ENV}=3")
    settings += [f"{sm90.TILE_N_ENV}={n}" for n in SM90_FWD_TILE_N_ALTERNATIVES.get(head_dim, ())]
    return ["cute_fa"] + [f"cute_fa:{s}" for s in settings]


def run_sm90_fwd(args: argparse.Namespace) -> int:
    """One benchmark run per head dim: the default, the variants of ``sm90_fwd_variants`` and
    SDPA CUDNN, shape by shape in one process."""
    import os

    from . import bench

    status = 0
    for d in args.d:
        peers = ",".join([*sm90_fwd_variants(d), "cudnn"])
        argv = ["--d", str(d), "--seqlen", ",".join(map(str, args.seqlen)),
                "--causal", ",".join(map(str, args.causal)), "--peers", peers,
                "--warmup", str(args.warmup), "--rep", str(args.rep),
                "--rounds", str(args.rounds), "--out", os.path.join(args.out, f"d{d}")]  # fmt: skip
        status = bench.main(argv) or status
    return status


def candidate_configs(head_dim: int, target: str, causal: bool, dtype: str = "bf16") -> list:
    """FwdConfigs of the candidates the sm80 kernel implements on ``target``."""
    from .ampere.support import fwd_can_implement
    from .config import FwdConfig

    configs = []
    for tile_m, tile_n, warps in CANDIDATES.get(head_dim, []):
        config = FwdConfig(
            arch=80, target=target, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim,
            tile_m=tile_m, tile_n=tile_n, num_warps=warps, causal=causal,
        )  # fmt: skip
        if fwd_can_implement(config)[0]:
            configs.append(config)
    return configs


def _check(kernel, config, torch) -> float:
    """Max |out - ref| of one candidate on a small problem with ragged lengths; raises on NaN or
    on an error past the DESIGN.md tolerance."""
    from .reference import attention_ref, check_close

    b, sq, sk, h, d = 2, 333, 517, 4, config.head_dim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for s in (sq, sk, sk))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(b, h, sq, device="cuda", dtype=torch.float32)
    kernel(q, k, v, out, lse, d**-0.5, 0.0, 0, 0, sq, None, None, None, None, None)
    out_ref, _ = attention_ref(q, k, v, causal=config.causal)
    out_pt, _ = attention_ref(q, k, v, causal=config.causal, upcast=False)
    check_close(out, out_ref, out_pt)
    return float((out.float() - out_ref.float()).abs().max())


def run(head_dims, seqlens, causals, warmup_ms: float, rep_ms: float) -> list[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .bench import Rotation, attention_flops, median_ms, num_input_sets
    from .cache import fwd_cache
    from .config import target_for_capability

    target = target_for_capability(*torch.cuda.get_device_capability())
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    rows = []
    for d in head_dims:
        for causal in causals:
            configs = candidate_configs(d, target, causal)
            kernels = {c: fwd_cache().get(c) for c in configs}
            checked = {c: _check(kernels[c], c, torch) for c in configs}
            for seqlen in seqlens:
                batch, heads = max(1, 16384 // seqlen), 2048 // d
                flops = attention_flops(batch, heads, seqlen, seqlen, d, causal)
                n_sets = num_input_sets(3 * batch * seqlen * heads * d * 2, l2)
                sets = [
                    tuple(
                        torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(3)
                    )
                    for _ in range(n_sets)
                ]
                outs = [torch.empty_like(q) for q, _, _ in sets]
                lses = [torch.empty(batch, heads, seqlen, device="cuda") for _ in sets]
                row = {"d": d, "seqlen": seqlen, "causal": int(causal)}
                for c in configs:
                    fns = [
                        _kernel_call(kernels[c], q, k, v, o, lse, seqlen)
                        for (q, k, v), o, lse in zip(sets, outs, lses, strict=True)
                    ]
                    ms = median_ms(Rotation(fns), warmup_ms, rep_ms)
                    label = f"{c.tile_m}x{c.tile_n}w{c.num_warps}"
                    row[label] = flops / ms / 1e9
                    row[label + " err"] = checked[c]
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fns = [_sdpa_call(torch, q, k, v, causal) for q, k, v in sets]
                    row["SDPA FLASH"] = flops / median_ms(Rotation(fns), warmup_ms, rep_ms) / 1e9
                rows.append(row)
                print(format_row(row), flush=True)
                del sets, outs, lses
    return rows


def _check_bwd(torch, d: int, causal: bool) -> float:
    """Max |dq - dq_ref| over dq, dk, dv of the backward on a small ragged problem (GQA); raises
    on NaN or past the DESIGN.md tolerance (the tile comes from CUTE_FA_BWD_TILE)."""
    import cute_fa

    from .reference import attention_ref, check_close

    q, k, v = (torch.randn(2, s, h, d, device="cuda", dtype=torch.bfloat16)
               for s, h in ((333, 4), (517, 2), (517, 2)))  # fmt: skip
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = cute_fa.flash_attn_func(*leaves, causal=causal)
    grads = torch.autograd.grad(out, leaves, dout)
    kr, vr = (t.repeat_interleave(2, dim=2) for t in (k, v))
    worst = 0.0
    refs = {}
    for upcast in (True, False):
        dtype = torch.float32 if upcast else torch.bfloat16
        ref_leaves = [t.to(dtype).requires_grad_() for t in (q, kr, vr)]
        o, _ = attention_ref(*ref_leaves, causal=causal, upcast=upcast, reorder_ops=not upcast)
        dq, dk, dv = torch.autograd.grad(o, ref_leaves, dout.to(dtype))
        refs[upcast] = (dq, dk.unflatten(2, (2, 2)).sum(3), dv.unflatten(2, (2, 2)).sum(3))
    for g, g_ref, g_pt, name in zip(grads, refs[True], refs[False], ("dq", "dk", "dv"),
                                    strict=True):  # fmt: skip
        check_close(g, g_ref, g_pt, name=name)
        worst = max(worst, float((g.float() - g_ref.float()).abs().max()))
    return worst


def run_bwd(head_dims, seqlens, causals, warmup_ms: float, rep_ms: float) -> list[dict]:
    import torch

    from .backward import BWD_ARCH_ENV
    from .bench import Impl, Rotation, attention_flops, env_settings, median_ms, num_input_sets
    from .config import BWD_TILE_ENV, target_for_capability

    target = target_for_capability(*torch.cuda.get_device_capability())
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    rows = []
    # The sm80 kernel even where the sm90 one would run.
    with env_settings({BWD_ARCH_ENV: "80"}):
        for d in head_dims:
            for causal in causals:
                tiles = bwd_candidate_tiles(d, target, causal)
                for seqlen in seqlens:
                    batch, heads = max(1, 16384 // seqlen), 2048 // d
                    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal, mode="bwd")
                    n_sets = num_input_sets(8 * batch * seqlen * heads * d * 2, l2)
                    sets = [
                        tuple(
                            torch.randn(batch, seqlen, heads, d, device="cuda",
                                        dtype=torch.bfloat16, requires_grad=True)
                            for _ in range(3)
                        )
                        for _ in range(n_sets)
                    ]  # fmt: skip
                    row = {"d": d, "seqlen": seqlen, "causal": int(causal)}
                    for tile in tiles:
                        label = f"{tile[0]}x{tile[1]}w{tile[2]}"
                        with env_settings({BWD_TILE_ENV: label}):
                            try:
                                row[label + " err"] = _check_bwd(torch, d, causal)
                            except Exception as e:  # noqa: BLE001 - a failing one is reported
                                print(f"d{d} causal={int(causal)} {label}: FAILED: {e}",
                                      flush=True)  # fmt: skip
                                continue
                            fns = [Impl("cute_fa").backward_fn(q, k, v, causal)
                                   for q, k, v in sets]  # fmt: skip
                            row[label] = flops / median_ms(Rotation(fns), warmup_ms, rep_ms) / 1e9
                    flash = Impl("flash")
                    with flash.context():
                        fns = [flash.backward_fn(q, k, v, causal) for q, k, v in sets]
                        ms = median_ms(Rotation(fns), warmup_ms, rep_ms)
                    row["SDPA FLASH"] = flops / ms / 1e9
                    rows.append(row)
                    print(format_row(row), flush=True)
                    del sets
    return rows


def _kernel_call(kernel, q, k, v, out, lse, seqlen: int):
    scale = q.shape[-1] ** -0.5
    return lambda: kernel(q, k, v, out, lse, scale, 0.0, 0, 0, seqlen, None, None, None, None, None)


def _sdpa_call(torch, q, k, v, causal: bool):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


def format_row(row: dict) -> str:
    cells = [f"d{row['d']} s{row['seqlen']} causal={row['causal']}:"]
    for key, value in row.items():
        if key in ("d", "seqlen", "causal") or key.endswith(" err"):
            continue
        cells.append(f"{key} {value:.0f}")
    return "  ".join(cells)


def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return out


def build_parser(prog: str = "python -m cute_fa tune") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Time the sm80 forward (--mode bwd: backward) over candidate tile shapes "
        "beside SDPA FLASH, or (--arch 90) the sm90 forward's tuning switches, each as a peer "
        "of the default beside SDPA CUDNN, in one process per head dim. Needs a GPU.",
    )
    parser.add_argument(
        "--mode", choices=("fwd", "bwd"), default="fwd", help="kernel to tune (default fwd)"
    )
    parser.add_argument(
        "--arch",
        type=int,
        choices=(80, 90),
        default=80,
        help="80: the sm80 kernel's tiles (default); 90: the sm90 forward's tuning switches, "
        "each as a peer of the default in one benchmark run (Hopper)",
    )
    parser.add_argument(
        "--out", default="tune-out", help="--arch 90: folder of the runs' tables and CSVs"
    )
    parser.add_argument("--d", type=_ints, default=[64, 128, 256], help="head dims")
    parser.add_argument("--seqlen", type=_ints, default=[2048, 8192], help="e.g. 2k,8k")
    parser.add_argument("--causal", type=_ints, default=[0, 1], help="'0', '1' or '0,1'")
    parser.add_argument("--warmup", type=float, default=25.0, help="ms of warm-up per case")
    parser.add_argument("--rep", type=float, default=100.0, help="ms of repetitions per case")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--arch 90: time each variant this many times in turns and report the median "
        "(the benchmark's --rounds)",
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m cute_fa tune") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.arch == 90 and args.mode == "bwd":
        parser.error(
            "--arch 90 tunes the forward; time the sm90 backward's switch as a benchmark peer: "
            "python -m cute_fa bench --mode bwd --peers "
            "cute_fa,cute_fa:CUTE_FA_SM90_BWD_Q_STAGES=3,cudnn"
        )
    if args.rounds < 1 or (args.rounds > 1 and args.arch != 90):
        parser.error("--rounds takes a positive count, and more than 1 only with --arch 90")
    import torch

    if not torch.cuda.is_available():
        print("cute_fa tune: needs a CUDA GPU (it times kernels)")
        return 1
    if args.arch == 90:
        return run_sm90_fwd(args)
    sweep = run_bwd if args.mode == "bwd" else run
    sweep(args.d, args.seqlen, [bool(c) for c in args.causal], args.warmup, args.rep)
    return 0
