"""Compile-only checks of the sm100 forward kernel (FA4 design) on the CPU, with a SASS read.

No Blackwell GPU and no simulator exist where this runs: ``FlashAttentionForwardSm100`` is
cross-compiled for sm_100a (and sm_103a) with fake tensors, and its cubin is read. What is
checked: the MMAs are tcgen05 (``UTCHMMA``, no ``HMMA`` / ``HGMMA``), S / P / O move between
TMEM and registers (``LDTM`` / ``STTM``), TMEM is allocated and freed (``UTCATOMSWS
.FIND_AND_SET`` / ``UTCATOMSWS.AND``), the roles re-budget their registers (``USETMAXREG`` down
to 48 and 80, up to 192), Q / K / V arrive by TMA (``UTMALDG``), and nothing goes to local
memory (0 stack, 0 local, no ``LDL`` / ``STL``). The pipeline arrival counts are asserted while
tracing (``FlashAttentionForwardSm100._pipelines``); this file checks the traced protocol
against the docstring's. The CTA pair (``Sm100FwdTuning.cta_pair``): every MMA in its 2-CTA form
(``UTCHMMA.2CTA``), 2-CTA TMA loads (``UTMALDG.*.2CTA``), commits multicast to both CTAs
(``UTCBAR.2CTA.MULTICAST``), the 2-CTA TMEM allocation, a cluster barrier after the barrier
init. Few configs in the default run: each compile costs CPU seconds; the pair's matrix (head
dims x features x targets) is marked ``exhaustive``.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from cute_fa.blackwell.support import (
    SM100_FWD_HEAD_DIM_PAIRS,
    SM100_FWD_PAIR_HEAD_DIM_PAIRS,
    SM100_FWD_REGS,
    SM100_FWD_TILE,
    TMEM_COLUMNS,
    fwd_can_implement,
    fwd_config,
    fwd_kv_stages,
    fwd_pair_wanted,
    fwd_q_tiles,
    fwd_regs,
    fwd_regs_total,
    fwd_smem_bytes,
    fwd_tmem_columns,
)

from cute_fa.config import SMEM_CAPACITY, Sm90FwdTuning, Sm100FwdTuning


def _compile(config):
    """(kernel instance, inspect_cubin's report) of the sm100 forward for ``config``."""
    from cute_fa.blackwell import FlashAttentionForwardSm100

    from cute_fa.tools.sass import compile_cubin, inspect_cubin

    kernel = FlashAttentionForwardSm100(config)
    return kernel, inspect_cubin(compile_cubin(config, kernel))


def test_lazy_import_and_support_without_dsl_kernel() -> None:
    import cute_fa.blackwell as bw

    assert "FlashAttentionForwardSm100" in bw.__all__
    assert fwd_can_implement(fwd_config(128, 128)) == (True, "")


@pytest.mark.parametrize("d, dv", SM100_FWD_HEAD_DIM_PAIRS)
@pytest.mark.parametrize("target", ["sm_100a", "sm_103a"])
def test_sm100_can_implement_accepts(d: int, dv: int, target: str) -> None:
    config = fwd_config(d, dv, target=target, causal=True, varlen_q=True, varlen_k=True)
    assert fwd_can_implement(config) == (True, "")
    assert fwd_smem_bytes(config) <= SMEM_CAPACITY[target]
    assert fwd_tmem_columns(config.tile_n, dv, fwd_q_tiles(config)) <= TMEM_COLUMNS
    # Two Q tiles where their TMEM plan fits, else one (d 256, (192, 192)).
    one_tile = (d, dv) in ((192, 192), (256, 256))
    assert (config.tile_m, fwd_q_tiles(config)) == ((128, 1) if one_tile else (256, 2))
    assert fwd_tmem_columns(config.tile_n, dv) > TMEM_COLUMNS if one_tile else True


def test_sm100_one_q_tile_plan() -> None:
    """d 256: S/P 128 + O 256 = 384 TMEM columns; Q 64 KiB + 2 K/V stages of 64 KiB (+ slack)
    in 227 KiB; a third stage would not fit. Two Q tiles at d 256 need 768 columns: declined
    with the reason. One Q tile is a tuning choice at the other head dims too."""
    config = fwd_config(256, 256)
    assert fwd_tmem_columns(128, 256, 1) == 384 and fwd_kv_stages(config) == 2
    assert fwd_smem_bytes(config) == 3 * 64 * 1024 + 4096 <= SMEM_CAPACITY["sm_100a"]
    three = config.replace(tuning=dataclasses.replace(config.tuning, kv_stages=3))
    ok, reason = fwd_can_implement(three)
    assert not ok and "shared memory" in reason
    two = config.replace(tuning=dataclasses.replace(config.tuning, tile_m=256))
    ok, reason = fwd_can_implement(two)
    assert not ok and "768 columns" in reason, reason
    assert fwd_kv_stages(fwd_config(192, 192)) == 3
    one = fwd_config(128, 128)
    one = one.replace(tuning=dataclasses.replace(one.tuning, tile_m=128))
    assert fwd_can_implement(one) == (True, "") and fwd_q_tiles(one) == 1
    assert one.name.endswith("_128x128w16"), one.name


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"arch": 90}, "sm90"),
        ({"target": "sm_90a"}, "sm_100a"),
        ({"head_dim": 256, "head_dim_v": 128}, "head_dim 256"),
        ({"head_dim": 160, "head_dim_v": 160}, "head_dim 160"),
        ({"tuning": Sm100FwdTuning(tile_n=64)}, "tile"),
        ({"tuning": Sm90FwdTuning()}, "Sm100FwdTuning"),
        ({"pack_gqa": 3}, "pack_gqa with 3"),
        ({"pack_gqa": 12}, "pack_gqa with 12"),
    ],
)
def test_sm100_can_implement_rejects_with_reason(changes: dict, needle: str) -> None:
    ok, reason = fwd_can_implement(fwd_config(128, 128).replace(**changes))
    assert not ok and needle in reason


