"""Compile-only checks of the sm80 backward kernels on the CPU, with a SASS read of each cubin.

Pre/postprocess (cheap, every head dim): every global access of a row is 128 bits
(``LDG.E.128`` / ``STG.E.128``), the preprocess reduces rows with butterfly shuffles, nothing
spills, no MMA. They also go through the real compile path (TVM-FFI, export to the on-disk
cache) once.

Main kernel (a few seconds a compile): every head dim with a flag set that turns on most
features at once, plus a few others. The cubin must hold HMMA (mma.sync), LDSM (ldmatrix) and
LDGSTS (cp.async), no HGMMA, at most 255 registers; its spills (LDL + STL instructions) and stack
are printed (``pytest -rP`` shows them) and held to ``SPILL_BUDGET``: the 8-warp tiles sit at
the 255-register cap, and d96/d128 with many features spill a few words (4-8 LDL+STL).

Rounded head dims (multiples of 8 that are no tile head dim: the tiles of the next one, Note
[rounded head dims] in cute_fa/config.py) and (d, dv) = (128, 64), (192, 128) compile over the
same flag sets, with budgets by tile head dim; their pre/postprocess keys carry the dQ
accumulator's width (the tile head dim) beside dQ's.

The default run compiles a representative set; the rest is marked ``exhaustive``
(``python -m pytest -m exhaustive``).
"""

from __future__ import annotations

import re
import tempfile

import pytest
from cute_fa.ampere import (
    BwdPostConfig,
    BwdPreConfig,
    FlashAttentionBackwardPostprocessSm80,
    FlashAttentionBackwardPreprocessSm80,
)
from cute_fa.hopper import support as sm90_support
from cute_fa.hopper.support import SM90_BWD_HEAD_DIMS

from cute_fa import planning, settings
from cute_fa.config import BwdConfig, Sm90BwdTuning, Tiles, TuningError, sm80_bwd_tile
from cute_fa.tools.sass import inspect_cubin

EXHAUSTIVE = pytest.mark.exhaustive

HEAD_DIMS = (64, 96, 128, 192, 256)

# Largest LDL+STL instruction count allowed per head dim of the main kernel (measured: d64 0,
# d96 4, d128 8, d192 0, d256 0).
SPILL_BUDGET: dict[int, int] = {64: 0, 96: 8, 128: 16, 192: 0, 256: 0}
# The d64 tile (128 x 128, 8 warps: twice the dK/dV registers a thread) spills a few words with
# some feature flags; it measured faster than the 64 x 128 tile anyway (config.py).
SPILL_BUDGET_BY_TILE: dict[tuple[int, int, int, int], int] = {(64, 128, 128, 8): 32}

Pre = FlashAttentionBackwardPreprocessSm80
Post = FlashAttentionBackwardPostprocessSm80

MAIN_FLAG_SETS = {
    "causal_softcap_varlen": {
        "causal": True, "has_softcap": True, "varlen_q": True, "varlen_k": True,
    },
    "local_seqused": {"local": True, "varlen_q": True, "varlen_k": True, "seqused_q": True,
                      "seqused_k": True},
    "plain": {},
    "deterministic_local_varlen": {"deterministic": True, "local": True, "varlen_q": True,
                                   "varlen_k": True},
    "coresident_varlen": {"deterministic": True, "det_coresident": True, "varlen_q": True,
                          "varlen_k": True},
    "coresident_causal": {"deterministic": True, "det_coresident": True, "causal": True},
    "local_softcap": {"local": True, "has_softcap": True},
}  # fmt: skip
# (d, flag set); those of MAIN_DEFAULT run by default: plain (d 64: 128 x 128), causal with
# softcap and varlen at d 128 and d 256, a window with softcap, deterministic with a window.
MAIN_CASES = [(d, "causal_softcap_varlen") for d in HEAD_DIMS] + [
    (128, "local_seqused"),
    (128, "deterministic_local_varlen"),
    (128, "coresident_varlen"),
    (64, "coresident_causal"),
    (64, "plain"),
    (96, "local_softcap"),
]
MAIN_DEFAULT = {
    (64, "plain"), (128, "causal_softcap_varlen"), (256, "causal_softcap_varlen"),
    (96, "local_softcap"), (128, "deterministic_local_varlen"),
}  # fmt: skip


