"""Compile-only checks of the sm90 forward kernel (FA3 design) on the CPU, with a SASS read.

What can be checked of ``FlashAttentionForwardSm90`` without a GPU (tests/test_fwd_gpu.py
checks its results on one): it cross-compiles for sm_90a, the cubin holds WGMMA
(``HGMMA``) and TMA loads (``UTMALDG``) and no mma.sync, nothing spills (no ``LDL``/``STL``, no
stack), the register reallocation took effect (``USETMAXREG`` down to the producer budget and up
to the consumer budget, no ptxas warning about it), and ``can_implement`` rejects what the
kernel does not do yet, with its reason. Every head-dim pair and mask kind is compiled at least
once; the three-consumer tile (192 query rows, d 64) with and without causal and varlen.
"""

from __future__ import annotations

import re

import pytest
from cute_fa.dispatch import (
    FWD_ARCH_ENV,
    SM90_FWD,
    FwdRequest,
    fwd_kernel_class,
    fwd_kernel_classes,
    fwd_plan,
)
from cute_fa.hopper.support import (
    DEFER_RESCALE_ENV,
    EXP2_POLY_ENV,
    KV_STAGES_ENV,
    OVERLAP_ENV,
    PERSISTENT_ENV,
    PINGPONG_ENV,
    RESCALE_THRESHOLD_ENV,
    SM90_FWD_3WG_MAX_TILE_N,
    SM90_FWD_HEAD_DIM_PAIRS,
    SM90_FWD_REGS,
    SM90_FWD_TILE,
    SM90_FWD_TILE_M_3WG,
    TILE_M_ENV,
    TILE_N_ENV,
    TMA_STORE_ENV,
    fwd_can_implement,
    fwd_kv_stages,
    fwd_num_consumers,
    fwd_smem_bytes,
    fwd_tile,
    fwd_tuned,
)
from cute_fa.sass import compile_and_inspect

from cute_fa.config import SMEM_CAPACITY, FwdConfig, SettingError


def _config(**changes) -> FwdConfig:
    tile_m, tile_n, num_warps = SM90_FWD_TILE
    values = dict(
        arch=90, target="sm_90a", dtype="bf16", head_dim=128, head_dim_v=128,
        tile_m=tile_m, tile_n=tile_n, num_warps=num_warps,
    )  # fmt: skip
    values.update(changes)
    return FwdConfig(**values)


def _tiled_config(d: int, dv: int, **flags) -> FwdConfig:
    """The config dispatch builds for (d, dv) and the flags: the tile of ``fwd_tile``."""
    tile_m, tile_n, num_warps = fwd_tile(
        d, flags.get("causal", False), local=flags.get("local", False),
        has_softcap=flags.get("has_softcap", False),
    )  # fmt: skip
    return _config(head_dim=d, head_dim_v=dv, tile_m=tile_m, tile_n=tile_n,
                   num_warps=num_warps, **flags)  # fmt: skip


def _clear_switches(monkeypatch) -> None:
    """No tuning switch of the sm90 forward set: dispatch makes its default choices."""
    for name in (TILE_N_ENV, TILE_M_ENV, KV_STAGES_ENV, DEFER_RESCALE_ENV, EXP2_POLY_ENV,
                 RESCALE_THRESHOLD_ENV, PERSISTENT_ENV, PINGPONG_ENV, OVERLAP_ENV,
                 TMA_STORE_ENV, FWD_ARCH_ENV):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def test_sm90_forward_is_dispatched_first_on_sm90(monkeypatch) -> None:
    monkeypatch.delenv(FWD_ARCH_ENV, raising=False)
    assert fwd_kernel_classes((9, 0))[0] is SM90_FWD
    assert SM90_FWD not in fwd_kernel_classes((8, 0))
    assert fwd_kernel_class(90).__name__ == "FlashAttentionForwardSm90"


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"arch": 80}, "sm80"),
        ({"target": "sm_100a"}, "sm_90a"),
        ({"head_dim": 80, "head_dim_v": 80}, "head_dim 80"),
        ({"head_dim": 512, "head_dim_v": 512}, "head_dim 512"),
        ({"head_dim_v": 64}, "head_dim_v"),
        ({"head_dim": 256, "head_dim_v": 128}, "head_dim_v"),
        ({"tile_n": 64}, "tile"),
        # d 256 needs its own tile: 128 keys would not fit in shared memory.
        ({"head_dim": 256, "head_dim_v": 256}, "tile"),
    ],
)
def test_sm90_can_implement_rejects_with_reason(changes: dict, needle: str) -> None:
    ok, reason = fwd_can_implement(_config(**changes))
    assert not ok and needle in reason