def _pair(config):
    return config.replace(tuning=dataclasses.replace(config.tuning, cta_pair=True))


@pytest.mark.parametrize("d, dv", SM100_FWD_PAIR_HEAD_DIM_PAIRS)
@pytest.mark.parametrize("target", ["sm_100a", "sm_103a"])
def test_sm100_pair_can_implement_accepts(d: int, dv: int, target: str) -> None:
    """The CTA pair: half a K/V stage a CTA, FA4's ring depth (6 at d 128, 5 at (192, 128)),
    in shared memory; "pair" in the compile key's name."""
    config = _pair(fwd_config(d, dv, target=target, causal=True, varlen_q=True, varlen_k=True))
    assert fwd_can_implement(config) == (True, "")
    assert fwd_kv_stages(config) == {128: 6, 192: 5}[d]
    assert fwd_smem_bytes(config) <= SMEM_CAPACITY[target]
    assert config.name.endswith("_256x128w16_pair_causal_varlen_q_varlen_k"), config.name


@pytest.mark.parametrize(
    "d, dv, flags, needle",
    [
        (64, 64, {}, "cta_pair at head_dim 64"),
        (96, 96, {}, "cta_pair at head_dim 96"),
        (256, 256, {}, "cta_pair with one Q tile"),
        (192, 192, {}, "cta_pair with one Q tile"),
        (128, 128, {"seqused_k": True}, "cta_pair with seqused_k"),
        (128, 128, {"has_softcap": True}, "cta_pair with softcap"),
        (192, 128, {"has_softcap": True}, "cta_pair with softcap"),
    ],
)
def test_sm100_pair_declines_with_reason(d: int, dv: int, flags: dict, needle: str) -> None:
    ok, reason = fwd_can_implement(_pair(fwd_config(d, dv, **flags)))
    assert not ok and needle in reason, reason
    assert fwd_can_implement(fwd_config(d, dv, **flags)) == (True, "")  # the single CTA takes it


@pytest.mark.parametrize(
    "d, dv, flags, seqlen_q, wanted",
    [
        (128, 128, {}, 257, True),
        (192, 128, {}, 4096, True),
        (128, 128, {}, 256, False),  # one pair's tile would be mostly empty (FA4: > 2 x 128)
        (128, 128, {}, None, False),  # unknown length
        (128, 128, {"causal": True}, 4096, False),
        (128, 128, {"local": True}, 4096, False),
        (128, 128, {"varlen_q": True}, 4096, False),
        (128, 128, {"seqused_q": True}, 4096, False),
        (128, 128, {"varlen_k": True}, 4096, True),  # dense Q rows: FA4 takes it
        (128, 128, {"has_softcap": True}, 4096, False),  # declined (spills): single CTA
        (192, 128, {"has_softcap": True}, 4096, False),
        (64, 64, {}, 4096, False),
        (96, 96, {}, 4096, False),
        (256, 256, {}, 4096, False),  # one Q tile: no pair (FA4's d 256 kernel is 2-CTA)
    ],
)
def test_sm100_pair_dispatch_rule(d, dv, flags, seqlen_q, wanted) -> None:
    """FA4's rule for its 2-CTA forward, where the pair implements the call."""
    assert fwd_pair_wanted(fwd_config(d, dv, **flags), seqlen_q) is wanted


