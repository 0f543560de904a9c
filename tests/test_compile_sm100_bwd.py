"""Compile-only checks of the sm100 backward main kernel on the CPU, with a SASS read.

No Blackwell GPU and no simulator exist where this runs: ``FlashAttentionBackwardSm100`` is
cross-compiled for sm_100a (and sm_103a) with the backward protocol's fake tensors
(``bwd_fake_args``) and its cubin is read. What is checked: the
MMAs are tcgen05 (``UTCHMMA``, the count of the class docstring's formula; no ``HMMA`` /
``HGMMA``), S^T / dP^T / dQ / dK / dV leave TMEM by ``LDTM`` and P^T goes back by ``STTM`` (counts
of the step copies), dQ leaves by TMA reduce-adds (``UTMAREDG``, one per 16-column chunk; no
per-element atomics), TMEM is allocated and freed once, the warpgroups re-budget their registers
(``USETMAXREG`` = the support table), one ``MUFU.EX2`` a score (softcap: one ``MUFU.TANH``
too), seqused's tail rows zeroed by the load warp (one ``STS.U16`` loop a tile, TMA loads of
their own), and nothing goes to local memory. The pipeline arrival counts are asserted while
tracing; this file checks the traced protocol against the docstring's table.
``bwd_can_implement`` accepts and rejects with reasons on the CPU without compiling, and the
window's mask bounds are checked against the mask's definition on Python ints.
"""

from __future__ import annotations

import re

import pytest
from cute_fa.blackwell.support import (
    SM100_BWD_DQ_CHUNK,
    SM100_BWD_HEAD_DIMS,
    SM100_BWD_PAIR_HEAD_DIM_PAIRS,
    SM100_BWD_REGS,
    SM100_BWD_TILE,
    TMEM_COLUMNS,
    bwd_can_implement,
    bwd_config,
    bwd_pair_wanted,
    bwd_smem_bytes,
    bwd_tmem_columns,
    bwd_tmem_plan,
)

from cute_fa.config import SMEM_CAPACITY, Sm90BwdTuning, Sm100BwdTuning, Sm100FwdTuning
from cute_fa.dsl.mask import WINDOW_INF, query_block_mask_bounds

EXHAUSTIVE = pytest.mark.exhaustive


def _compile(config):
    """(kernel instance, inspect_cubin's report) of the sm100 backward for ``config``."""
    from cute_fa.blackwell import FlashAttentionBackwardSm100

    from cute_fa.tools.sass import compile_cubin, inspect_cubin

    kernel = FlashAttentionBackwardSm100(config)
    return kernel, inspect_cubin(compile_cubin(config, kernel))


def test_lazy_import_and_support_without_dsl_kernel() -> None:
    import cute_fa.blackwell as bw

    assert "FlashAttentionBackwardSm100" in bw.__all__
    assert bwd_can_implement(bwd_config(128, 128)) == (True, "")


@pytest.mark.parametrize("d", SM100_BWD_HEAD_DIMS)
@pytest.mark.parametrize("target", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"causal": True, "varlen_q": True, "varlen_k": True},
        {"local": True, "has_softcap": True},
        {"causal": True, "has_softcap": True, "seqused_q": True, "seqused_k": True},
        {"local": True, "varlen_q": True, "varlen_k": True, "seqused_k": True},
        {"deterministic": True},
        {"deterministic": True, "causal": True, "varlen_q": True, "varlen_k": True},
    ],
)
def test_sm100_bwd_can_implement_accepts(d: int, target: str, dtype: str, flags: dict) -> None:
    config = bwd_config(d, d, target=target, dtype=dtype, **flags)
    assert bwd_can_implement(config) == (True, "")
    assert bwd_smem_bytes(config) <= SMEM_CAPACITY[target]
    assert bwd_tmem_columns(config.tile_m, d, d) <= TMEM_COLUMNS


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"arch": 90}, "sm90"),
        ({"target": "sm_90a"}, "sm_100a"),
        ({"head_dim": 192, "head_dim_v": 192}, "2-CTA MMA's: 576"),
        ({"head_dim": 192, "head_dim_v": 128}, "one CTA's TMEM plan: 640 columns"),
        ({"head_dim": 256, "head_dim_v": 256}, "head_dim 256"),
        ({"head_dim_v": 64}, "head_dim_v 64"),
        ({"tuning": Sm100BwdTuning(tile_m=64)}, "tile"),
        ({"tuning": Sm100BwdTuning(tile_n=64)}, "tile"),
        ({"tuning": Sm90BwdTuning()}, "Sm100BwdTuning"),
        ({"tuning": Sm100FwdTuning()}, "Sm100BwdTuning"),
        ({"deterministic": True, "det_coresident": True}, "det_coresident"),
    ],
)
def test_sm100_bwd_can_implement_rejects_with_reason(changes: dict, needle: str) -> None:
    ok, reason = bwd_can_implement(bwd_config(128, 128).replace(**changes))
    assert not ok and needle in reason, reason


