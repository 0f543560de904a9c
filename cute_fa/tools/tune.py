"""``python -m cute_fa tune``: time tuning candidates on this GPU and (``--write``) keep the
winners in its tuned table, which planning then uses (``cute_fa/tuned.py``).

* ``--arch 80`` (default): the sm80 forward (``--mode bwd``: backward) over candidate tiles.
  For every (d, seqlen, causal) it compiles each candidate the kernel implements, checks it
  against the fp32 reference on a small ragged problem, times it with the benchmark's method
  (inputs rotated past L2) and prints TFLOPs beside SDPA FLASH's. The backward runs each
  candidate through the real backward (a ``cute_fa.tuning(sm80_bwd=...)`` override, and
  ``CUTE_FA_BWD_ARCH=80`` so that Hopper runs the sm80 kernel too), dQ, dK, dV checked first.
* ``--arch 90``: the sm90 forward's tuning fields (``sm90_fwd_variants``): per head dim one
  benchmark run (``cute_fa.tools.bench``) with the default, each variant (a typed override) as
  a peer in the same process, and SDPA CUDNN; the first variant is the default under another
  name, so the run shows its own noise floor.

``--write``: per head dim and causality (a table entry applies to every query length of that
class), the candidate with the best geometric mean of TFLOPs over the timed lengths is written
to this GPU's tuned table when it beats the built-in default by at least ``WRITE_MARGIN`` (run
to run noise on the H200 is a few percent); the default is kept otherwise. ``--show`` prints
the tuning in force per family and problem class and where each value comes from (built-in,
tuned table, override); ``--reset`` removes this GPU's table.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from cute_fa import tuned
from cute_fa.config import BwdConfig, FwdConfig, Tiles

# A candidate replaces the built-in default in the tuned table only when its geometric mean of
# TFLOPs over the timed lengths is at least this ratio of the default's.
WRITE_MARGIN = 1.02

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
    from cute_fa.ampere.support import bwd_can_implement

    tiles = []
    for tile_m, tile_n, warps in BWD_CANDIDATES.get(head_dim, []):
        config = BwdConfig(
            arch=80, target=target, dtype="bf16", head_dim=head_dim, head_dim_v=head_dim,
            tuning=Tiles(tile_m, tile_n, warps), causal=causal,
        )  # fmt: skip
        if bwd_can_implement(config)[0]:
            tiles.append((tile_m, tile_n, warps))
    return tiles


# Key blocks of the sm90 forward worth timing against the default, by head dim.
SM90_FWD_TILE_N_ALTERNATIVES = {128: (176,), 192: (96,), 256: (80,)}


def sm90_fwd_variants(head_dim: int) -> list[str]:
    """Benchmark peers (``cute_fa`` and ``cute_fa:sm90_fwd.FIELD=VALUE`` variants) of the sm90
    forward's tuning at ``head_dim``, each setting a field to the opposite of (or an
    alternative to) its default. The first variant, ``CUTE_FA_FWD_ARCH=90``, changes nothing
    on Hopper: the default under another name, the run's noise floor."""
    from cute_fa import settings
    from cute_fa.hopper import support as sm90

    defer = "false" if head_dim in sm90.SM90_FWD_DEFER_RESCALE_DEFAULT else "true"
    threshold = "0" if sm90.SM90_FWD_RESCALE_THRESHOLD_DEFAULT.get(head_dim) else "8"
    f = "sm90_fwd."
    variants = [
        f"{settings.FWD_ARCH}=90",
        f"{f}defer_rescale={defer}",
        f"{f}rescale_threshold={threshold}",
        f"{f}num_ctas=0",
        f"{f}num_ctas=1",
        f"{f}pingpong=false",
        f"{f}overlap=false",
        f"{f}tma_store=true",
    ]
    if head_dim in sm90.SM90_FWD_PINGPONG_OFF_DEFAULT:  # off by default for some calls
        variants.append(f"{f}pingpong=true")
    if head_dim in sm90.SM90_FWD_OVERLAP_OFF_DEFAULT:  # likewise the overlap
        variants.append(f"{f}overlap=true")
    three = f"{f}tile_m={sm90.SM90_FWD_TILE_M_3WG}"
    max_keys = sm90.SM90_FWD_3WG_MAX_TILE_N.get(head_dim, 0)
    if max_keys >= sm90.SM90_FWD_TILE_N[head_dim]:  # three consumers at the default keys
        variants += [f"{f}tile_m={sm90.SM90_FWD_TILE_M}", three, f"{three}:{f}num_ctas=1"]
    elif max_keys:  # three consumers hold fewer keys than the default (d 128: 64 or 80)
        variants += [f"{three}:{f}tile_n={n}" for n in (64, max_keys)]
    variants += [f"{f}tile_n={n}" for n in SM90_FWD_TILE_N_ALTERNATIVES.get(head_dim, ())]
    return ["cute_fa"] + [f"cute_fa:{v}" for v in variants]