def test_sm100_pair_through_planning() -> None:
    """Planning takes the pair for a long non-causal d 128 call on capability 10.0 (the
    query rows planning passes: packed GQA multiplies them first), the single CTA for a short
    or causal one; an override turns it off or on."""
    import cute_fa
    from cute_fa.planning import SM100_FWD, FwdRequest, fwd_config_for_target

    def plan(seqlen_q, causal=False, d=128, dv=128):
        request = FwdRequest("bf16", d, dv, causal)
        return fwd_config_for_target(SM100_FWD, "sm_100a", request, seqlen_q)[0]

    assert plan(4096).tuning.cta_pair and plan(4096).name.endswith("_256x128w16_pair")
    assert plan(4096, d=192).tuning.cta_pair
    assert not plan(256).tuning.cta_pair and not plan(4096, causal=True).tuning.cta_pair
    # d 256: one Q tile a CTA, never the pair.
    assert plan(4096, d=256, dv=256).name.endswith("_128x128w16"), plan(4096, d=256, dv=256)
    with cute_fa.tuning(sm100_fwd={"cta_pair": False}):
        assert not plan(4096).tuning.cta_pair
    with cute_fa.tuning(sm100_fwd={"cta_pair": True}):
        assert plan(300, causal=True).tuning.cta_pair


def test_sm100_tile_and_register_budget() -> None:
    tile_m, tile_n, num_warps = SM100_FWD_TILE
    assert (tile_m, tile_n, num_warps) == (256, 128, 16)
    assert set(SM100_FWD_REGS) == set(SM100_FWD_HEAD_DIM_PAIRS)
    for (d, dv), regs in SM100_FWD_REGS.items():
        # The registers of an SM; 512 threads launch at 128 each. One Q tile: the unused
        # softmax warpgroup at the other warps' budget.
        q_tiles = fwd_q_tiles(fwd_config(d, dv))
        softmax, correction, other = regs
        total = 128 * (q_tiles * softmax + (2 - q_tiles) * other + correction + other)
        assert fwd_regs_total(regs, q_tiles) == total <= 65536


VARLEN = {"varlen_q": True, "varlen_k": True}
VARLEN_SEQUSED_Q = {**VARLEN, "seqused_q": True}
LOCAL_SOFTCAP = {"local": True, "has_softcap": True}
# (d, dv, target, flags): both head-dim pairs, causal, varlen with seqused_q, sliding window
# with softcap, fp16, sm_103a once.
COMPILE_CASES = [
    pytest.param(128, 128, "sm_100a", {}, id="d128"),
    pytest.param(128, 128, "sm_100a", LOCAL_SOFTCAP, id="d128-local-softcap"),
    pytest.param(128, 128, "sm_100a", {"local": True}, id="d128-local"),
    pytest.param(96, 96, "sm_100a", {"causal": True}, id="d96-causal"),
    pytest.param(192, 128, "sm_100a", {"causal": True}, id="d192x128-causal"),
    pytest.param(
        128,
        128,
        "sm_100a",
        {**VARLEN, "seqused_k": True, "causal": True},
        id="d128-varlen-seqused_k-causal",
    ),  # fmt: skip
    pytest.param(
        64,
        64,
        "sm_100a",
        {"dtype": "fp16", **LOCAL_SOFTCAP, **VARLEN},
        id="d64-fp16-local-softcap-varlen",
    ),  # fmt: skip
    pytest.param(128, 128, "sm_100a", {"causal": True}, id="d128-causal"),
    # One Q tile a CTA (d 256: 384 TMEM columns), once in the default run.
    pytest.param(256, 256, "sm_100a", {"causal": True, **VARLEN}, id="d256-causal-varlen"),
    # The CTA pair (2-CTA MMAs): FA4's two head-dim pairs, each target once.
    pytest.param(128, 128, "sm_100a", {"cta_pair": True}, id="d128-pair"),
    pytest.param(192, 128, "sm_103a", {"cta_pair": True}, id="d192x128-pair-sm103a"),
    pytest.param(128, 128, "sm_100a", VARLEN_SEQUSED_Q, id="d128-varlen-seqused_q"),
    pytest.param(64, 64, "sm_100a", {"causal": True, **VARLEN}, id="d64-causal-varlen"),
    pytest.param(128, 128, "sm_103a", {}, id="d128-sm103a"),
    # Packed GQA: Q by 5-D TMA boxes (d, G, seqlen, K/V heads, batch).
    pytest.param(128, 128, "sm_100a", {"causal": True, "pack_gqa": 4}, id="d128-causal-pack4"),
    pytest.param(
        64,
        64,
        "sm_100a",
        {**VARLEN_SEQUSED_Q, "seqused_k": True, "pack_gqa": 8},
        id="d64-varlen-seqused-pack8",
    ),  # fmt: skip
]