def test_sm100_bwd_kernel_rejects_at_construction() -> None:
    from cute_fa.blackwell import FlashAttentionBackwardSm100

    with pytest.raises(NotImplementedError, match="det_coresident"):
        FlashAttentionBackwardSm100(bwd_config(128, 128, deterministic=True, det_coresident=True))


def test_sm100_bwd_tmem_plan_and_budget() -> None:
    assert SM100_BWD_TILE == (128, 128, 16)
    tile_m = SM100_BWD_TILE[0]
    for d in SM100_BWD_HEAD_DIMS:
        plan = bwd_tmem_plan(tile_m, d, d)
        # S^T | dP^T (dQ over it) | dV | dK, P^T over S^T; exactly the columns the plan counts.
        assert plan["P"] == plan["S"] == 0 and plan["dQ"] == plan["dP"] == tile_m
        assert plan["dV"] == 2 * tile_m and plan["dK"] == 2 * tile_m + d
        assert plan["total"] == bwd_tmem_columns(tile_m, d, d) <= TMEM_COLUMNS
    assert bwd_tmem_plan(tile_m, 128, 128)["total"] == TMEM_COLUMNS
    with pytest.raises(AssertionError):
        bwd_tmem_plan(tile_m, 192, 128)  # dQ wider than dP^T's columns
    with pytest.raises(AssertionError):
        bwd_tmem_plan(tile_m + 16, 128, 128)  # 544 columns
    compute, dq, other = SM100_BWD_REGS
    assert 128 * (2 * compute + dq + other) <= 65536


def test_sm100_bwd_pair_tmem_plan() -> None:
    """Note [backward TMEM plan]: the columns of every head-dim case, one CTA and the pair."""
    tm = SM100_BWD_TILE[0]
    one = {(64, 64): 384, (96, 96): 448, (128, 128): 512, (192, 128): 640, (192, 192): 704,
           (256, 256): 896}  # fmt: skip
    pair = {(64, 64): 384, (96, 96): 448, (128, 128): 512, (192, 128): 512, (192, 192): 576,
            (256, 256): 704}  # fmt: skip
    for (d, dv), cols in one.items():
        assert bwd_tmem_columns(tm, d, dv) == cols, (d, dv)
        assert bwd_tmem_columns(tm, d, dv, 2) == pair[(d, dv)], (d, dv)
    fits = {k for k, cols in pair.items() if cols <= TMEM_COLUMNS and k[0] >= 128}
    assert fits == set(SM100_BWD_PAIR_HEAD_DIM_PAIRS)
    # d 128: the one-CTA layout; dS^T (16-bit) over dP^T's first half, dQ (64 a CTA) after it.
    assert bwd_tmem_plan(tm, 128, 128, 2) == {
        **bwd_tmem_plan(tm, 128, 128), "shared": 0, "dS": tm, "dQ": tm + 64,
    }  # fmt: skip
    # (192, 128): P^T [0, 64) under S^T [0, 128), dP^T [64, 192) over S^T's second half, dS^T
    # [64, 128) over dP^T, dQ (96) at dP^T's end [96, 192), dV [192, 320), dK [320, 512).
    assert bwd_tmem_plan(tm, 192, 128, 2) == {
        "S": 0, "P": 0, "shared": 64, "dP": 64, "dS": 64, "dQ": 96, "dV": 192, "dK": 320,
        "total": 512,
    }  # fmt: skip
    for d, dv in ((192, 192), (256, 256)):
        with pytest.raises(AssertionError):
            bwd_tmem_plan(tm, d, dv, 2)