def _cubin(kernel, args: tuple, target: str) -> bytes:
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(prefix="cute-fa-cubin-") as d:
        compiled = cute.compile(
            kernel, *args, options=f"--gpu-arch {target} --keep-cubin --dump-dir {d}"
        )
        cubin = compiled.__cubin__
    assert cubin, "the DSL kept no cubin"
    return cubin if isinstance(cubin, bytes) else cubin.encode("latin-1")


def _count(sass: str, pattern: str) -> int:
    return len(re.findall(pattern, sass))


def _check_elementwise(info: dict) -> None:
    counts, sass = info["sass_counts"], info["sass_text"]
    assert counts["HMMA"] == 0 and counts["HGMMA"] == 0
    assert counts["LDL"] + counts["STL"] == 0, f"spills: stack {info['stack']} B"
    assert info["regs"] <= 64, f"{info['regs']} registers for an elementwise kernel"
    # Every load of a 16-bit row or of the fp32 accumulator is 128 bits wide.
    assert _count(sass, r"LDG\.E\.128") > 0, "no 128-bit global loads"
    assert _count(sass, r"STG\.E\.128") > 0, "no 128-bit global stores"


# --------------------------------------------------------------------------------------------
# Pre/postprocess


# Head dims of the pre/postprocess compiled by default (the others: exhaustive).
PREPOST_DEFAULT = (64, 256)
PREPOST_DIMS = [d if d in PREPOST_DEFAULT else pytest.param(d, marks=EXHAUSTIVE) for d in HEAD_DIMS]


@pytest.mark.compile
@pytest.mark.parametrize("has_dlse", [False, True], ids=["nodlse", "dlse"])
@pytest.mark.parametrize("d", PREPOST_DIMS)
def test_preprocess_compiles(d: int, has_dlse: bool) -> None:
    config = BwdPreConfig(80, "sm_90a", "bf16", d, d, has_dlse)
    info = inspect_cubin(_cubin(Pre(config), Pre.fake_args(config), config.target))
    _check_elementwise(info)
    sass = info["sass_text"]
    assert _count(sass, r"SHFL\.BFLY") > 0, "rows are reduced with butterfly shuffles"
    # Loads of O and dO and zero stores of dQaccum are all 128-bit; the scalar stores are delta
    # (and the scalar loads dLSE).
    assert _count(sass, r"LDG\.E(?!\.128)") == (_count(sass, r"STG\.E(?!\.128)") if has_dlse else 0)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", PREPOST_DIMS)
def test_postprocess_compiles(d: int, dtype: str) -> None:
    config = BwdPostConfig(80, "sm_90a", dtype, d)
    info = inspect_cubin(_cubin(Post(config), Post.fake_args(config), config.target))
    _check_elementwise(info)
    sass = info["sass_text"]
    assert _count(sass, r"LDG\.E(?!\.128)") == 0 and _count(sass, r"STG\.E(?!\.128)") == 0


