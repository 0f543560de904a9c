"""Compile-only checks of the sm90 backward main kernel (FA3 design) on the CPU, with a SASS read.

``FlashAttentionBackwardSm90`` is the backward on sm_90a where it applies
(tests/test_bwd_sm90_gpu.py checks its results on an sm90 GPU); what can be checked here:
``can_implement`` accepts its scope and rejects the rest with a reason, and every config in scope
(d 64 / 96 / 128, no mask / causal, bf16 / fp16, deterministic or not) cross-compiles for sm_90a
to a cubin that holds WGMMA (``HGMMA``, the count of the five GEMMs of a step), TMA loads
(``UTMALDG``), the TMA reduce-adds of dQ (``UTMAREDG``, no per-element ``REDG`` atomics), the
register reallocation of the warp roles (``USETMAXREG``), one ``WARPGROUP.ARRIVE`` per GEMM
group (more means ptxas serialized the WGMMAs), no mma.sync, no spills and no stack; the
deterministic variant adds only producer warp 1's semaphore handshake (a strong spin load, GPU-scope
fences, async-proxy fences and one ``REDG`` increment); with seqused_k, no branch skips the
consumers' KV_TAIL barrier (an aligned bar.sync every consumer thread must reach). Registers
are printed (``pytest -rP``).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile

import pytest
from cute_fa.hopper.support import (
    SM90_BWD_HEAD_DIMS,
    bwd_can_implement,
    bwd_config,
    bwd_default_tuning,
    bwd_dq_transposed,
    bwd_q_stages,
    bwd_smem_bytes,
    bwd_split_d,
)

import cute_fa
from cute_fa import settings
from cute_fa.config import SMEM_CAPACITY, BwdConfig, Sm90BwdTuning, Tiles, TuningError

EXHAUSTIVE = pytest.mark.exhaustive
WG_KEYS = 64  # keys of one consumer warpgroup's score tile


def _config(d: int = 128, dtype: str = "bf16", q_stages: int = 0, **changes) -> BwdConfig:
    """The sm90 backward's key for d (dv = d unless changed) and the flags: the default tuning
    (``bwd_default_tuning``), with ``q_stages``, ``tile_m`` and the step-order fields
    (``dq_by_rows``, ``dq_before_dk``) when given."""
    tuning = changes.pop("tuning", None) or bwd_default_tuning(d, changes.get("has_softcap", False))
    fields = {f: changes.pop(f) for f in ("dq_by_rows", "dq_before_dk", "tile_m") if f in changes}
    fields.update({"q_stages": q_stages} if q_stages else {})
    tuning = dataclasses.replace(tuning, **fields)
    values = dict(arch=90, target="sm_90a", dtype=dtype, head_dim=d, head_dim_v=d, tuning=tuning)
    values.update(changes)
    return BwdConfig(**values)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"arch": 80}, "sm80"),
        ({"target": "sm_100a"}, "sm_90a"),
        ({"head_dim": 80, "head_dim_v": 80}, "head_dim 80"),
        ({"head_dim_v": 96}, "head_dim_v"),
        ({"tuning": Sm90BwdTuning(64, 64)}, "tile_n 64"),
        ({"tuning": Sm90BwdTuning(64, 128), "head_dim": 256, "head_dim_v": 256}, "tile_n 128"),
        ({"tuning": Sm90BwdTuning(96, 128)}, "tile_m 96"),
        ({"tuning": Tiles(64, 128, 8)}, "not an Sm90BwdTuning"),
        ({"tuning": Sm90BwdTuning(64, 64, q_stages=3), "head_dim": 192}, "shared memory"),
        ({"det_coresident": True, "deterministic": True}, "sm80"),
        ({"dq_by_rows": True}, "dq_by_rows with tile_m 64"),  # d 128
        ({"dq_by_rows": True, "d": 64, "has_softcap": True}, "dq_by_rows with tile_m 64"),
        ({"dq_by_rows": True, "d": 96}, "dq_by_rows with tile_m 64"),
        ({"dq_before_dk": True, "d": 192, "head_dim_v": 128}, "split d"),
        ({"dq_before_dk": True, "d": 256}, "split d"),
        # 80 query rows a step (dQ transposed): d 128 only, no softcap, dq_before_dk, three
        # stages or dQ by rows.
        ({"tile_m": 80, "d": 64}, "80 query rows a step run head_dim (128,)"),
        ({"tile_m": 80, "d": 96}, "80 query rows a step run head_dim (128,)"),
        ({"tile_m": 80, "d": 192, "head_dim_v": 128}, "head_dim 192 / head_dim_v 128"),
        ({"tile_m": 80, "head_dim_v": 64}, "head_dim 128 / head_dim_v 64"),
        ({"tile_m": 80, "has_softcap": True}, "softcap"),
        ({"tile_m": 80, "has_softcap": True, "local": True}, "spills"),
        ({"tile_m": 80, "dq_before_dk": True}, "serializes every WGMMA"),
        ({"tile_m": 80, "dq_before_dk": True, "causal": True}, "dq_before_dk"),
        ({"tile_m": 80, "q_stages": 3}, "q_stages 3"),
        ({"tile_m": 80, "dq_by_rows": True}, "dq_by_rows with tile_m 80"),
    ],
)
def test_sm90_bwd_can_implement_rejects_with_reason(changes: dict, needle: str) -> None:
    ok, reason = bwd_can_implement(_config(**changes))
    assert not ok and needle in reason, reason


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", SM90_BWD_HEAD_DIMS)
def test_sm90_bwd_can_implement_accepts(d: int, dtype: str, causal: bool, deterministic) -> None:
    config = _config(d, dtype, causal=causal, deterministic=deterministic)
    assert bwd_can_implement(config) == (True, "")
    assert bwd_smem_bytes(config) <= SMEM_CAPACITY["sm_90a"]
    # The key planning builds is this one.
    assert bwd_config(config) == config


@pytest.mark.parametrize(
    "flags",
    [{}, {"causal": True}, {"local": True}, {"deterministic": True}, {"dtype": "fp16"},
     {"causal": True, **{f: True for f in ("varlen_q", "varlen_k", "seqused_q", "seqused_k")}},
     {"local": True, "deterministic": True, "varlen_q": True, "varlen_k": True}],
)  # fmt: skip
def test_sm90_bwd_tile_m_80_accepts(flags: dict) -> None:
    """80 query rows a step at d 128 (dQ computed transposed): accepted with every mask and
    flag but softcap; the shared memory fits sm_90a (231,680 bytes counted of 232,448); the key
    planning builds for the override is this one, with the base step order."""
    config = _config(128, tile_m=80, **flags)
    assert bwd_can_implement(config) == (True, "")
    assert bwd_dq_transposed(config) and not bwd_dq_transposed(_config(128, **flags))
    assert bwd_smem_bytes(config) == 231_680 <= SMEM_CAPACITY["sm_90a"]
    assert bwd_config(config, {"tile_m": 80}) == config
    assert not config.tuning.dq_by_rows and not config.tuning.dq_before_dk
    assert config.name.split("_d128_")[1].startswith("80x128w12")


def test_sm90_bwd_kernel_rejects_at_construction() -> None:
    from cute_fa.hopper.flash_bwd import FlashAttentionBackwardSm90

    with pytest.raises(NotImplementedError, match="head_dim 80"):
        FlashAttentionBackwardSm90(_config(80, head_dim_v=80))


def _compile(config: BwdConfig) -> dict:
    import cutlass.cute as cute
    from cute_fa.hopper.flash_bwd import FlashAttentionBackwardSm90

    from cute_fa.dsl.fake import bwd_fake_args
    from cute_fa.tools.sass import inspect_cubin

    with tempfile.TemporaryDirectory(prefix="cute-fa-cubin-") as d:
        compiled = cute.compile(
            FlashAttentionBackwardSm90(config),
            *bwd_fake_args(config),
            options=f"--gpu-arch {config.target} --keep-cubin --dump-dir {d}",
        )
        cubin = compiled.__cubin__
    assert cubin, "the DSL kept no cubin"
    return inspect_cubin(cubin if isinstance(cubin, bytes) else cubin.encode("latin-1"))


# (d, dtype, causal, deterministic, flags). Unmarked cases run by default: d 64 (128 query rows
# a step), d 128 causal, deterministic, local with softcap, (192, 128) split d, d 256 with a
# window, varlen and seqused, three Q / dO stages.
VARLEN = {"varlen_q": True, "varlen_k": True}
SEQUSED = {"seqused_q": True, "seqused_k": True}
ROWS = {"dq_by_rows": True}
FIRST = {"dq_before_dk": True}
M80 = {"tile_m": 80}
COMPILE_CASES = [
    pytest.param(64, "bf16", False, False, {}, id="d64"),
    pytest.param(64, "bf16", True, False, {}, id="d64-causal", marks=EXHAUSTIVE),
    pytest.param(96, "bf16", False, False, {}, id="d96", marks=EXHAUSTIVE),
    pytest.param(96, "bf16", True, True, {}, id="d96-causal-det", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", False, False, {}, id="d128", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", True, False, {}, id="d128-causal"),
    pytest.param(128, "fp16", True, False, {}, id="d128-fp16-causal", marks=EXHAUSTIVE),
    pytest.param(64, "bf16", False, True, {}, id="d64-det", marks=EXHAUSTIVE),
    pytest.param(64, "bf16", True, True, {}, id="d64-causal-det", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", False, True, {}, id="d128-det", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", True, True, {}, id="d128-causal-det", marks=EXHAUSTIVE),
    pytest.param(192, "bf16", False, False, {}, id="d192", marks=EXHAUSTIVE),
    pytest.param(
        192, "bf16", True, False, {"has_softcap": True}, id="d192-causal-softcap", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(192, "bf16", False, False, {"head_dim_v": 128}, id="d192-dv128"),
    pytest.param(128, "bf16", True, False, {"head_dim_v": 64}, id="d128-dv64-causal"),
    pytest.param(
        128, "bf16", False, True, {"head_dim_v": 64, **VARLEN}, id="d128-dv64-det", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        192,
        "fp16",
        False,
        True,
        {"head_dim_v": 128, "local": True},
        id="d192-dv128-det",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(256, "bf16", False, False, {}, id="d256", marks=EXHAUSTIVE),
    pytest.param(
        256, "bf16", True, False, {"has_softcap": True}, id="d256-causal-softcap", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(256, "fp16", True, True, {}, id="d256-fp16-causal-det", marks=EXHAUSTIVE),
    pytest.param(
        256,
        "bf16",
        False,
        False,
        {"local": True, **VARLEN, **SEQUSED},
        id="d256-local-varlen-seqused",
    ),  # fmt: skip
    pytest.param(128, "bf16", False, False, {"local": True}, id="d128-local", marks=EXHAUSTIVE),
    pytest.param(64, "bf16", False, True, {"local": True}, id="d64-local-det", marks=EXHAUSTIVE),
    pytest.param(
        64, "bf16", True, False, {"has_softcap": True}, id="d64-causal-softcap", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        128, "bf16", False, False, {"has_softcap": True}, id="d128-softcap", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        128, "bf16", False, True, {"local": True, "has_softcap": True}, id="d128-local-softcap-det"
    ),  # fmt: skip
    pytest.param(128, "bf16", True, False, VARLEN, id="d128-causal-varlen", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", False, True, VARLEN, id="d128-varlen-det", marks=EXHAUSTIVE),
    pytest.param(
        128,
        "bf16",
        True,
        False,
        {**VARLEN, **SEQUSED},
        id="d128-causal-varlen-seqused",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(64, "bf16", False, False, {**VARLEN, "seqused_k": True}, id="d64-varlen-seqk"),
    # Three Q / dO stages (the q_stages tuning field) where they fit.
    pytest.param(128, "bf16", False, False, {"q_stages": 3}, id="d128-q3"),
    pytest.param(
        128, "bf16", True, True, {"q_stages": 3}, id="d128-causal-det-q3", marks=EXHAUSTIVE
    ),  # fmt: skip
    # dQ by rows (d 64, 128 query rows) and dQ issued before dK (d <= 128), the tuning fields
    # dq_by_rows / dq_before_dk, alone and together.
    pytest.param(64, "bf16", False, False, ROWS, id="d64-rows"),
    pytest.param(64, "bf16", True, False, ROWS, id="d64-causal-rows", marks=EXHAUSTIVE),
    pytest.param(64, "bf16", False, True, {"local": True, **ROWS}, id="d64-local-det-rows",
                 marks=EXHAUSTIVE),
    pytest.param(64, "bf16", False, False, {**VARLEN, **SEQUSED, **ROWS},
                 id="d64-varlen-seqused-rows", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", False, False, FIRST, id="d128-first"),
    pytest.param(128, "bf16", True, False, FIRST, id="d128-causal-first", marks=EXHAUSTIVE),
    pytest.param(64, "bf16", False, False, FIRST, id="d64-first", marks=EXHAUSTIVE),
    pytest.param(96, "bf16", True, True, FIRST, id="d96-causal-det-first", marks=EXHAUSTIVE),
    pytest.param(64, "bf16", True, False, {"has_softcap": True, **FIRST},
                 id="d64-causal-softcap-first", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", False, True, {"local": True, "has_softcap": True, **FIRST},
                 id="d128-local-softcap-det-first", marks=EXHAUSTIVE),
    pytest.param(128, "fp16", True, False, {**VARLEN, **SEQUSED, **FIRST},
                 id="d128-fp16-causal-varlen-seqused-first", marks=EXHAUSTIVE),
    pytest.param(64, "bf16", False, False, {**ROWS, **FIRST}, id="d64-rows-first",
                 marks=EXHAUSTIVE),
    pytest.param(64, "bf16", True, True, {**ROWS, **FIRST}, id="d64-causal-det-rows-first"),
    # 80 query rows a step at d 128, dQ computed transposed (tile_m 80).
    pytest.param(128, "bf16", False, False, M80, id="d128-m80"),
    pytest.param(128, "bf16", True, False, M80, id="d128-causal-m80", marks=EXHAUSTIVE),
    pytest.param(128, "fp16", True, True, M80, id="d128-fp16-causal-det-m80", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", False, True, M80, id="d128-det-m80", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", False, False, {"local": True, **M80}, id="d128-local-m80",
                 marks=EXHAUSTIVE),
    pytest.param(128, "bf16", False, False, {**VARLEN, **M80}, id="d128-varlen-m80",
                 marks=EXHAUSTIVE),
    pytest.param(128, "bf16", True, False, {**VARLEN, **SEQUSED, **M80},
                 id="d128-causal-varlen-seqused-m80"),
    pytest.param(128, "bf16", False, True, {"local": True, **VARLEN, **SEQUSED, **M80},
                 id="d128-local-det-varlen-seqused-m80", marks=EXHAUSTIVE),
]  # fmt: skip


@pytest.mark.compile
@pytest.mark.parametrize("d, dtype, causal, deterministic, flags", COMPILE_CASES)
def test_sm90_bwd_compiles_for_sm90a(d: int, dtype: str, causal: bool, deterministic, flags):
    config = _config(d, dtype, causal=causal, deterministic=deterministic, **flags)
    _check_sass(config, _compile(config))


def _check_sass(config: BwdConfig, info: dict) -> None:
    """The SASS facts of the module docstring for the main kernel of ``config``."""
    d, causal, deterministic = config.head_dim, config.causal, config.deterministic
    counts, sass = info["sass_counts"], info["sass_text"]
    spills = counts["LDL"] + counts["STL"]
    top = max(int(r) for r in re.findall(r"\bR(\d+)\b", sass))  # the consumers' highest
    print(
        f"{config.name}: regs {info['regs']} (highest R{top}) stack {info['stack']} HGMMA "
        f"{counts['HGMMA']} UTMALDG {counts['UTMALDG']} spills {spills} smem "
        f"{bwd_smem_bytes(config)}"
    )
    # Step bodies: causal and local mask every query block (1 body), otherwise a masked and an
    # unmasked body. Per body: S^T and dP^T (d / 16 WGMMAs of k = 16 each), dV and dK
    # (tile_m / 16), the consumer's d / 2 columns of dQ over all tile_n keys (tile_n / 16).
    bodies = 1 if causal or config.local else 2
    dv = config.head_dim_v  # dP^T has k = dv
    # dQ's M is tile_m: tile_m / 64 WGMMA atoms (d 64: 128 rows, two); dq_by_rows: a
    # consumer's 64 rows (one atom) of all d columns; transposed (tile_m 80): M is the
    # consumer's d / 2 columns (one atom at d 128), N the tile_m rows.
    rows, first = config.tuning.dq_by_rows, config.tuning.dq_before_dk
    dq_rows, dq_cols = (config.tile_m // 2, d) if rows else (config.tile_m, d // 2)
    dq_t = bwd_dq_transposed(config)
    dq_m, dq_n = (dq_cols, dq_rows) if dq_t else (dq_rows, dq_cols)
    dq_per_body = dq_m // 64 * config.tile_n // 16
    per_body = d // 16 + dv // 16 + 2 * (config.tile_m // 16) + dq_per_body
    assert counts["HGMMA"] == bodies * per_body, "HGMMA count"
    # The dQ WGMMAs (the only SS ones with an operand transposed: B, or A when dQ is computed
    # transposed): m64 n(dq_n) k16.
    tnsp = "tnspA" if dq_t else "tnspB"
    dq_shapes = re.findall(rf"HGMMA\.64x(\d+)x16\.F32\S* R\d+, gdesc\[UR\d+\]\.{tnsp}", sass)
    assert dq_shapes == [str(dq_n)] * (bodies * dq_per_body), "dQ WGMMA shape / count"
    if dq_t:
        # S^T and dP^T are m64 n(tile_m); nothing else but the dQ WGMMAs transposes A.
        sdp = re.findall(r"HGMMA\.64x(\d+)x16\.F32\S* R\d+, gdesc\[UR\d+\], ", sass)
        assert sdp == [str(config.tile_m)] * (bodies * (d + dv) // 16), "S^T / dP^T shape"
        assert len(re.findall(r"\.tnspA", sass)) == bodies * dq_per_body
    # One warpgroup.arrive per GEMM group (dq_before_dk: dK, issued right behind dQ with no
    # register written in between, needs none of its own).
    assert sass.count("WARPGROUP.ARRIVE") == 4 * bodies, "WGMMAs serialized by ptxas"
    _check_step_order(sass, first, dq_rows * dq_cols // 128 // 2, bodies)
    assert counts["UTMALDG"] > 0, "no TMA load (UTMALDG) in the SASS"
    assert counts["HMMA"] == 0 and counts["LDGSTS"] == 0
    # One exp2 per score (64 keys x tile_m query rows over 128 threads) in each body. dQ leaves
    # through smem: one TMA reduce-add per 32-column (128-byte swizzle) box of each consumer's
    # (tile_m, d / 2) half (dq_by_rows: (tile_m / 2, d)), issued by producer warp 1 (once, not
    # per body); no atomics. The box is the swizzle atom's width: 32 fp32 columns (128 bytes)
    # when the part's columns are a multiple of 32, else 16 (64 bytes: d 96).
    exps = WG_KEYS * config.tile_m // 128  # a thread's scores of its consumer's tile
    assert len(re.findall(r"MUFU\.EX2", sass)) == bodies * exps
    # softcap: one tanh per score before the exponential.
    assert len(re.findall(r"MUFU\.TANH", sass)) == (bodies * exps if config.has_softcap else 0)
    box = 32 if dq_cols % 32 == 0 else 16
    assert len(re.findall(r"UTMAREDG\S*\.ADD", sass)) == 2 * dq_cols // box
    assert len(re.findall(r"\bATOMG", sass)) == 0
    if deterministic:
        # Warp 1's turn (hopper/flash_bwd.py, docstring: deterministic dQ): the semaphore spin
        # (acquire loads: strong GPU-scope loads), async-proxy fences of global memory after the
        # acquire and after the reduce-adds completed, and one integer REDG, the increment with
        # release semantics (its MEMBAR.ALL.GPU: the only one, no fence.acq_rel); no float
        # atomics.
        assert re.findall(r"\bREDG\S*", sass) == ["REDG.E.ADD.S32.STRONG.GPU"]
        assert len(re.findall(r"\bLDG\.E\.STRONG\.GPU", sass)) >= 1
        assert len(re.findall(r"MEMBAR\.ALL\.GPU", sass)) == 1
        assert len(re.findall(r"FENCE\.VIEW\.ASYNC\.G\b", sass)) == 2
    else:
        assert len(re.findall(r"\bREDG", sass)) == 0
        assert "MEMBAR.ALL.GPU" not in sass and "LDG.E.STRONG" not in sass
    # dS^T to smem by stmatrix (x4, transposed: 8 of the 32 dS values of a thread each), no
    # 16-bit element stores (seqused: the zeros of the tail rows past seqused are such stores,
    # once per CTA or tail block). Split d (d > 128): consumer 0 also stores P^T to sP,
    # consumer 1 loads P^T back by ldmatrix, and after DS_READY both load dS^T (one site).
    split = bwd_split_d(d)
    tiles = 2 if split else 1
    assert len(re.findall(r"\bSTSM", sass)) == bodies * tiles * config.tile_m // 16
    assert len(re.findall(r"\bLDSM", sass)) == (bodies * 2 * config.tile_m // 16 if split else 0)
    if not (config.seqused_q or config.seqused_k):
        assert "STS.U16" not in sass
    # dQ to sdQ: 8-byte stores of column pairs, or (transposed) 4-byte stores, a thread's pairs
    # being two rows of one column: dq_rows x dq_cols / 128 values a thread and body. The other
    # 4-byte stores are producer warp 0's LSE / delta rows (2 a pass of 32 rows: tile_m 80,
    # three passes), the epilogue's 16-bit pairs of dK and dV (d / 4 + dv / 4 a thread) and
    # the seqused zeros.
    dq_values = bodies * dq_rows * dq_cols // 128
    plain = len(re.findall(r"\bSTS (?=\[)", sass))
    if dq_t:
        assert len(re.findall(r"\bSTS\.64", sass)) == 0
        others = 2 * -(-config.tile_m // 32) + (d + dv) // 4
        assert plain == dq_values + others or config.seqused_q or config.seqused_k, plain
    else:
        assert len(re.findall(r"\bSTS\.64", sass)) >= dq_values // 2
    # DS_READY (barrier 3, 256 threads) is one aligned bar.sync a step body, reached by both
    # consumers at that instruction (split d: after the consumers' branches join), and one
    # before the epilogue. A copy per branch is what synccheck reports as "divergent thread(s)
    # in block". Which body runs is the CTA's choice (not each consumer's): not visible here.
    ds_ready = re.findall(r"BAR\.SYNC\S*\s+0x3,\s*0x100\b", sass)
    assert len(ds_ready) == bodies + 1, ds_ready
    if config.seqused_k:
        _check_kv_tail_barrier_unconditional(sass)
    assert spills == 0 and info["stack"] == 0 and info["local"] == 0
    # 384 threads launch at <= 168 registers; setmaxnreg moves them to 24 / 240.
    assert info["regs"] <= 168
    assert re.search(r"USETMAXREG\.DEALLOC\S*\s+0x18\b", sass), "producer setmaxnreg.dec 24"
    assert re.search(r"USETMAXREG\.TRY_ALLOC\S*\s+\S+,\s*0xf0\b", sass), (
        "consumer setmaxnreg.inc 240"
    )


def _check_step_order(sass: str, dq_before_dk: bool, dq_stores: int, bodies: int) -> None:
    """The order of the GEMM groups in each step body, and where the dQ tile goes to sdQ
    (``dq_stores`` 8-byte STS a thread). Runs of HGMMA by kind: SS (S^T, dP^T), RS (dV, dK: A
    from registers), DQ (SS with B transposed). By default a body is SS, RS (dV and dK), DQ,
    and dQ is written after the last WGMMA completed (no STS.64 between the dQ WGMMAs and the
    next wait_group 0); dq_before_dk: SS, RS (dV), DQ, RS (dK), and the dQ stores lie between
    the dK WGMMAs and the wait for them (dQ written while dK runs)."""
    lines = [m.group(2) for m in _LINE.finditer(sass)]
    runs: list[tuple[str, int]] = []  # (kind, index of its last HGMMA)
    for i, op in enumerate(lines):
        if not op.startswith("HGMMA"):
            continue
        kind = "RS" if re.match(r"HGMMA\S+ R\d+, R\d+,", op) else "SS"
        kind = "DQ" if kind == "SS" and (".tnspB" in op or ".tnspA" in op) else kind
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, i)
        else:
            runs.append((kind, i))
    pattern = ["SS", "RS", "DQ", "RS"] if dq_before_dk else ["SS", "RS", "DQ"]
    assert [k for k, _ in runs] == pattern * bodies, [k for k, _ in runs]

    def stores_before_wait_all(start: int) -> int:
        end = next(i for i in range(start, len(lines))
                   if lines[i].startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"))  # fmt: skip
        return sum(1 for op in lines[start:end] if re.match(r"(@!?P\d+ )?STS\.64\b", op))

    after = "RS" if dq_before_dk else "DQ"
    for b in range(bodies):
        (kind, last) = runs[(b + 1) * len(pattern) - 1]
        assert kind == after
        assert stores_before_wait_all(last) == (dq_stores if dq_before_dk else 0), (b, kind)


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):", re.M)


def _kv_tail_region(sass: str) -> tuple[list[tuple[int, str]], tuple[int, str], int]:
    """(the instructions from the consumers' K / V wait up to the KV_TAIL barrier, (address,
    text) of the barrier, the address of the kernel's last EXIT), labels resolved to addresses
    in branch texts. The wait is the first mbarrier try-wait after the consumers' setmaxnreg.inc,
    the barrier the first BAR.SYNC after it (hopper/flash_bwd.py ``zero_kv_tail``)."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in _LINE.finditer(sass)]
    labels = {}
    for m in _LABEL.finditer(sass):
        after = _LINE.search(sass, m.end())
        labels[m.group(1)] = int(after.group(1), 16) if after else 1 << 62
    lines = [
        (a, re.sub(r"`\((\.L_x_\d+)\)", lambda m: f"0x{labels[m.group(1)]:x}", op))
        for a, op in lines
    ]
    start = next(i for i, (_, op) in enumerate(lines) if op.startswith("USETMAXREG.TRY_ALLOC"))
    wait = next(i for i in range(start, len(lines)) if "TRYWAIT" in lines[i][1])
    bar = next(i for i in range(wait, len(lines)) if lines[i][1].startswith("BAR.SYNC"))
    last_exit = max(a for a, op in lines if re.match(r"(@!?U?P\w+\s+)?EXIT\b", op))
    return lines[wait:bar], lines[bar], last_exit