def _pair(config):
    return config.replace(tuning=Sm100BwdTuning(cta_pair=True))


@pytest.mark.parametrize(
    "d, dv, needle",
    [
        (128, 128, "planned"),  # TMEM and smem fit; not built
        (192, 128, "shared memory 265216 bytes"),  # TMEM fits; Q, dO, K held twice do not
        (192, 192, "576 columns"),
        (256, 256, "704 columns"),
        (64, 64, "cta_pair at head_dim 64"),
    ],
)
def test_sm100_bwd_cta_pair_declined_with_reason(d: int, dv: int, needle: str) -> None:
    config = _pair(bwd_config(d, dv))
    assert config.tuning.label == "128x128w16_pair" and "pair" in config.name
    ok, reason = bwd_can_implement(config)
    assert not ok and needle in reason, reason
    assert bwd_smem_bytes(_pair(bwd_config(128, 128))) == 216064 <= SMEM_CAPACITY["sm_100a"]


def test_sm100_bwd_dispatch_keeps_one_cta_while_the_pair_is_declined() -> None:
    """FA4's rule (d >= 128 takes its 2-CTA backward) only where the pair implements the call:
    nowhere yet, so planning keeps d 128 on one CTA and declines 192 / 256 to the sm80 kernel."""
    from cute_fa import planning

    for flags in ({}, {"causal": True}, {"varlen_q": True, "varlen_k": True}):
        assert not bwd_pair_wanted(bwd_config(128, 128, **flags))
        config = planning.bwd_config("sm_100a", "bf16", 128, 128, **flags)
        assert config.arch == 100 and not config.tuning.cta_pair
    assert not bwd_pair_wanted(bwd_config(64, 64))
    assert planning.bwd_config("sm_100a", "bf16", 192, 128).arch == 80