def variant_fields(peer: str) -> dict | None:
    """The sm90_fwd fields a ``sm90_fwd_variants`` peer sets (None: not a typed variant)."""
    from .bench import split_impl

    fields = {}
    for name, value in split_impl(peer)[1]:
        if not name.startswith("sm90_fwd."):
            return None
        _, field_, parsed = tuned.parse_assignment(f"{name}={value}")
        fields[field_] = parsed
    return fields


def run_sm90_fwd(args: argparse.Namespace) -> int:
    """One benchmark run per head dim: the default, the variants of ``sm90_fwd_variants`` and
    SDPA CUDNN, shape by shape in one process; ``--write`` keeps the winners."""
    import os

    from . import bench

    status = 0
    winners: dict[str, dict] = {}
    for d in args.d:
        variants = sm90_fwd_variants(d)
        peers = ",".join([*variants, "cudnn"])
        argv = ["--d", str(d), "--seqlen", ",".join(map(str, args.seqlen)),
                "--causal", ",".join(map(str, args.causal)), "--peers", peers,
                "--warmup", str(args.warmup), "--rep", str(args.rep),
                "--rounds", str(args.rounds), "--out", os.path.join(args.out, f"d{d}")]  # fmt: skip
        results: list = []
        status = bench.main(argv, results_out=results) or status
        for causal in args.causal:
            scores = {}
            for peer in variants:
                fields = {} if peer == "cute_fa" else variant_fields(peer)
                tflops = [r.tflops for r in results if r.impl == peer
                          and bool(r.case.causal) == bool(causal)]  # fmt: skip
                if fields is not None and tflops and all(t for t in tflops):
                    scores[peer] = (geomean(tflops), fields)
            winner = pick_winner(scores, "cute_fa")
            if winner is not None:
                winners[tuned.problem_class(d, d, bool(causal))] = winner
    if args.write:
        timed = {tuned.problem_class(d, d, bool(c)) for d in args.d for c in args.causal}
        write_winners("sm90_fwd", winners, timed)
    return status


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def pick_winner(scores: dict, default: str) -> dict | None:
    """The fields of the best-scoring candidate when it beats ``default``'s score by
    WRITE_MARGIN, else None (keep the default). ``scores``: name -> (score, fields)."""
    if default not in scores:
        return None
    best = max(scores, key=lambda name: scores[name][0])
    if best == default or scores[best][0] < WRITE_MARGIN * scores[default][0]:
        return None
    return scores[best][1]


def candidate_configs(head_dim: int, target: str, causal: bool, dtype: str = "bf16") -> list:
    """FwdConfigs of the candidates the sm80 kernel implements on ``target``."""
    from cute_fa.ampere.support import fwd_can_implement

    configs = []
    for tile_m, tile_n, warps in CANDIDATES.get(head_dim, []):
        config = FwdConfig(
            arch=80, target=target, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim,
            tuning=Tiles(tile_m, tile_n, warps), causal=causal,
        )  # fmt: skip
        if fwd_can_implement(config)[0]:
            configs.append(config)
    return configs