def _check_kv_tail_barrier_unconditional(sass: str) -> None:
    """seqused_k: every consumer thread reaches the KV_TAIL barrier (an aligned bar.sync) at
    the same instruction: it is not predicated, and no branch between the K / V wait and it
    jumps past it, other than into an out-of-line block after the kernel's last EXIT (the
    try-wait's retry, which comes back). The defect this catches: the barrier sat under
    ``if keys_left < 64`` on the per-thread load of seqused_k[b], and a consumer whose keys
    did not cut seqlen_k branched over it (``@P0 BRA`` to the instruction after it)."""
    region, (bar_addr, bar), last_exit = _kv_tail_region(sass)
    # Its own id (8 + consumer, a register; split d: 8) and 128 threads (split d: 256).
    assert re.fullmatch(r"BAR\.SYNC\S*\s+(R\d+|0x8), 0x(80|100)", bar), bar
    for addr, op in region:
        m = re.search(r"\bBRA\b.*\b0x([0-9a-f]+)$", op)
        if m:
            target = int(m.group(1), 16)
            assert target <= bar_addr or target > last_exit, (
                f"/*{addr:04x}*/ {op} skips the KV_TAIL barrier /*{bar_addr:04x}*/ {bar}"
            )


@pytest.mark.compile
def test_compiles_through_the_backward_path(monkeypatch) -> None:
    """CUTE_FA_BWD_ARCH=90: the torch side's compile key and compile function reach the sm90
    main kernel (and keep the sm80 pre/postprocess): the cubin inside the TVM-FFI function
    holds FlashAttentionBackwardSm90 with the SASS facts of the direct compile above."""
    from cute_fa.compile import compile_bwd
    from cute_fa.planning import bwd_config as plan_bwd_config
    from cute_fa.planning import bwd_kernel_classes

    monkeypatch.setenv(settings.BWD_ARCH, "90")
    config = plan_bwd_config("sm_90a", "bf16", 64, 64, causal=True)
    pre_cls, main_cls, post_cls = bwd_kernel_classes(config.arch)
    assert main_cls.__name__ == "FlashAttentionBackwardSm90"
    assert pre_cls.arch == 80 and post_cls.arch == 80
    info = _cubin_of_tvm_ffi(compile_bwd(config))
    assert "FlashAttentionBackwardSm90" in info["kernel"], info["kernel"]
    _check_sass(config, info)