@pytest.mark.compile
@pytest.mark.parametrize(
    "d,tile_m,varlen_q",
    [
        (64, 64, False), (256, 64, True), (64, 128, True),
        pytest.param(64, 64, True, marks=EXHAUSTIVE),
        pytest.param(128, 64, False, marks=EXHAUSTIVE),
        pytest.param(128, 64, True, marks=EXHAUSTIVE),
        pytest.param(256, 64, False, marks=EXHAUSTIVE),
        pytest.param(64, 128, False, marks=EXHAUSTIVE),
    ],
)  # fmt: skip
def test_postprocess_of_fragment_order_compiles(d: int, tile_m: int, varlen_q: bool) -> None:
    """The sm80 backward's postprocess reads each thread's fragment values with one 32-bit load
    each (a warp's load covers 128 consecutive bytes: Note [dQ accumulator in fragment order])
    and writes dQ rows with 128-bit stores."""
    config = BwdPostConfig(80, "sm_90a", "bf16", d, tile_m, 8, varlen_q)
    info = inspect_cubin(_cubin(Post(config), Post.fake_args(config), config.target))
    counts, sass = info["sass_counts"], info["sass_text"]
    assert counts["HMMA"] == 0 and counts["LDL"] + counts["STL"] == 0
    values = tile_m * d // 256  # fragment values a thread
    assert info["regs"] <= values + 64, f"{info['regs']} registers for {values} values"
    metadata = 2 if varlen_q else 0  # cu_seqlens_q[b], cu_seqlens_q[b + 1]
    assert _count(sass, r"LDG\.E(?!\.)") == values + metadata
    assert _count(sass, r"LDG\.E\.") == 0
    assert _count(sass, r"STG\.E(?!\.128)") == 0 and _count(sass, r"STG\.E\.128") > 0