@pytest.mark.parametrize("flags", [{}, {"causal": True}, {"local": True}, {"has_softcap": True},
                                   {"causal": True, "has_softcap": True},
                                   {"local": True, "has_softcap": True},
                                   {"varlen_q": True, "varlen_k": True},
                                   {"causal": True, "varlen_q": True, "varlen_k": True,
                                    "seqused_q": True},
                                   {"varlen_k": True}, {"seqused_q": True},
                                   {"varlen_q": True, "varlen_k": True, "seqused_k": True},
                                   {"local": True, "seqused_k": True}],
                         ids=["plain", "causal", "local", "softcap", "causal-softcap",
                              "local-softcap", "varlen", "causal-varlen-seqused_q",
                              "varlen_k", "seqused_q", "varlen-seqused_k",
                              "local-seqused_k"])  # fmt: skip
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d, dv", SM90_FWD_HEAD_DIM_PAIRS)
def test_sm90_can_implement_accepts(d: int, dv: int, dtype: str, flags: dict) -> None:
    config = _tiled_config(d, dv, dtype=dtype, **flags)
    assert fwd_can_implement(config) == (True, "")
    assert fwd_smem_bytes(config) <= SMEM_CAPACITY["sm_90a"]


VARLEN = {"varlen_q": True, "varlen_k": True}
VARLEN_SEQUSED_Q = {**VARLEN, "seqused_q": True}
VARLEN_SEQUSED_K = {**VARLEN_SEQUSED_Q, "seqused_k": True}
LOCAL_SOFTCAP = {"local": True, "has_softcap": True}
# (d, dv, dtype, flags): every head-dim pair, each mask kind, softcap and varlen at least once.
COMPILE_CASES = [
    pytest.param(128, 128, "bf16", {}, id="d128"),
    pytest.param(128, 128, "bf16", {"causal": True}, id="d128-causal"),
    pytest.param(128, 128, "fp16", {}, id="d128-fp16"),
    pytest.param(64, 64, "bf16", {}, id="d64"),
    pytest.param(64, 64, "fp16", {"causal": True}, id="d64-fp16-causal"),
    pytest.param(96, 96, "bf16", {}, id="d96"),
    pytest.param(96, 96, "bf16", {"causal": True}, id="d96-causal"),
    pytest.param(192, 192, "bf16", {}, id="d192"),
    pytest.param(192, 192, "bf16", {"causal": True}, id="d192-causal"),
    pytest.param(192, 128, "bf16", {}, id="d192x128"),
    pytest.param(192, 128, "bf16", {"causal": True}, id="d192x128-causal"),
    pytest.param(256, 256, "bf16", {}, id="d256"),
    pytest.param(256, 256, "bf16", {"causal": True}, id="d256-causal"),
    pytest.param(256, 256, "fp16", {"causal": True}, id="d256-fp16-causal"),
    pytest.param(128, 128, "bf16", {"has_softcap": True}, id="d128-softcap"),
    pytest.param(64, 64, "bf16", {"causal": True, "has_softcap": True}, id="d64-causal-softcap"),
    pytest.param(96, 96, "fp16", {"has_softcap": True}, id="d96-fp16-softcap"),
    pytest.param(
        192, 128, "bf16", {"causal": True, "has_softcap": True}, id="d192x128-causal-softcap"
    ),
    pytest.param(256, 256, "bf16", {"causal": True, "has_softcap": True}, id="d256-causal-softcap"),
    pytest.param(128, 128, "bf16", {"local": True}, id="d128-local"),
    pytest.param(64, 64, "fp16", {"local": True}, id="d64-fp16-local"),
    pytest.param(96, 96, "bf16", {"local": True}, id="d96-local"),
    pytest.param(192, 128, "bf16", {"local": True}, id="d192x128-local"),
    pytest.param(192, 192, "bf16", {"local": True, "has_softcap": True}, id="d192-local-softcap"),
    pytest.param(256, 256, "bf16", {"local": True, "has_softcap": True}, id="d256-local-softcap"),
    pytest.param(128, 128, "bf16", VARLEN, id="d128-varlen"),
    pytest.param(64, 64, "bf16", {"causal": True, **VARLEN}, id="d64-causal-varlen"),
    pytest.param(128, 128, "bf16", {**LOCAL_SOFTCAP, **VARLEN}, id="d128-local-softcap-varlen"),
    pytest.param(192, 128, "bf16", {"causal": True, **VARLEN}, id="d192x128-causal-varlen"),
    pytest.param(
        256, 256, "bf16", {"causal": True, **VARLEN_SEQUSED_Q}, id="d256-causal-varlen-squ"
    ),
    pytest.param(96, 96, "fp16", {"varlen_k": True}, id="d96-fp16-varlen_k"),
    pytest.param(128, 128, "bf16", {"causal": True, "seqused_q": True}, id="d128-causal-seqused_q"),
    pytest.param(128, 128, "bf16", {**VARLEN, "seqused_k": True}, id="d128-varlen-seqused_k"),
    pytest.param(64, 64, "bf16", {"causal": True, "seqused_k": True}, id="d64-causal-seqused_k"),
    pytest.param(256, 256, "bf16", {**LOCAL_SOFTCAP, **VARLEN_SEQUSED_K}, id="d256-all-flags"),
    # Persistent grids (Note [persistent tiles]): two Q stages at d 64 (192 rows) and d 128,
    # one at d 256.
    pytest.param(64, 64, "bf16", {"num_ctas": 132}, id="d64-persistent"),
    pytest.param(
        128, 128, "fp16", {"num_ctas": 132, "has_softcap": True}, id="d128-fp16-softcap-persistent"
    ),  # fmt: skip
    pytest.param(256, 256, "bf16", {"num_ctas": 132}, id="d256-persistent"),
]