def _cubin_of_tvm_ffi(compiled) -> dict:
    """``inspect_cubin`` of the device code in a TVM-FFI compiled function: its exported object
    file embeds the cubin as an ELF image of machine EM_CUDA (190), cut here at the end of its
    last section or header table."""
    import struct

    from cute_fa.tools.sass import inspect_cubin

    with tempfile.TemporaryDirectory(prefix="cute-fa-export-") as d:
        path = f"{d}/module.o"
        compiled.export_to_c(path, function_name="bwd")
        with open(path, "rb") as f:
            obj = f.read()
    start = obj.find(b"\x7fELF", 1)
    while start >= 0 and struct.unpack_from("<H", obj, start + 0x12)[0] != 190:
        start = obj.find(b"\x7fELF", start + 1)
    assert start >= 0, "no cubin in the exported object file"
    phoff, shoff = struct.unpack_from("<QQ", obj, start + 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", obj, start + 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(shnum):
        header = start + shoff + i * shentsize
        (kind,) = struct.unpack_from("<I", obj, header + 4)
        offset, size = struct.unpack_from("<QQ", obj, header + 0x18)
        if kind != 8:  # SHT_NOBITS takes no room in the file
            end = max(end, offset + size)
    return inspect_cubin(obj[start : start + end])


def test_sm90_bwd_q_stages_tuning() -> None:
    """The q_stages tuning field: three stages where they fit in shared memory (d96, d128, d64
    at 64 rows), elsewhere the kernel declines the key and planning hands the call to the sm80
    kernel; part of the compile key; bad values raise TuningError."""
    from cute_fa.planning import bwd_config as plan_bwd_config

    assert bwd_config(_config(128)) == _config(128)  # the default: two stages
    assert bwd_q_stages(_config(128)) == 2 and bwd_q_stages(_config(256)) == 1
    for d, fits in ((64, False), (96, True), (128, True), (192, False), (256, False)):
        config = bwd_config(_config(d), {"q_stages": 3})
        assert bwd_q_stages(config) == 3 and "_q3" in config.name
        assert (bwd_smem_bytes(config) <= SMEM_CAPACITY["sm_90a"]) == fits, d
        ok, reason = bwd_can_implement(config)
        assert ok == fits and (fits or "shared memory" in reason), (d, reason)
        with cute_fa.tuning(sm90_bwd={"q_stages": 3}):
            planned = plan_bwd_config("sm_90a", "bf16", d, d)
        assert planned.arch == (90 if fits else 80), d
        assert planned == config or not fits
    # d 64 at 64 query rows holds three stages.
    config = bwd_config(_config(64), {"q_stages": 3, "tile_m": 64})
    assert bwd_can_implement(config) == (True, "")
    # Two stages do not fit at d 256.
    ok, reason = bwd_can_implement(bwd_config(_config(256), {"q_stages": 2}))
    assert not ok and "shared memory" in reason
    for bad in (4, -1, "three"):
        with pytest.raises(TuningError, match="q_stages"):
            Sm90BwdTuning(q_stages=bad)
        with pytest.raises(TuningError, match="q_stages"):
            with cute_fa.tuning(sm90_bwd={"q_stages": bad}):
                plan_bwd_config("sm_90a", "bf16", 128, 128)


def test_sm90_bwd_step_order_tuning() -> None:
    """The step-order fields dq_by_rows (d 64 at 128 query rows only) and dq_before_dk (d <= 128,
    no split d): part of the compile key and its name, set by overrides and by the bench's
    ``family.field=value`` form; where the kernel cannot run them it declines the key and
    planning hands the call to the sm80 kernel; not bools: TuningError. By default both are on
    at d 64 with 128 query rows and off elsewhere; a field not asked follows the tile asked."""
    from cute_fa import tuned
    from cute_fa.planning import bwd_config as plan_bwd_config

    assert _config(64).tuning.dq_by_rows and _config(64).tuning.dq_before_dk
    assert plan_bwd_config("sm_90a", "bf16", 64, 64).name.endswith("_128x128w12_dqrows_dqfirst")
    for d in (96, 128, 192, 256):
        assert not _config(d).tuning.dq_by_rows and not _config(d).tuning.dq_before_dk, d
    # d 64 asked for 64 query rows, or with softcap (64 rows by default): both off.
    for tuning in (bwd_config(_config(64), {"tile_m": 64}).tuning,
                   _config(64, has_softcap=True).tuning):  # fmt: skip
        assert tuning.tile_m == 64 and not tuning.dq_by_rows and not tuning.dq_before_dk
    rows = {"dq_by_rows": True, "dq_before_dk": False}
    first = {"dq_by_rows": False, "dq_before_dk": True}
    for fields, label in (
        ({"dq_by_rows": False, "dq_before_dk": False}, ""),
        (rows, "_dqrows"),
        (first, "_dqfirst"),
        ({"dq_by_rows": True, "dq_before_dk": True}, "_dqrows_dqfirst"),
    ):
        config = bwd_config(_config(64), fields)
        assert config.name.endswith(f"_128x128w12{label}"), config.name
        assert bwd_can_implement(config) == (True, "")
        with cute_fa.tuning(sm90_bwd=fields):
            assert plan_bwd_config("sm_90a", "bf16", 64, 64) == config
    for d, rows_ok, first_ok in ((64, True, True), (96, False, True), (128, False, True),
                                 (192, False, False), (256, False, False)):  # fmt: skip
        for field, ok in (("dq_by_rows", rows_ok), ("dq_before_dk", first_ok)):
            assert bwd_can_implement(bwd_config(_config(d), {field: True}))[0] == ok, (d, field)
            with cute_fa.tuning(sm90_bwd={field: True}):
                assert plan_bwd_config("sm_90a", "bf16", d, d).arch == (90 if ok else 80)
    # d 64 with softcap steps 64 query rows: no dQ by rows.
    ok, reason = bwd_can_implement(bwd_config(_config(64, has_softcap=True), {"dq_by_rows": True}))
    assert not ok and "tile_m 64" in reason
    assert tuned.parse_assignment("sm90_bwd.dq_by_rows=true") == ("sm90_bwd", "dq_by_rows", True)
    for bad in (1, "rows"):
        with pytest.raises(TuningError, match="dq_by_rows"):
            Sm90BwdTuning(dq_by_rows=bad)
        with pytest.raises(TuningError, match="dq_before_dk"):
            Sm90BwdTuning(dq_before_dk=bad)


def test_sm90_bwd_tile_m_80_tuning() -> None:
    """tile_m 80 (dQ computed transposed) as an override and as the bench's variant
    ``cute_fa:sm90_bwd.tile_m=80``: planned on the sm90 kernel at d 128, causal or not (the base
    step order; not a default), part of the compile key's name; where the kernel declines it
    (other head dims, softcap) planning hands the call to the sm80 kernel."""
    from cute_fa import tuned
    from cute_fa.planning import bwd_config as plan_bwd_config
    from cute_fa.tools import bench

    assert plan_bwd_config("sm_90a", "bf16", 128, 128).tile_m == 64  # the default stays
    assert tuned.parse_assignment("sm90_bwd.tile_m=80") == ("sm90_bwd", "tile_m", 80)
    peers = "cute_fa,cute_fa:sm90_bwd.tile_m=80,fa4"
    assert bench._name_list(peers) == peers.split(",")
    settings_ = bench.split_impl("cute_fa:sm90_bwd.tile_m=80")[1]
    for causal in (False, True):
        with bench.variant_context(settings_):
            config = plan_bwd_config("sm_90a", "bf16", 128, 128, causal=causal)
        assert config.arch == 90 and config.tile_m == 80 and bwd_dq_transposed(config)
        assert "_80x128w12" in config.name and config == _config(128, tile_m=80, causal=causal)
        with cute_fa.tuning(sm90_bwd={"tile_m": 80}):
            assert plan_bwd_config("sm_90a", "bf16", 128, 128, causal=causal) == config
    with cute_fa.tuning(sm90_bwd={"tile_m": 80}):
        for d in (64, 96, 192, 256):
            assert plan_bwd_config("sm_90a", "bf16", d, d).arch == 80, d
        assert plan_bwd_config("sm_90a", "bf16", 128, 128, has_softcap=True).arch == 80


@pytest.mark.parametrize(
    "fields, needle",
    [({"tile_m": 72}, "tile_m"), ({"tile_n": 0}, "tile_n"), ({"tile_n": 512}, "tile_n"),
     ({"tile_m": "64"}, "tile_m")],
)  # fmt: skip
def test_sm90_bwd_tuning_rejects_malformed_values(fields: dict, needle: str) -> None:
    with pytest.raises(TuningError, match=needle):
        Sm90BwdTuning(**fields)