def _check(kernel, config, torch) -> float:
    """Max |out - ref| of one candidate on a small problem with ragged lengths; raises on NaN or
    on an error past the DESIGN.md tolerance."""
    from cute_fa.reference import attention_ref, check_close

    b, sq, sk, h, d = 2, 333, 517, 4, config.head_dim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for s in (sq, sk, sk))
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(b, h, sq, device="cuda", dtype=torch.float32)
    kernel(q, k, v, out, lse, d**-0.5, 0.0, 0, 0, sq, None, None, None, None)
    out_ref, _ = attention_ref(q, k, v, causal=config.causal)
    out_pt, _ = attention_ref(q, k, v, causal=config.causal, upcast=False)
    check_close(out, out_ref, out_pt)
    return float((out.float() - out_ref.float()).abs().max())


def run(head_dims, seqlens, causals, warmup_ms: float, rep_ms: float) -> list[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cute_fa.compile import fwd_cache
    from cute_fa.config import target_for_capability

    from .bench import Rotation, attention_flops, median_ms, num_input_sets

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
    on NaN or past the DESIGN.md tolerance (the tile comes from the caller's override)."""
    import cute_fa
    from cute_fa.reference import attention_ref, check_close

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

    import cute_fa
    from cute_fa import settings
    from cute_fa.config import target_for_capability

    from .bench import Impl, Rotation, attention_flops, env_settings, median_ms, num_input_sets

    target = target_for_capability(*torch.cuda.get_device_capability())
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    rows = []
    # The sm80 kernel even where the sm90 one would run.
    with env_settings({settings.BWD_ARCH: "80"}):
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
                        with cute_fa.tuning(sm80_bwd=Tiles(*tile)):
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


def tile_winners(rows: list[dict], default_tile) -> dict[str, dict]:
    """Per problem class, the fields of the tile that beats the built-in default (``default_tile``
    (d, causal) -> Tiles) by WRITE_MARGIN in geometric mean over the timed lengths."""
    winners = {}
    classes = sorted({(row["d"], row["causal"]) for row in rows})
    for d, causal in classes:
        mine = [row for row in rows if (row["d"], row["causal"]) == (d, causal)]
        labels = {key for row in mine for key in row if "x" in key and not key.endswith(" err")}
        scores = {}
        for label in labels:
            values = [row.get(label) for row in mine]
            if all(values):
                tile_m, rest = label.split("x")
                tile_n, warps = rest.split("w")
                fields = {"tile_m": int(tile_m), "tile_n": int(tile_n), "num_warps": int(warps)}
                scores[label] = (geomean(values), fields)
        winner = pick_winner(scores, default_tile(d, bool(causal)).label)
        if winner is not None:
            winners[tuned.problem_class(d, d, bool(causal))] = winner
    return winners


def _this_gpu_key() -> tuned.TableKey:
    import torch

    from cute_fa.device import table_key

    return table_key(torch.device("cuda", torch.cuda.current_device()))


def write_winners(family: str, winners: dict[str, dict], timed_classes: set[str]) -> None:
    """Merge ``winners`` (problem class -> fields) of ``family`` into this GPU's tuned table:
    the classes timed now (``timed_classes``) replace their old entries (a class whose default
    won loses its entry); other families and classes stay."""
    key = _this_gpu_key()
    old = tuned.load_table(key)
    entries = {f: dict(v) for f, v in (old.entries if old is not None else {}).items()}
    timed = entries.setdefault(family, {})
    for problem in list(timed):
        if problem in winners or problem in timed_classes:
            timed.pop(problem)
    timed.update(winners)
    path = tuned.write_table(tuned.Table(key, entries))
    print(f"wrote {path}: {family} " + (", ".join(
        f"{problem} {fields}" for problem, fields in sorted(winners.items())
    ) or "(every timed class keeps its built-in default)"))  # fmt: skip


def show(head_dims: Sequence[int]) -> int:
    """Print the tuning in force on this GPU per family and problem class, each field's source."""
    import torch

    from cute_fa.config import sm80_bwd_tile, sm80_fwd_tile, target_for_capability
    from cute_fa.hopper import support as sm90

    key = _this_gpu_key()
    table = tuned.load_table(key)
    target = target_for_capability(*torch.cuda.get_device_capability())
    where = table.path if table is not None else f"none at {tuned.table_path(key)}"
    print(f"GPU {key.gpu} ({key.sm_count} SMs, driver {key.driver}, DSL {key.dsl}, "
          f"cute_fa {key.cute_fa}); tuned table: {where}")  # fmt: skip
    for d in head_dims:
        for causal in (False, True):
            problem = tuned.problem_class(d, d, causal)
            defaults = {}
            try:
                defaults["sm80_fwd"] = sm80_fwd_tile(d, target, causal)
                defaults["sm80_bwd"] = sm80_bwd_tile(d, target)
            except NotImplementedError:
                pass
            if target.startswith("sm_90") and d in sm90.SM90_FWD_TILE_N:
                base = FwdConfig(
                    arch=90,
                    target=target,
                    dtype="bf16",
                    head_dim=d,
                    head_dim_v=d,
                    tuning=sm90.Sm90FwdTuning(),
                    causal=causal,
                )
                defaults["sm90_fwd"] = sm90.fwd_config(base).tuning
                defaults["sm90_bwd"] = sm90.bwd_default_tuning(d)
            for family, default in defaults.items():
                fields = tuned.sources(family, problem, default, table)
                cells = [f"{name}={value} ({src})" if src != "built-in" else f"{name}={value}"
                         for name, (value, src) in fields.items()]  # fmt: skip
                print(f"  {family:9} {problem:12} " + " ".join(cells))
    print("(unmarked: built-in default; sm90_fwd defaults shown without a query length, which "
          "also picks tile_m and the persistent grid)")  # fmt: skip
    return 0


def _kernel_call(kernel, q, k, v, out, lse, seqlen: int):
    scale = q.shape[-1] ** -0.5
    return lambda: kernel(q, k, v, out, lse, scale, 0.0, 0, 0, seqlen, None, None, None, None)


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
        "--write",
        action="store_true",
        help="write the winners to this GPU's tuned table, which planning then uses",
    )
    parser.add_argument(
        "--show", action="store_true", help="print the tuning in force and where it comes from"
    )
    parser.add_argument("--reset", action="store_true", help="remove this GPU's tuned table")
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
            "--arch 90 tunes the forward; time the sm90 backward's tuning as a benchmark peer: "
            "python -m cute_fa bench --mode bwd --peers cute_fa,cute_fa:sm90_bwd.q_stages=3,cudnn"
        )
    if args.rounds < 1 or (args.rounds > 1 and args.arch != 90):
        parser.error("--rounds takes a positive count, and more than 1 only with --arch 90")
    if args.write and (args.show or args.reset):
        parser.error("--write times and writes; --show and --reset only read or remove")
    import torch

    if not torch.cuda.is_available():
        print("cute_fa tune: needs a CUDA GPU (it times kernels and keys tables by GPU)")
        return 1
    if args.reset:
        removed = tuned.reset_table(_this_gpu_key())
        print(f"removed {tuned.table_path(_this_gpu_key())}" if removed else "no tuned table")
        return 0
    if args.show:
        return show(args.d)
    if args.arch == 90:
        return run_sm90_fwd(args)
    from cute_fa.config import sm80_bwd_tile, sm80_fwd_tile, target_for_capability

    target = target_for_capability(*torch.cuda.get_device_capability())
    causals = [bool(c) for c in args.causal]
    if args.mode == "bwd":
        rows = run_bwd(args.d, args.seqlen, causals, args.warmup, args.rep)
        winners = tile_winners(rows, lambda d, causal: sm80_bwd_tile(d, target))
    else:
        rows = run(args.d, args.seqlen, causals, args.warmup, args.rep)
        winners = tile_winners(rows, lambda d, causal: sm80_fwd_tile(d, target, causal))
    if args.write:
        timed = {tuned.problem_class(d, d, c) for d in args.d for c in causals}
        write_winners(f"sm80_{args.mode}", winners, timed)
    else:
        print("winners over the default (--write keeps them): "
              + (str(winners) if winners else "none; the built-in defaults stand"))  # fmt: skip
    return 0