@pytest.mark.compile
@pytest.mark.parametrize("d, dv, dtype, flags", COMPILE_CASES)
def test_sm90_fwd_compiles_for_sm90a(d: int, dv: int, dtype: str, flags: dict, capfd) -> None:
    _check_compiled(_tiled_config(d, dv, dtype=dtype, **flags), capfd)


# The configs dispatch picks by default (fwd_tuned applied: the measured per-head-dim choices
# of hopper/support.py, e.g. the deferred rescale at d 64, 64 keys and the rescale threshold
# at d 256, the persistent grid by length), as (d, flags, longest query sequence).
DEFAULT_PLANS = [
    pytest.param(64, {}, 2048, id="d64-2k"),
    pytest.param(64, {"causal": True}, 1024, id="d64-causal-1k"),
    pytest.param(64, {"causal": True}, 2048, id="d64-causal-2k"),
    pytest.param(64, {"causal": True}, 8192, id="d64-causal-8k"),
    pytest.param(64, {"local": True, "has_softcap": True}, 4096, id="d64-local-softcap"),
    pytest.param(64, {"causal": True, "varlen_q": True, "varlen_k": True}, None, id="d64-varlen"),
    pytest.param(256, {"causal": True}, 2048, id="d256-causal-2k"),
]


@pytest.mark.compile
@pytest.mark.parametrize("d, flags, seqlen_q", DEFAULT_PLANS)
def test_sm90_fwd_default_plans_compile(monkeypatch, capfd, d, flags, seqlen_q) -> None:
    _clear_switches(monkeypatch)
    request = FwdRequest(dtype="bf16", head_dim=d, head_dim_v=d, **flags)
    cls, config = fwd_plan((9, 0), request, seqlen_q)
    assert cls is SM90_FWD and config.arch == 90
    if d == 64:
        assert config.defer_rescale
        # No consumer turns for causal calls with two consumers on the persistent grid.
        two_persistent = config.causal and config.num_ctas and config.tile_m == 128
        assert config.pingpong == (not two_persistent), config.name
        # ... and without the intra-warpgroup overlap up to 1k query rows.
        short = seqlen_q is not None and seqlen_q <= 1024
        assert config.overlap == (not (two_persistent and short)), config.name
    if d == 256:
        assert config.tile_n == 64 and config.rescale_threshold == 8
        assert config.num_ctas  # causal 1k-8k: the persistent grid, one Q stage
    _check_compiled(config, capfd)