_SETMAXNREG = re.compile(r"USETMAXREG\.(DEALLOC|TRY_ALLOC)\.CTAPOOL\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+)")


# The CTA pair's matrix (exhaustive): FA4's head dims x features x both targets (softcap is
# declined: the softmax warps spill, test_sm100_pair_declines_with_reason).
PAIR_FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "local": {"local": True},
    "varlen": {**VARLEN, "seqused_q": True},
    "gqa-pack4": {"pack_gqa": 4},
    "gqa-pack8-local": {"pack_gqa": 8, "local": True},
}
PAIR_MATRIX = [
    pytest.param(d, dv, target, {"cta_pair": True, **flags},
                 id=f"d{d}x{dv}-pair-{name}-{target}", marks=pytest.mark.exhaustive)
    for d, dv in SM100_FWD_PAIR_HEAD_DIM_PAIRS
    for name, flags in PAIR_FEATURES.items()
    for target in ("sm_100a", "sm_103a")
]  # fmt: skip


# One Q tile's matrix (exhaustive): d 256 and (192, 192) x features x both targets, and d 128
# with tile_m 128 (one Q tile asked for by the tuning).
ONE_TILE_FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "local": {"local": True},
    "varlen": {**VARLEN, "seqused_q": True, "seqused_k": True},
    "gqa-pack4-causal": {"pack_gqa": 4, "causal": True},
    "softcap": {"has_softcap": True},
    "fp16-local-softcap-varlen": {"dtype": "fp16", **LOCAL_SOFTCAP, **VARLEN},
}
ONE_TILE_MATRIX = [
    pytest.param(d, dv, target, flags, id=f"d{d}x{dv}-{name}-{target}",
                 marks=pytest.mark.exhaustive)
    for d, dv in ((256, 256), (192, 192))
    for name, flags in ONE_TILE_FEATURES.items()
    for target in ("sm_100a", "sm_103a")
] + [
    pytest.param(128, 128, "sm_100a", {"tile_m": 128, **flags}, id=f"d128-one-tile-{name}",
                 marks=pytest.mark.exhaustive)
    for name, flags in (("plain", {}), ("causal-varlen", {"causal": True, **VARLEN}))
]  # fmt: skip