@pytest.mark.parametrize("tile_m", [64, 128])
def test_dq_accum_blocks_of_packed_sequences_never_overlap(tile_m: int) -> None:
    """Note [dQ accumulator in fragment order]: every query block of every sequence gets whole
    tile_m rows of dQaccum, inside the buffer, shared with no other block."""
    import itertools
    import random

    from cute_fa.ampere.support import dq_accum_offset, dq_accum_rows

    rng = random.Random(0)
    cases = [[0], [1], [tile_m], [tile_m + 1, 0, 1], [0, 0, 0], [3 * tile_m - 1, 2 * tile_m]]
    cases += [[rng.choice([0, 1, rng.randrange(1, 4 * tile_m)]) for _ in range(rng.randrange(1, 9))]
              for _ in range(200)]  # fmt: skip
    for lengths in cases:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        rows = dq_accum_rows(cu[-1], len(lengths), tile_m, varlen=True)
        used = []
        for b, n in enumerate(lengths):
            start = dq_accum_offset(cu[b], b, tile_m, varlen=True)
            used += [(start + m * tile_m, start + (m + 1) * tile_m)
                     for m in range(-(-n // tile_m))]  # fmt: skip
        used.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(used)), lengths
        assert not used or (used[0][0] >= 0 and used[-1][1] <= rows), (lengths, rows)
    for n in (1, tile_m - 1, tile_m, tile_m + 1):  # dense: whole blocks of one (batch, head)
        assert dq_accum_rows(n, 1, tile_m, varlen=False) == -(-n // tile_m) * tile_m
        assert dq_accum_offset(0, 5, tile_m, varlen=False) == 0


@pytest.mark.compile
def test_prepost_compile_for_sm80_and_mixed_head_dims() -> None:
    pre = BwdPreConfig(80, "sm_80", "fp16", 192, 128, True)
    _check_elementwise(inspect_cubin(_cubin(Pre(pre), Pre.fake_args(pre), "sm_80")))
    post = BwdPostConfig(80, "sm_80", "bf16", 80)  # not a multiple of 16 chunks a row
    _check_elementwise(inspect_cubin(_cubin(Post(post), Post.fake_args(post), "sm_80")))


def test_prepost_can_implement() -> None:
    assert Pre.can_implement(BwdPreConfig(80, "sm_90a", "bf16", 128, 128)) == (True, "")
    ok, reason = Pre.can_implement(BwdPreConfig(80, "sm_90a", "bf16", 128, 260))
    assert not ok and "head_dim_v" in reason
    ok, reason = Post.can_implement(BwdPostConfig(90, "sm_90a", "bf16", 128))
    assert not ok and "sm90" in reason
    assert Post.can_implement(BwdPostConfig(80, "sm_90a", "bf16", 128, 64, 8, True)) == (True, "")
    ok, reason = Post.can_implement(BwdPostConfig(80, "sm_90a", "bf16", 128, 0, 8))
    assert not ok and "fragment order" in reason
    ok, reason = Post.can_implement(BwdPostConfig(80, "sm_90a", "bf16", 120, 64, 8))
    assert not ok and "multiples of 16" in reason
    with pytest.raises(NotImplementedError, match="head_dim 12"):
        Post(BwdPostConfig(80, "sm_90a", "bf16", 12))
    with pytest.raises(ValueError, match="dtype"):
        BwdPreConfig(80, "sm_90a", "fp32", 128, 128)


@pytest.mark.compile
def test_prepost_through_the_disk_cache(tmp_path) -> None:
    """The TVM-FFI compile and export of the pre/postprocess work without a GPU, and a second
    cache instance finds the entries on disk."""
    from cute_fa.cache import CompileCache, export_tvm_ffi, load_tvm_ffi
    from cute_fa.compile import compile_bwd_post, compile_bwd_pre
    from cute_fa.planning import post_config, pre_config

    config = BwdConfig(80, "sm_90a", "bf16", 128, 128, Tiles(64, 128, 8), causal=True)
    for compile_fn, key in (
        (compile_bwd_pre, pre_config(config, has_dlse=True)),
        (compile_bwd_post, post_config(config)),
    ):
        cache = CompileCache(compile_fn, export_tvm_ffi, load_tvm_ffi, directory=tmp_path)
        assert cache.ensure_on_disk(key) == "compiled"
        again = CompileCache(compile_fn, export_tvm_ffi, load_tvm_ffi, directory=tmp_path)
        assert again.ensure_on_disk(key) == "hit"


def test_prepost_keys_ignore_masks_and_tiles() -> None:
    """One preprocess compile serves every mask variant and tile of a head dim; the sm80
    postprocess depends only on what fixes the fragment order (tile_m, warps, varlen_q), the
    sm90 backward's on nothing but the head dim and dtype."""
    from cute_fa.planning import post_config, pre_config

    a = BwdConfig(80, "sm_90a", "bf16", 128, 128, Tiles(64, 128, 8))
    b = a.replace(causal=True, has_softcap=True, varlen_q=True).with_tuning(tile_n=64)
    assert pre_config(a, False) == pre_config(b, False) != pre_config(a, True)
    masks = a.replace(causal=True, has_softcap=True).with_tuning(tile_n=64)
    assert post_config(a) == post_config(masks)
    assert post_config(a) != post_config(b) and post_config(b).varlen_q
    assert (post_config(a).tile_m, post_config(a).num_warps) == (64, 8)
    assert post_config(a.with_tuning(tile_m=128)) != post_config(a)
    c = a.replace(arch=90, tuning=Sm90BwdTuning(64, 128))
    rows = post_config(c)
    assert (rows.arch, rows.tile_m, rows.num_warps, rows.varlen_q) == (80, 0, 0, False)
    assert post_config(c.replace(varlen_q=True).with_tuning(tile_m=128)) == rows


# --------------------------------------------------------------------------------------------
# Main kernel


def _main_kernel_class():
    from cute_fa.ampere import FlashAttentionBackwardSm80

    return FlashAttentionBackwardSm80


def _main_config(d: int, target: str, dtype: str = "bf16", dv: int | None = None,
                 **flags) -> BwdConfig:  # fmt: skip
    return BwdConfig(
        arch=80, target=target, dtype=dtype, head_dim=d, head_dim_v=dv or d,
        tuning=sm80_bwd_tile(d, target), **flags,
    )  # fmt: skip


def _check_main(config: BwdConfig, budget: int | None = None) -> None:
    from cute_fa.dsl.fake import bwd_fake_args

    cls = _main_kernel_class()
    ok, reason = cls.can_implement(config)
    assert ok, reason
    info = inspect_cubin(_cubin(cls(config), bwd_fake_args(config), config.target))
    counts = info["sass_counts"]
    spills = counts["LDL"] + counts["STL"]
    print(
        f"{config.name}: REG {info['regs']} STACK {info['stack']} spills (LDL+STL) {spills} "
        f"HMMA {counts['HMMA']} LDSM {counts['LDSM']} LDGSTS {counts['LDGSTS']}"
    )
    assert counts["HMMA"] > 0, "no mma.sync (HMMA) in the SASS"
    assert counts["LDSM"] > 0, "no ldmatrix (LDSM) in the SASS"
    assert counts["LDGSTS"] > 0, "no cp.async (LDGSTS) in the SASS"
    assert counts["HGMMA"] == 0
    assert info["regs"] <= 255
    if config.deterministic:
        # The turns take acquire loads and red.release, never fence.acq_rel (MEMBAR; ERRBAR;
        # CGAERRBAR; CCTL.IVALL): with one after them ptxas returns every dQ atomic (ATOMG),
        # which measured 10 % of the speed (Note [deterministic dQ]).
        assert counts["ATOMG"] == 0 and counts["REDG"] > 0, (counts["ATOMG"], counts["REDG"])
        fence = r"MEMBAR[^\n]*\n[^\n]*ERRBAR[^\n]*\n[^\n]*CGAERRBAR[^\n]*\n[^\n]*CCTL"
        assert not re.search(fence, info["sass_text"]), "fence.acq_rel in the SASS"
    tile = (config.head_dim, config.tile_m, config.tile_n, config.num_warps)
    if budget is None:
        budget = SPILL_BUDGET_BY_TILE.get(tile, SPILL_BUDGET[config.head_dim])
    assert spills <= budget, f"{spills} LDL/STL (stack {info['stack']} B), budget {budget}"


@pytest.mark.compile
@pytest.mark.parametrize(
    "d,flags",
    [
        pytest.param(d, f, id=f"d{d}-{f}", marks=() if (d, f) in MAIN_DEFAULT else EXHAUSTIVE)
        for d, f in MAIN_CASES
    ],
)
def test_main_kernel_compiles_for_sm90a(d: int, flags: str) -> None:
    _check_main(_main_config(d, "sm_90a", **MAIN_FLAG_SETS[flags]))


# Rounded head dims (Note [rounded head dims] in cute_fa/config.py) and (d, dv) pairs: the tiles
# of the next tile head dim; budgets by tile head dim (measured for sm_90a, CUDA 12 ptxas:
# docs/log/sm80.md, 2026-12-05): 0 but for the 128 x 128 tile of d <= 64 with a window and
# softcap, 111-119 (d 64 itself: 104; not in MAIN_CASES), and at d 200-248 2-22 (deterministic
# with a window 18-22; d 256 itself: 16).
ROUNDED_DIMS = (8, 32, 40, 72, 80, 104, 112, 136, 160, 200, 224, 248)
ROUNDED_SPILL_BUDGET: dict[int, int] = {64: 128, 96: 8, 128: 16, 192: 8, 256: 32}
# CUDA 13's ptxas for sm_100a (test below), by head dim.
OTHER_TARGET_SPILL_BUDGET: dict[int, int] = {112: 32}
ROUNDED_MAIN_DEFAULT = {
    (40, "plain"), (80, "causal_softcap_varlen"), (160, "local_seqused"),
    (224, "causal_softcap_varlen"), (112, "deterministic_local_varlen"),
}  # fmt: skip
ROUNDED_FLAG_SETS = [f for f in MAIN_FLAG_SETS if f != "coresident_varlen"]
PAIRS = ((128, 64), (192, 128))
PAIR_MAIN_DEFAULT = {((128, 64), "causal_softcap_varlen"),
                     ((192, 128), "deterministic_local_varlen")}  # fmt: skip


def _rounded_budget(config: BwdConfig) -> int:
    from cute_fa.config import tile_head_dim

    return ROUNDED_SPILL_BUDGET[tile_head_dim(config.head_dim)]


@pytest.mark.compile
@pytest.mark.parametrize(
    "d,flags",
    [
        pytest.param(d, f, id=f"d{d}-{f}",
                     marks=() if (d, f) in ROUNDED_MAIN_DEFAULT else EXHAUSTIVE)
        for d in ROUNDED_DIMS for f in ROUNDED_FLAG_SETS
    ],
)  # fmt: skip
def test_main_kernel_of_rounded_head_dims_compiles(d: int, flags: str) -> None:
    config = _main_config(d, "sm_90a", **MAIN_FLAG_SETS[flags])
    _check_main(config, _rounded_budget(config))


@pytest.mark.compile
@pytest.mark.parametrize(
    "d,dv,flags",
    [
        pytest.param(d, dv, f, id=f"d{d}x{dv}-{f}",
                     marks=() if ((d, dv), f) in PAIR_MAIN_DEFAULT else EXHAUSTIVE)
        for d, dv in PAIRS for f in ROUNDED_FLAG_SETS
    ],
)  # fmt: skip
def test_main_kernel_of_head_dim_pairs_compiles(d: int, dv: int, flags: str) -> None:
    """(d, dv): sK, sQ of d columns, sV, sdO of dv; dK and dV by tiled MMAs of their own."""
    _check_main(_main_config(d, "sm_90a", dv=dv, **MAIN_FLAG_SETS[flags]))


@pytest.mark.compile
@pytest.mark.exhaustive
@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_100a"])
def test_main_kernel_of_rounded_head_dims_compiles_for_other_targets(target: str) -> None:
    """d112 causal varlen for sm_100a: 24 LDL/STL (stack 32 B) by CUDA 13's ptxas, within the
    budget by CUDA 12's; the other targets' cases within it by both."""
    for d in (40, 112):
        config = _main_config(d, target, causal=True, varlen_q=True, varlen_k=True)
        budget = _rounded_budget(config)
        if target == "sm_100a":
            budget = max(budget, OTHER_TARGET_SPILL_BUDGET.get(d, 0))
        _check_main(config, budget)


@pytest.mark.compile
@pytest.mark.parametrize("d,acc,varlen_q", [
    (40, 64, False), (80, 96, True), pytest.param(224, 256, True, marks=EXHAUSTIVE),
    pytest.param(8, 64, False, marks=EXHAUSTIVE),
])  # fmt: skip
def test_prepost_of_rounded_head_dims_compile(d: int, acc: int, varlen_q: bool) -> None:
    """A rounded head dim: the preprocess zeroes all ``acc`` columns of dQaccum (the main
    kernel's tile head dim) and sums d columns of O * dO; the postprocess reads the fragments
    of the ``acc``-wide block and writes d columns of dQ, 16 bytes a store."""
    pre = BwdPreConfig(80, "sm_90a", "bf16", acc, d)
    info = inspect_cubin(_cubin(Pre(pre), Pre.fake_args(pre), pre.target))
    _check_elementwise(info)
    post = BwdPostConfig(80, "sm_90a", "bf16", d, 64, 8, varlen_q, acc_head_dim=acc)
    assert post.name.endswith(f"_d{d}_frag64w8_acc{acc}" + ("_varlen" if varlen_q else ""))
    info = inspect_cubin(_cubin(Post(post), Post.fake_args(post), post.target))
    counts, sass = info["sass_counts"], info["sass_text"]
    assert counts["HMMA"] == 0 and counts["LDL"] + counts["STL"] == 0
    values = 64 * acc // 256  # fragment values a thread
    metadata = 2 if varlen_q else 0
    assert _count(sass, r"LDG\.E(?!\.)") == values + metadata
    assert _count(sass, r"STG\.E(?!\.128)") == 0 and _count(sass, r"STG\.E\.128") > 0


def test_prepost_keys_of_a_rounded_head_dim() -> None:
    """The preprocess of a rounded head dim zeroes the tile head dim's columns (its key's
    head_dim); the postprocess's key carries both widths, and the kernel checks them."""
    from cute_fa.planning import post_config, pre_config

    config = BwdConfig(80, "sm_90a", "bf16", 40, 40, Tiles(128, 128, 8))
    pre = pre_config(config, False)
    assert (pre.head_dim, pre.head_dim_v, pre.name) == (64, 40, "bwdpre_sm80_sm_90a_bf16_d64x40")
    post = post_config(config)
    assert (post.head_dim, post.acc_cols, post.tile_m) == (40, 64, 128)
    assert post_config(config.replace(head_dim=64, head_dim_v=64)).acc_head_dim == 0
    assert Post.can_implement(post) == (True, "")
    ok, why = Post.can_implement(post.replace(acc_head_dim=32))
    assert not ok and "acc_head_dim 32 must hold head_dim 40" in why
    ok, why = Post.can_implement(post.replace(tile_m=0, num_warps=0))
    assert not ok and "acc_head_dim" in why
    sm90 = config.replace(arch=90, head_dim=64, head_dim_v=64, tuning=Sm90BwdTuning(64, 128))
    assert pre_config(sm90, False).head_dim == 64 and post_config(sm90).acc_cols == 64


@pytest.mark.compile
@pytest.mark.exhaustive
def test_main_kernel_compiles_for_sm80_fp16() -> None:
    _check_main(_main_config(128, "sm_80", dtype="fp16", causal=True))


def test_bwd_config_uses_the_tile_table(monkeypatch) -> None:
    from cute_fa.planning import bwd_config

    monkeypatch.delenv(settings.BWD_ARCH, raising=False)
    for d in HEAD_DIMS:
        config = bwd_config("sm_80", "bf16", d, d, causal=True)
        assert config.tuning == sm80_bwd_tile(d, "sm_80")
        # On sm_90a the sm90 kernel serves every head dim with dv = d (Note [backward dispatch]).
        family = 90 if d in SM90_BWD_HEAD_DIMS else 80
        assert bwd_config("sm_90a", "bf16", d, d, causal=True).arch == family
    # A rounded head dim (Note [rounded head dims]): the sm80 kernel, the tile of d 96.
    config = bwd_config("sm_90a", "bf16", 80, 80)
    assert config.arch == 80 and config.tuning == sm80_bwd_tile(96, "sm_90a")
    with pytest.raises(NotImplementedError, match="head_dim_v 128 with head_dim 64"):
        bwd_config("sm_90a", "bf16", 64, 128)


def test_coresident_order_is_chosen_where_a_head_fits_on_half_the_gpu(monkeypatch) -> None:
    """Deterministic sm80 calls take the coresident order (Note [deterministic dQ]) only
    without a window and with at most SMs / 2 key blocks; the sm90 kernel has no such mode."""
    monkeypatch.delenv(settings.BWD_DET_ORDER, raising=False)
    monkeypatch.delenv(settings.BWD_ARCH, raising=False)
    sms = 132
    det = _main_config(128, "sm_90a", deterministic=True)  # 128 keys a CTA
    assert planning.coresident_fits(det, 66 * 128, sms)
    assert not planning.coresident_fits(det, 66 * 128 + 1, sms)
    assert not planning.coresident_fits(det.replace(deterministic=False), 128, sms)
    local = _main_config(128, "sm_90a", deterministic=True, local=True)
    assert not planning.coresident_fits(local, 128, sms)
    sm90 = planning.bwd_config("sm_90a", "bf16", 128, 128, deterministic=True)
    assert sm90.arch == 90 and not planning.coresident_fits(sm90, 128, sms)
    ok, why = sm90_support.bwd_can_implement(sm90.replace(det_coresident=True))
    assert not ok and "sm80" in why
    with pytest.raises(ValueError, match="det_coresident"):
        det.replace(det_coresident=True, local=True)
    with pytest.raises(ValueError, match="det_coresident"):
        det.replace(det_coresident=True, deterministic=False)
    assert det.replace(det_coresident=True).name.endswith("_deterministic_coresident")
    monkeypatch.setenv(settings.BWD_DET_ORDER, "chain")
    assert not planning.coresident_fits(det, 128, sms)
    monkeypatch.setenv(settings.BWD_DET_ORDER, "sideways")
    with pytest.raises(settings.SettingError, match="CUTE_FA_BWD_DET_ORDER"):
        planning.coresident_fits(det, 128, sms)


@pytest.mark.compile
@pytest.mark.parametrize("d", [pytest.param(96, marks=EXHAUSTIVE), 128])
def test_main_kernel_compiles_for_small_smem_targets(d: int) -> None:
    """99 KiB of shared memory (sm_86 / sm_89 / sm_120a): d96 and d128 take 64 keys a CTA."""
    _check_main(_main_config(d, "sm_86", causal=True, has_softcap=True, varlen_q=True,
                             varlen_k=True))  # fmt: skip


def test_small_smem_targets_get_a_backward_that_fits() -> None:
    from cute_fa.ampere.support import bwd_can_implement

    from cute_fa.planning import bwd_config

    for target in ("sm_86", "sm_89", "sm_120a"):
        for d in (64, 96, 128):
            config = bwd_config(target, "bf16", d, d, causal=d == 128)
            assert bwd_can_implement(config) == (True, ""), (target, d)
        assert (config.tile_m, config.tile_n) == (64, 64)  # d128
        for d in (192, 256):
            with pytest.raises(NotImplementedError, match="shared memory"):
                bwd_config(target, "bf16", d, d)
    assert sm80_bwd_tile(128, "sm_80") == Tiles(64, 128, 8)  # big shared memory keeps the table's


# Values the sm80 tiles reject when they are built (TuningError, a ValueError), as
# (tile_m, tile_n, num_warps).
@pytest.mark.parametrize(
    "tiles, needle",
    [((64, 100, 8), "tile_n"), ((0, 128, 8), "tile_m"), ((64, 272, 8), "tile_n"),
     ((64, 128, 6), "num_warps"), ((64, 128, 16), "num_warps"), ((64.0, 128, 8), "tile_m"),
     ((False, 128, 8), "tile_m")],
)  # fmt: skip
def test_sm80_tiles_reject_malformed_values(tiles: tuple, needle: str) -> None:
    with pytest.raises(TuningError, match=needle):
        Tiles(*tiles)


def test_sm80_bwd_tile_override_is_checked_by_the_kernel(monkeypatch) -> None:
    """A tile the tuning accepts but the kernel cannot run (too much shared memory, more
    accumulators than the warps hold) is declined with its reason, never compiled."""
    import cute_fa

    monkeypatch.delenv(settings.BWD_ARCH, raising=False)
    with cute_fa.tuning(sm80_bwd={"tile_m": 64, "tile_n": 64, "num_warps": 4}):
        assert planning.bwd_config("sm_80", "bf16", 128, 128).tuning == Tiles(64, 64, 4)
    with cute_fa.tuning(sm80_bwd={"tile_n": 256}):
        with pytest.raises(NotImplementedError, match="FlashAttentionBackwardSm80"):
            planning.bwd_config("sm_80", "bf16", 256, 256)
    with cute_fa.tuning(sm80_bwd={"num_warps": 6}):
        with pytest.raises(TuningError, match="num_warps"):
            planning.bwd_config("sm_80", "bf16", 128, 128)