@pytest.mark.compile
def test_sm90_fwd_three_consumers_persistent_causal(monkeypatch, capfd) -> None:
    """192 rows on the persistent causal grid: dispatch picks them for d 64 causal calls of
    4096 to 8192 query rows (hopper/support.py), not above, and they compile without spills
    (4 before the causal mask compared columns as immediates, Note [mask columns as
    immediates])."""
    _clear_switches(monkeypatch)
    request = FwdRequest(dtype="bf16", head_dim=64, head_dim_v=64, causal=True)
    _, config = fwd_plan((9, 0), request, 16384)
    assert config.tile_m == 192 and not config.num_ctas  # past the causal limit
    _, config = fwd_plan((9, 0), request, 4096)
    assert config.tile_m == 192 and config.num_ctas and config.defer_rescale
    _check_compiled(config, capfd)


# Three consumer warpgroups (tile_m 192, CUTE_FA_SM90_FWD_TILE_M=192): d 64 without a window
# or softcap (those spill in 160 registers), with and without causal, varlen and seqused.
COMPILE_CASES_3WG = [
    pytest.param(64, "bf16", {}, id="d64"),
    pytest.param(64, "bf16", {"causal": True}, id="d64-causal"),
    pytest.param(64, "fp16", {}, id="d64-fp16"),
    pytest.param(64, "fp16", {"causal": True}, id="d64-fp16-causal"),
    pytest.param(64, "bf16", VARLEN, id="d64-varlen"),
    pytest.param(64, "bf16", {"causal": True, **VARLEN_SEQUSED_Q}, id="d64-causal-varlen-squ"),
    pytest.param(64, "bf16", {"varlen_k": True}, id="d64-varlen_k"),
    pytest.param(64, "bf16", {"causal": True, "seqused_k": True}, id="d64-causal-seqused_k"),
    pytest.param(64, "bf16", {**VARLEN_SEQUSED_K, "causal": True}, id="d64-causal-all-varlen"),
    pytest.param(128, "bf16", {}, id="d128-80keys"),
    pytest.param(128, "bf16", {"causal": True}, id="d128-80keys-causal"),
]


@pytest.mark.compile
@pytest.mark.parametrize("d, dtype, flags", COMPILE_CASES_3WG)
def test_sm90_fwd_three_consumers_compiles(
    monkeypatch, d: int, dtype: str, flags: dict, capfd
) -> None:
    monkeypatch.setenv(TILE_N_ENV, str(SM90_FWD_3WG_MAX_TILE_N[d]))
    tile_m, tile_n, num_warps = fwd_tile(d, flags.get("causal", False), SM90_FWD_TILE_M_3WG)
    config = _config(head_dim=d, head_dim_v=d, dtype=dtype, tile_m=tile_m, tile_n=tile_n,
                     num_warps=num_warps, **flags)  # fmt: skip
    assert (config.tile_m, config.num_warps) == (192, 16)
    _check_compiled(config, capfd)