@pytest.mark.compile
@pytest.mark.parametrize("d, dv, target, flags", COMPILE_CASES + PAIR_MATRIX + ONE_TILE_MATRIX)
def test_sm100_fwd_compiles(d: int, dv: int, target: str, flags: dict) -> None:
    flags = dict(flags)
    pair = flags.pop("cta_pair", False)
    tile_m = flags.pop("tile_m", None)
    config = fwd_config(d, dv, target=target, **flags)
    if pair:
        config = _pair(config)
    if tile_m:
        config = config.replace(tuning=dataclasses.replace(config.tuning, tile_m=tile_m))
    q_tiles = fwd_q_tiles(config)
    assert fwd_can_implement(config) == (True, "")
    kernel, info = _compile(config)
    counts, sass = info["sass_counts"], info["sass_text"]
    # tcgen05 MMAs only: S = Q K^T (prologue + loop) and O += P V (loop + last) for each Q
    # tile.
    assert counts["UTCHMMA"] > 0
    assert counts["HMMA"] == 0 and counts["HGMMA"] == 0
    # d > 128: S's K phases after the first are a runtime loop (one site in its body).
    k_phases_s, k_phases_pv = (d // 16 if d <= 128 else 2), config.tile_n // 16
    assert counts["UTCHMMA"] == 2 * q_tiles * (k_phases_s + k_phases_pv)
    # The pair: every MMA, TMA load and commit in its 2-CTA form; a cluster barrier after
    # the barrier init. One CTA: none.
    pair_forms = ("UTCHMMA", "UTMALDG", "UTCBAR")
    for op in pair_forms:
        two = len(re.findall(rf"\b{op}(?:\.\w+)*\.2CTA\b", sass))
        assert two == (counts[op] if pair else 0), (op, two, counts[op])
    assert len(re.findall(r"UTCBAR\.2CTA\.MULTICAST", sass)) == (counts["UTCBAR"] if pair else 0)
    assert ("UCGABAR_ARV" in sass and "UCGABAR_WAIT" in sass) == pair
    # S loads, P stores, O loads / stores in TMEM; TMA loads.
    assert counts["LDTM"] > 0 and counts["STTM"] > 0
    assert counts["UTMALDG"] > 0
    # TMEM allocated (a retry loop: one or more FIND_AND_SET; the pair: its 2-CTA form) and
    # freed once.
    alloc = "UTCATOMSWS.2CTA.FIND_AND_SET" if pair else "UTCATOMSWS.FIND_AND_SET"
    assert sass.count(alloc) >= 1
    assert sass.count("UTCATOMSWS.AND") == 1
    # Registers re-budgeted by role: softmax up, correction and the other warps down.
    softmax, correction, other = fwd_regs(config)
    budgets = {(kind, int(value, 16)) for kind, value in _SETMAXNREG.findall(sass)}
    assert budgets == {("DEALLOC", other), ("DEALLOC", correction), ("TRY_ALLOC", softmax)}
    assert info["regs"] <= 128  # 512 threads launch
    # Nothing in local memory, but for the pair with packed GQA and a window for sm_100a, where
    # CUDA 13's ptxas spills 8 bytes of the softmax warps (1 LDL, 2 STL; CUDA 12's none, sm_103a
    # none by both; softmax 200 / correction 72 / other 40 registers spilled more: 18-56 LDL/STL;
    # docs/log/sm100.md, 2026-12-05).
    if pair and config.pack_gqa and config.local and target == "sm_100a":
        assert info["stack"] <= 8 and counts["LDL"] + counts["STL"] <= 3
    elif d == 256 and config.varlen_q and config.varlen_k:
        # d 256 (one Q tile) with cu_seqlens for both: ptxas (CUDA 12 and 13) keeps the
        # shared-memory base address in 8 bytes of local memory (1 STL at entry, 34-44 LDL
        # after mbarrier waits); role budgets 256 / 112-128 / 48-72 do not change it
        # (docs/log/sm100.md, 2026-12-05).
        assert info["stack"] <= 8 and counts["STL"] <= 1 and counts["LDL"] <= 48
    else:
        assert info["stack"] == 0 and info["local"] == 0
        assert counts["LDL"] == 0 and counts["STL"] == 0
    # Softmax step copies: masked (seqlen_k tail, causal or window edges) and unmasked (a
    # sliding window: one loop choosing the copy per block, since its left-edge blocks come
    # last). softcap: one tanh a score of the row (tile_n a thread) in each copy, before the
    # mask.
    tanh = len(re.findall(r"MUFU\.TANH", sass))
    assert tanh == (2 * config.tile_n if config.has_softcap else 0), tanh
    # seqused_k: the load warp zeroes the first visited V tile's keys past seqlen_k with one
    # 16-bit store a column (dv a key) at each of its two sites (that block as the loop's first
    # or as the only one); no 16-bit stores otherwise.
    sts16 = len(re.findall(r"\bSTS\.U16", sass))
    assert sts16 == (2 * dv if config.seqused_k else 0), sts16
    # Packed GQA: Q comes by 5-D TMA boxes (d, G, seqlen, heads, batch), K and V by 4-D ones.
    assert ("UTMALDG.5D" in sass) == bool(config.pack_gqa)
    # The traced pipelines are the docstring's protocol: (stages, producer arrivals, consumer
    # arrivals).
    ctas = 2 if pair else 1  # the pair's S / O empty barriers count both CTAs' threads
    assert kernel.kv_stages == fwd_kv_stages(config)
    assert kernel.q_tiles == q_tiles == config.tile_m // 128
    assert kernel.protocol == {
        "q": (q_tiles, 1, 1),
        "kv": (kernel.kv_stages, 1, 1),
        "s": (q_tiles, 1, 128 * ctas),
        "o": (q_tiles, 1, 128 * ctas),
        "stats": (q_tiles, 128, 128),
        "epi": (q_tiles, 128, 32),
    }
    doc = type(kernel).__doc__
    for name in ("pipeline_q", "pipeline_kv", "pipeline_s_i", "pipeline_o_i", "pipeline_stats_i",
                 "pipeline_epi"):  # fmt: skip
        assert name in doc