@pytest.mark.parametrize("causal, local", [(True, False), (False, True), (False, False)])
def test_query_block_mask_bounds_never_skip_a_needed_mask(causal: bool, local: bool) -> None:
    """The compute warps take the unmasked step for query blocks in [m_no_right, m_left) of a
    key block (``query_block_mask_bounds``, plain arithmetic run here on Python ints): no
    element of such a tile may lie outside the window (Note [bottom-right aligned masks]),
    for random lengths and windows (negative sides and unbounded ones too). The bounds are
    tight but for tiles cut by a length (those mask anyway or need no mask)."""
    import random

    rng = random.Random(5)
    tm = tn = 128
    loose = tiles = 0
    for _ in range(400):
        sq, sk = rng.randint(1, 900), rng.randint(1, 900)
        left, right = (rng.choice([WINDOW_INF, rng.randint(-60, 500)]) for _ in range(2))
        if not local:
            left, right = WINDOW_INF, 0 if causal else WINDOW_INF
        offset = sk - sq
        for n in range(-(-sk // tn)):
            m_no_right, m_left = query_block_mask_bounds(n, sq, sk, left, right, tm, tn, causal,
                                                         local)  # fmt: skip
            for m in range(-(-sq // tm)):
                r0, r1 = m * tm, min((m + 1) * tm, sq) - 1
                k0, k1 = n * tn, min((n + 1) * tn, sk) - 1
                # The window's corners: the first row's last key, the last row's first key.
                cut = k1 > r0 + offset + right or k0 < r1 + offset - left
                unmasked = m_no_right <= m < m_left
                assert not (unmasked and cut), (sq, sk, left, right, n, m)
                tiles += 1
                if not unmasked and not cut:
                    assert (n + 1) * tn > sk or (m + 1) * tm > sq, (sq, sk, left, right, n, m)
                    loose += 1
    assert tiles > 5_000 and loose < tiles // 10


VARLEN = {"varlen_q": True, "varlen_k": True}
SEQUSED = {"seqused_q": True, "seqused_k": True}
WINDOW_SOFTCAP = {"local": True, "has_softcap": True}
# (d, target, flags). Default run: six compiles (d 128; d 96 causal; d 64 fp16 causal varlen;
# d 128 on sm_103a; d 128 window + softcap + seqused; d 128 deterministic); the rest with
# -m exhaustive.
COMPILE_CASES = [
    pytest.param(128, "sm_100a", {}, id="d128"),
    pytest.param(96, "sm_100a", {"causal": True}, id="d96-causal"),
    pytest.param(
        64, "sm_100a", {"dtype": "fp16", "causal": True, **VARLEN}, id="d64-fp16-causal-varlen"
    ),
    pytest.param(128, "sm_103a", {}, id="d128-sm103a"),
    pytest.param(128, "sm_100a", {"causal": True}, id="d128-causal", marks=EXHAUSTIVE),
    pytest.param(128, "sm_100a", VARLEN, id="d128-varlen", marks=EXHAUSTIVE),
    pytest.param(128, "sm_100a", {"dtype": "fp16"}, id="d128-fp16", marks=EXHAUSTIVE),
    pytest.param(96, "sm_100a", {}, id="d96", marks=EXHAUSTIVE),
    pytest.param(64, "sm_100a", {}, id="d64", marks=EXHAUSTIVE),
    pytest.param(64, "sm_103a", {"causal": True}, id="d64-causal-sm103a", marks=EXHAUSTIVE),
    pytest.param(128, "sm_100a", {**WINDOW_SOFTCAP, **SEQUSED}, id="d128-local-softcap-seqused"),
    pytest.param(128, "sm_100a", {"local": True}, id="d128-local", marks=EXHAUSTIVE),
    pytest.param(64, "sm_100a", {"local": True}, id="d64-local", marks=EXHAUSTIVE),
    pytest.param(128, "sm_100a", {"has_softcap": True}, id="d128-softcap", marks=EXHAUSTIVE),
    pytest.param(64, "sm_100a", {"has_softcap": True}, id="d64-softcap", marks=EXHAUSTIVE),
    pytest.param(
        128,
        "sm_100a",
        {"causal": True, "has_softcap": True},
        id="d128-causal-softcap",
        marks=EXHAUSTIVE,
    ),
    pytest.param(
        64,
        "sm_100a",
        {"causal": True, "has_softcap": True},
        id="d64-causal-softcap",
        marks=EXHAUSTIVE,
    ),
    pytest.param(96, "sm_100a", WINDOW_SOFTCAP, id="d96-local-softcap", marks=EXHAUSTIVE),
    pytest.param(
        64,
        "sm_100a",
        {"dtype": "fp16", **WINDOW_SOFTCAP, **VARLEN, **SEQUSED},
        id="d64-fp16-local-softcap-varlen-seqused",
        marks=EXHAUSTIVE,
    ),
    pytest.param(128, "sm_100a", {"seqused_q": True}, id="d128-seqused-q", marks=EXHAUSTIVE),
    pytest.param(
        128,
        "sm_100a",
        {"causal": True, **VARLEN, "seqused_k": True},
        id="d128-causal-varlen-seqused-k",
        marks=EXHAUSTIVE,
    ),
    pytest.param(128, "sm_103a", WINDOW_SOFTCAP, id="d128-local-softcap-sm103a", marks=EXHAUSTIVE),
    pytest.param(
        128,
        "sm_103a",
        {"causal": True, "has_softcap": True, **SEQUSED},
        id="d128-causal-softcap-seqused-sm103a",
        marks=EXHAUSTIVE,
    ),
    pytest.param(
        64, "sm_103a", {"local": True, **SEQUSED}, id="d64-local-seqused-sm103a", marks=EXHAUSTIVE
    ),
    pytest.param(128, "sm_100a", {"deterministic": True}, id="d128-deterministic"),
    pytest.param(
        128,
        "sm_100a",
        {"deterministic": True, "causal": True},
        id="d128-causal-deterministic",
        marks=EXHAUSTIVE,
    ),
    pytest.param(
        64,
        "sm_100a",
        {"deterministic": True, **WINDOW_SOFTCAP, **VARLEN, **SEQUSED},
        id="d64-det-local-softcap-varlen-seqused",
        marks=EXHAUSTIVE,
    ),
    pytest.param(
        96,
        "sm_103a",
        {"deterministic": True, "causal": True},
        id="d96-causal-deterministic-sm103a",
        marks=EXHAUSTIVE,
    ),
]

_SETMAXNREG = re.compile(r"USETMAXREG\.(DEALLOC|TRY_ALLOC)\.CTAPOOL\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+)")


@pytest.mark.compile
@pytest.mark.parametrize("d, target, flags", COMPILE_CASES)
def test_sm100_bwd_compiles(d: int, target: str, flags: dict) -> None:
    config = bwd_config(d, d, target=target, **flags)
    kernel, info = _compile(config)
    counts, sass = info["sass_counts"], info["sass_text"]
    tile_m, tile_n = config.tile_m, config.tile_n
    # tcgen05 MMAs only, the docstring's count: S and dP in the prologue and the loop, dV, dK, dQ
    # in the loop; one instruction a K phase of 16.
    assert counts["HMMA"] == 0 and counts["HGMMA"] == 0
    assert counts["UTCHMMA"] == 2 * (d // 16) + 2 * (d // 16) + 3 * (tile_m // 16)
    # Copies of the compute step: masked and unmasked (a CTA whose keys cut seqlen_k; a window:
    # the blocks that may cut an edge, in the same loop), one (masked) with causal. Per copy:
    # S^T in two 32-column loads, dP^T in two, P^T in one store;
    # the dq warps load dQ in 16-column chunks, the epilogue dK and dV in 32 (d 96: 16).
    copies = 1 if config.causal else 2
    epi_chunk = 32 if (d // 2) % 32 == 0 else 16
    assert counts["STTM"] == copies
    assert counts["LDTM"] == 4 * copies + d // SM100_BWD_DQ_CHUNK + 2 * (d // 2 // epi_chunk)
    # One exponential a score: 64 queries a thread in each copy; softcap one tanh too (its
    # gradient folded into P: no MUFU.LG2, Note [softcap gradient folded into P]).
    assert len(re.findall(r"MUFU\.EX2", sass)) == copies * tile_m // 2
    assert len(re.findall(r"MUFU\.TANH", sass)) == (copies * tile_m // 2) * config.has_softcap
    assert len(re.findall(r"MUFU\.LG2", sass)) == 0
    # TMA loads: K, V, Q, dO (a box per 128-byte swizzle atom, d 96: 64-byte atoms), and
    # seqused the tail tiles' own copies, K and V / Q and dO, each zeroed by one loop of
    # 16-bit stores of the load warp.
    tails = 2 * config.seqused_k + 2 * config.seqused_q
    boxes = d // 64 if d % 64 == 0 else d // 32
    assert counts["UTMALDG"] == boxes * (4 + tails)
    assert len(re.findall(r"STS\.U16", sass)) == tails
    # dQ leaves by TMA reduce-adds, one per chunk; no per-element atomics. Deterministic: dq
    # warp 0's handshake (cute_fa/dsl/turns.py), a strong GPU-scope spin load and one release
    # increment (its MEMBAR.ALL.GPU the only one: no fence.acq_rel); none without.
    assert counts["UTMAREDG"] == d // SM100_BWD_DQ_CHUNK
    assert counts["RED"] == 0 and counts["ATOMG"] == 0
    if config.deterministic:
        assert re.findall(r"\bREDG\S*", sass) == ["REDG.E.ADD.S32.STRONG.GPU"]
        assert len(re.findall(r"\bLDG\.E\.STRONG\.GPU", sass)) >= 1
        assert len(re.findall(r"MEMBAR\.ALL\.GPU", sass)) == 1
    else:
        assert counts["REDG"] == 0
        assert "MEMBAR.ALL.GPU" not in sass and "LDG.E.STRONG" not in sass
    # TMEM allocated (a retry loop: one or more FIND_AND_SET) and freed once.
    assert sass.count("UTCATOMSWS.FIND_AND_SET") >= 1
    assert sass.count("UTCATOMSWS.AND") == 1
    # Registers re-budgeted per warpgroup: compute up, dq and the MMA / load / idle warps down.
    compute, dq, other = SM100_BWD_REGS
    budgets = {(kind, int(value, 16)) for kind, value in _SETMAXNREG.findall(sass)}
    assert budgets == {("DEALLOC", other), ("DEALLOC", dq), ("TRY_ALLOC", compute)}
    assert info["regs"] <= 128  # 512 threads launch
    # Nothing in local memory.
    assert info["stack"] == 0 and info["local"] == 0
    assert counts["LDL"] == 0 and counts["STL"] == 0
    # The traced pipelines are the docstring's protocol: (stages, producer arrivals, consumer
    # arrivals).
    assert tile_n == 128
    assert kernel.protocol == {
        "kv": (1, 1, 1),
        "q": (2, 1, 1),
        "do": (1, 1, 1),
        "lse": (2, 32, 256),
        "s": (1, 1, 256),
        "dp": (1, 1, 256),
        "ds": (1, 256, 1),
        "dq": (1, 1, 128),
        "dkv": (1, 1, 256),
    }
    doc = type(kernel).__doc__
    for name in kernel.protocol:
        assert f"pipeline_{name} " in doc, name
    assert "mbar_tail[0]" in doc and "mbar_tail[1]" in doc


@pytest.mark.compile
def test_cpu_demo_shows_the_sm100_backward(capsys) -> None:
    """``python -m cute_fa demo --cpu --mode bwd --targets sm_100a``: the backward's main
    kernel that an sm_100a GPU dispatches to, compiled, 0 spills."""
    import re

    from cute_fa.tools.demo import _demo_cpu

    assert _demo_cpu(["sm_100a"], [64], "bwd") == 0
    out = capsys.readouterr().out
    for causal in (0, 1):
        row = re.search(rf"sm_100a\s+bwd\s+sm100\s+64\s+{causal}\s+128x128w16\s+\d+\s+\d+K\s+"
                        rf"0\s+0\s+0\s+0\s+(\d+)", out)  # fmt: skip
        assert row and int(row.group(1)) > 0, out  # UTCHMMA


@pytest.mark.compile
def test_sm100_bwd_pair_tmem_footprints_from_the_dsl() -> None:
    """The plan's assumptions about the 2-CTA accumulators, from the DSL's own layouts (traced on
    the CPU, nothing compiled for the GPU): a cta_group::2 MMA of M = 128 (dQ) keeps its 64 rows
    a CTA in 64 lanes for the first N / 2 columns and in lanes 64-127 for the rest, so it takes
    N / 2 columns (d / 2); of M = 256 (S^T, dP^T, dV, dK) 128 lanes x N, as one CTA's M = 128;
    and dK += dS^T Q may take A (dS^T) from TMEM as a 2-CTA MMA."""
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import tcgen05

    mn, k = cute.nvgpu.OperandMajorMode.MN, cute.nvgpu.OperandMajorMode.K
    found = {}

    @cute.jit
    def trace():
        for group, shape in ((tcgen05.CtaGroup.ONE, (128, 128)), (tcgen05.CtaGroup.TWO, (128, 128)),
                             (tcgen05.CtaGroup.TWO, (128, 192)), (tcgen05.CtaGroup.TWO, (256, 128)),
                             (tcgen05.CtaGroup.TWO, (256, 192))):  # fmt: skip
            mma = sm100_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, mn, mn, Float32, group, shape, tcgen05.OperandSource.SMEM
            )
            thr = mma.get_slice(0)
            acc = thr.make_fragment_C(thr.partition_shape_C(shape))
            found[(group == tcgen05.CtaGroup.TWO, shape)] = (
                tcgen05.find_tmem_tensor_col_offset(acc), cute.size(acc.layout, mode=[0, 0])
            )
        ts = sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k, mn, Float32, tcgen05.CtaGroup.TWO, (256, 192),
            tcgen05.OperandSource.TMEM,
        )  # fmt: skip
        found["ts"] = cute.size(ts.thr_id)

    trace()
    assert found[(False, (128, 128))] == (128, 128)
    assert found[(True, (128, 128))] == (64, 64)  # dQ at d128: 64 columns, 64 rows a lane half
    assert found[(True, (128, 192))] == (96, 64)  # (192, 128): 96
    assert found[(True, (256, 128))] == (128, 128) and found[(True, (256, 192))] == (192, 128)
    assert found["ts"] == 2