def test_sm90_three_consumers_only_where_they_fit(monkeypatch) -> None:
    monkeypatch.delenv(TILE_N_ENV, raising=False)
    monkeypatch.delenv(TILE_M_ENV, raising=False)
    for d, dv in SM90_FWD_HEAD_DIM_PAIRS:
        config = _config(head_dim=d, head_dim_v=dv, tile_m=192, tile_n=fwd_tile(d, False)[1],
                         num_warps=16)  # fmt: skip
        ok, reason = fwd_can_implement(config)
        fits = d in SM90_FWD_3WG_MAX_TILE_N and config.tile_n <= SM90_FWD_3WG_MAX_TILE_N[d]
        assert ok == fits, (d, dv, reason)
    # d 128 holds three consumers at 64 or 80 keys only (a tuning choice, not a default).
    for tile_n, fits in ((64, True), (80, True), (96, False)):
        monkeypatch.setenv(TILE_N_ENV, str(tile_n))
        assert fwd_tile(128, False, tile_m=None)[0] == 128  # never by default
        monkeypatch.setenv(TILE_M_ENV, "192")
        assert fwd_tile(128, False)[0] == (192 if fits else 128), tile_n
        monkeypatch.delenv(TILE_M_ENV)
    monkeypatch.delenv(TILE_N_ENV)
    # A window or softcap would spill in 160 registers: those keep two consumers.
    for flags in ({"local": True}, {"has_softcap": True}, {"causal": True, "has_softcap": True}):
        config = _config(head_dim=64, head_dim_v=64, tile_m=192, tile_n=128, num_warps=16,
                         **flags)  # fmt: skip
        ok, reason = fwd_can_implement(config)
        assert not ok and "tile_m 192" in reason
    # More keys than 160 registers hold (S, P and O of a consumer) are rejected, not spilled.
    monkeypatch.setenv(TILE_N_ENV, "192")
    ok, reason = fwd_can_implement(_config(head_dim=64, head_dim_v=64, tile_m=192, tile_n=192,
                                           num_warps=16))  # fmt: skip
    assert not ok and "160 registers" in reason


MALFORMED = [(KV_STAGES_ENV, "4"), (KV_STAGES_ENV, "three"), (DEFER_RESCALE_ENV, "yes"),
             (DEFER_RESCALE_ENV, "3"), (EXP2_POLY_ENV, "3"), (EXP2_POLY_ENV, "on"),
             (RESCALE_THRESHOLD_ENV, "6"), (RESCALE_THRESHOLD_ENV, "8.0"), (PINGPONG_ENV, "off"),
             (PINGPONG_ENV, "2"), (OVERLAP_ENV, "no"),
             (PERSISTENT_ENV, "3"), (TMA_STORE_ENV, "yes")]  # fmt: skip


@pytest.mark.parametrize("name, value", MALFORMED)
def test_sm90_fwd_switches_reject_malformed_values(monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=name):
        fwd_tuned(_tiled_config(128, 128))


def test_sm90_fwd_kv_stages_where_they_fit(monkeypatch) -> None:
    monkeypatch.delenv(TILE_N_ENV, raising=False)
    monkeypatch.delenv(KV_STAGES_ENV, raising=False)
    monkeypatch.delenv(DEFER_RESCALE_ENV, raising=False)
    monkeypatch.delenv(EXP2_POLY_ENV, raising=False)
    monkeypatch.delenv(RESCALE_THRESHOLD_ENV, raising=False)
    config = fwd_tuned(_tiled_config(128, 128))
    assert config == _tiled_config(128, 128) and fwd_kv_stages(config) == 2  # defaults: no change
    monkeypatch.setenv(KV_STAGES_ENV, "3")
    monkeypatch.setenv(DEFER_RESCALE_ENV, "1")
    # Q + 3 stages: d 64 / 96 / 128 at 128 keys fit in 227 KiB; d 192 and 256 keep 2.
    for (d, dv), stages in zip(SM90_FWD_HEAD_DIM_PAIRS, (3, 3, 3, 2, 2, 2), strict=True):
        config = fwd_tuned(_tiled_config(d, dv))
        assert fwd_kv_stages(config) == stages and config.defer_rescale, (d, dv)
        assert fwd_can_implement(config) == (True, "")
        assert fwd_smem_bytes(config, stages) <= SMEM_CAPACITY["sm_90a"]
        # The switches are part of the compile key: another name, another cache entry.
        assert config.name != _tiled_config(d, dv).name and "defer" in config.name


# Tuning switches (compile-time variants): (switch, value, d, tile_m or None, flags).
CAUSAL_SEQUSED_K = {"causal": True, "seqused_k": True}
SWITCH_CASES = [
    pytest.param(DEFER_RESCALE_ENV, "1", 128, None, {}, id="defer-d128"),
    pytest.param(DEFER_RESCALE_ENV, "1", 256, None, {}, id="defer-d256"),
    pytest.param(DEFER_RESCALE_ENV, "1", 128, None, CAUSAL_SEQUSED_K, id="defer-d128-causal-squk"),
    pytest.param(DEFER_RESCALE_ENV, "1", 256, None, {"causal": True}, id="defer-d256-causal"),
    pytest.param(DEFER_RESCALE_ENV, "1", 128, None, LOCAL_SOFTCAP, id="defer-d128-local-softcap"),
    pytest.param(DEFER_RESCALE_ENV, "1", 64, SM90_FWD_TILE_M_3WG, {}, id="defer-d64-3wg"),
    pytest.param(KV_STAGES_ENV, "3", 128, None, {}, id="stages3-d128"),
    pytest.param(KV_STAGES_ENV, "3", 128, None, {"causal": True}, id="stages3-d128-causal"),
    pytest.param(KV_STAGES_ENV, "3", 64, SM90_FWD_TILE_M_3WG, {}, id="stages3-d64-3wg"),
    pytest.param(EXP2_POLY_ENV, "8", 64, SM90_FWD_TILE_M_3WG, {}, id="poly8-d64-3wg"),
    pytest.param(EXP2_POLY_ENV, "8", 64, None, {"causal": True}, id="poly8-d64-causal"),
    pytest.param(EXP2_POLY_ENV, "4", 128, None, LOCAL_SOFTCAP, id="poly4-d128-local-softcap"),
    pytest.param(RESCALE_THRESHOLD_ENV, "8", 256, None, {}, id="thr8-d256"),
    pytest.param(RESCALE_THRESHOLD_ENV, "8", 64, SM90_FWD_TILE_M_3WG, {}, id="thr8-d64-3wg"),
    pytest.param(
        RESCALE_THRESHOLD_ENV, "4", 128, None, LOCAL_SOFTCAP, id="thr4-d128-local-softcap"
    ),  # fmt: skip
    pytest.param(PINGPONG_ENV, "0", 128, None, {}, id="nopingpong-d128"),
    pytest.param(PINGPONG_ENV, "0", 64, None, {"causal": True}, id="nopingpong-d64-causal"),
    pytest.param(PINGPONG_ENV, "0", 64, SM90_FWD_TILE_M_3WG, {}, id="nopingpong-d64-3wg"),
    pytest.param(TMA_STORE_ENV, "1", 128, None, {}, id="tmastore-d128"),
    pytest.param(TMA_STORE_ENV, "1", 64, SM90_FWD_TILE_M_3WG, {}, id="tmastore-d64-3wg"),
    pytest.param(TMA_STORE_ENV, "1", 256, None, {"causal": True}, id="tmastore-d256-causal"),
    pytest.param(TMA_STORE_ENV, "1", 128, None, VARLEN, id="tmastore-d128-varlen-not-taken"),
    pytest.param(OVERLAP_ENV, "0", 128, None, {}, id="nooverlap-d128"),
    pytest.param(OVERLAP_ENV, "0", 64, None, {"causal": True}, id="nooverlap-d64-causal"),
    pytest.param(OVERLAP_ENV, "0", 256, None, {"causal": True}, id="nooverlap-d256-causal"),
]


# MUFU.EX2 between each ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` and the next ``0x0`` (one entry per
# key-block loop) of the deferred-rescale cases, per CuTe DSL build (its ptxas; conftest prints
# which one runs), counted on nvidia-cutlass-dsl 4.8.1 with libs-cu12 (CUDA 12.9) and libs-cu13
# (CUDA 13.4). CUDA 12 keeps all of a loop step's exponentials inside the window at d128 and
# d256 (tile_n / 2 of P + 2 rescale factors, or tile_n / 2 where the d256 threshold's vote puts
# the factors' EX2 behind a branch) and at least P's with three consumers. CUDA 13 puts the wait
# before the exponentials with defer_rescale=1 whatever the anchor (hopper/flash_fwd.py
# docstring). A change in either direction fails: update the table and the docstring together.
OVERLAP_WINDOW_EXPONENTIALS = {
    "fwd_sm90_sm_90a_bf16_d128_128x128w12_defer": {12: [66, 66], 13: [0, 1]},
    "fwd_sm90_sm_90a_bf16_d256_128x64w12_defer_thr8": {12: [34, 32], 13: [5, 15]},
    "fwd_sm90_sm_90a_bf16_d64_192x128w16_defer": {12: [66, 66], 13: [0, 1]},
}


@pytest.mark.compile
@pytest.mark.parametrize("name, value, d, tile_m, flags", SWITCH_CASES)
def test_sm90_fwd_switch_compiles(monkeypatch, capfd, name, value, d, tile_m, flags) -> None:
    monkeypatch.delenv(TILE_N_ENV, raising=False)
    monkeypatch.setenv(name, value)
    if tile_m is None:
        config = _tiled_config(d, d, **flags)
    else:
        tile_m, tile_n, num_warps = fwd_tile(d, flags.get("causal", False), tile_m)
        config = _config(head_dim=d, head_dim_v=d, tile_m=tile_m, tile_n=tile_n,
                         num_warps=num_warps, **flags)  # fmt: skip
    config = fwd_tuned(config)
    sass = _check_compiled(config, capfd)
    if name == DEFER_RESCALE_ENV:
        assert config.defer_rescale == int(value)
    if name == DEFER_RESCALE_ENV and not flags:
        # The exponentials of a loop step (tile_n / 2 of P, 2 of the rescale factors) sit
        # between wgmma wait_group 1 and wait_group 0 (class docstring), exactly as many per
        # loop as OVERLAP_WINDOW_EXPONENTIALS says for this build's ptxas.
        inside = _exponentials_in_overlap_window(sass)
        expected = OVERLAP_WINDOW_EXPONENTIALS[config.name]
        major = dsl_cuda_major()
        assert major in expected, f"no expectation for the CUDA {major} build: counted {inside}"
        assert inside == expected[major], (config.name, major, inside)
    if name == RESCALE_THRESHOLD_ENV:
        # Each key-block loop skips its O rescale behind one warp vote; with the deferred
        # rescale (d64 by default) the rescale before the last P V has one too.
        assert config.rescale_threshold == int(value) and f"thr{value}" in config.name
        votes = (3 if config.local else 2) + (1 if config.defer_rescale else 0)
        assert sass.count("VOTE.ANY") == votes, sass.count("VOTE.ANY")
    if name == PINGPONG_ENV:
        # No turns: the consumers' named-barrier waits and arrivals of the pingpong are gone
        # (the epilogue's barriers stay).
        monkeypatch.delenv(name)
        default = compile_and_inspect(fwd_tuned(config.replace(pingpong=True)))["sass_text"]
        assert not config.pingpong and "nopingpong" in config.name
        turns = default.count("BAR.ARV") + default.count("BAR.SYNC")
        assert sass.count("BAR.ARV") + sass.count("BAR.SYNC") < turns
    if name == TMA_STORE_ENV:
        # O by TMA store: one UTMASTG per 64-column box of a consumer's (64, dv) tile, no
        # 16-byte global stores left (the two STG.E are the LSE); varlen queries keep them.
        stores = len(re.findall(r"\bUTMASTG", sass))
        wide = sass.count("STG.E.128")
        if config.varlen_q:
            assert not config.tma_store and stores == 0 and wide > 0
        else:
            assert config.tma_store and "tmastore" in config.name
            assert stores == max(1, config.head_dim_v // 64) and wide == 0, (stores, wide)
    if name == OVERLAP_ENV:
        # No overlap: every wait after an issue is wait_group 0 (the default's loops wait for
        # S alone with wait_group 1).
        assert not config.overlap and "nooverlap" in config.name
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in sass
        assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") >= 3
    if name == EXP2_POLY_ENV:
        # Each thread's row of an unmasked block (tile_n / 2 scores) has tile_n / 2 / k
        # polynomial exponentials; the kernel has one unmasked loop.
        monkeypatch.delenv(name)
        default = compile_and_inspect(fwd_tuned(config.replace(exp2_poly=0)))["sass_text"]
        assert config.exp2_poly == int(value) and f"poly{value}" in config.name
        fewer = default.count("MUFU.EX2") - sass.count("MUFU.EX2")
        assert fewer == config.tile_n // 2 // config.exp2_poly, fewer


def dsl_cuda_major() -> int:
    """CUDA major version of the CuTe DSL build that compiles (12 or 13: its ptxas)."""
    from cutlass.base_dsl.version_info import CUDA_VERSION

    return CUDA_VERSION.major


def _exponentials_in_overlap_window(sass: str) -> list[int]:
    """MUFU.EX2 between each ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` and the next ``0x0``."""
    counts, inside = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            inside = 0
        elif inside is not None and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            counts.append(inside)
            inside = None
        elif inside is not None and "MUFU.EX2" in line:
            inside += 1
    return counts


def _check_compiled(config: FwdConfig, capfd) -> str:
    """Compile ``config`` for sm_90a and check its SASS (see the module docstring)."""
    d = config.head_dim
    info = compile_and_inspect(config)
    out, err = capfd.readouterr()
    counts = info["sass_counts"]
    sass = info["sass_text"]
    print(
        f"{config.name}: regs {info['regs']} stack {info['stack']} HGMMA {counts['HGMMA']} "
        f"UTMALDG {counts['UTMALDG']} spills {info['spills']} smem {fwd_smem_bytes(config)}"
    )
    # S = Q K^T: d / 16 WGMMAs (k = 16 each), O += P V: tile_n / 16; in each key-block loop
    # (masked and unmasked, plus the left-edge loop with a window), plus the peeled first
    # (S only) and last (P V only) block.
    loops = 3 if config.local else 2
    assert counts["HGMMA"] == (loops + 1) * (d // 16 + config.tile_n // 16), "HGMMA count"
    # One warpgroup.arrive (fence) per place that issues WGMMAs: more means ptxas serialized
    # them (warning C7519, e.g. P built from scalar conversions right before its WGMMA).
    assert sass.count("WARPGROUP.ARRIVE") == loops + 2, "WGMMAs serialized by ptxas"
    assert counts["UTMALDG"] > 0, "no TMA load (UTMALDG) in the SASS"
    assert counts["HMMA"] == 0 and counts["LDGSTS"] == 0
    # seqused_k: consumer 0 zeroes the V tail of the first block (16-bit smem stores, then a
    # generic -> async proxy fence); nothing else in the consumers stores 16-bit values.
    assert (counts["STS"] > 0 and "STS.U16" in sass) == config.seqused_k, "V tail zeroing"
    # softcap: one tanh per score, tile_n / 2 a thread in each of the loops and the first block.
    tanh = len(re.findall(r"MUFU\.TANH", sass))
    assert tanh == ((loops + 1) * config.tile_n // 2 if config.has_softcap else 0), "MUFU.TANH"
    assert info["spills"] == 0 and info["stack"] == 0 and info["local"] == 0
    assert fwd_smem_bytes(config, fwd_kv_stages(config)) <= SMEM_CAPACITY["sm_90a"]
    # 128 threads a warpgroup: at most 65536 / threads registers at launch (168 with two
    # consumers, 128 with three), then setmaxnreg moves them.
    num_consumers = fwd_num_consumers(config.tile_m)
    assert 128 * (1 + num_consumers) == config.num_warps * 32
    assert info["regs"] <= 65536 // (config.num_warps * 32) // 8 * 8
    producer, consumer = SM90_FWD_REGS[num_consumers]
    assert re.search(rf"USETMAXREG\.DEALLOC\S*\s+{producer:#x}\b", sass), (
        f"producer setmaxnreg.dec {producer}"
    )
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\S*\s+\S+,\s*{consumer:#x}\b", sass), (
        f"consumer setmaxnreg.inc {consumer}"
    )
    # Nothing above the consumers' budget (register numbers of the SASS).
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < consumer
    assert "setmaxnreg" not in (out + err).lower(), "ptxas warned about setmaxnreg"
    # The WGMMA serialization warnings (C7510-C7520: wgmma serialized for some reason) never
    # appear (the WARPGROUP.ARRIVE count above sees the effect, this the warning itself).
    assert not re.search(r"C75(1\d|20)", out + err), "ptxas serialized WGMMAs"
    return sass
