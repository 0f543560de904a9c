"""Compile-only checks of the sm90 forward kernel (FA3 design) on the CPU, with a SASS read.

What can be checked of ``FlashAttentionForwardSm90`` without a GPU (tests/test_fwd_gpu.py
checks its results on one): it cross-compiles for sm_90a, the cubin holds WGMMA
(``HGMMA``) and TMA loads (``UTMALDG``) and no mma.sync, nothing spills (no ``LDL``/``STL``, no
stack), the register reallocation took effect (``USETMAXREG`` down to the producer budget and up
to the consumer budget, no ptxas warning about it), and ``can_implement`` rejects what the
kernel does not do yet, with its reason. Every head-dim pair and mask kind is compiled at least
once; the three-consumer tile (192 query rows, d 64) with and without causal and varlen; each
field of ``Sm90FwdTuning`` with the SASS fact it stands for.

The default run compiles a representative set (marker ``compile``); the rest of the matrix is
marked ``exhaustive`` as well (``python -m pytest -m exhaustive``).
"""

from __future__ import annotations

import re

import pytest
from cute_fa.hopper.support import (
    SM90_FWD_3WG_MAX_TILE_N,
    SM90_FWD_HEAD_DIM_PAIRS,
    SM90_FWD_REGS,
    SM90_FWD_TILE_M,
    SM90_FWD_TILE_M_3WG,
    SM90_FWD_TILE_N,
    fwd_can_implement,
    fwd_config,
    fwd_kv_stages,
    fwd_num_consumers,
    fwd_smem_bytes,
    fwd_tile_m,
)

import cute_fa
from cute_fa import settings
from cute_fa.config import SMEM_CAPACITY, FwdConfig, Sm90FwdTuning, Tiles, TuningError
from cute_fa.planning import SM90_FWD, FwdRequest, fwd_kernel_class, fwd_kernel_classes, fwd_plan
from cute_fa.tools.sass import compile_and_inspect

EXHAUSTIVE = pytest.mark.exhaustive
TUNING_FIELDS = set(Sm90FwdTuning.__dataclass_fields__)


def _config(tuning: Sm90FwdTuning | None = None, **changes) -> FwdConfig:
    """An sm90 compile key (d 128, bf16 by default) with ``tuning`` (default: 128 x 128 and
    every other field at the dataclass's default)."""
    values = dict(
        arch=90, target="sm_90a", dtype="bf16", head_dim=128, head_dim_v=128,
        tuning=tuning or Sm90FwdTuning(),
    )  # fmt: skip
    values.update(changes)
    return FwdConfig(**values)


def _tiled_config(d: int, dv: int, **flags) -> FwdConfig:
    """The default tile of (d, dv) and the flags (``SM90_FWD_TILE_N``, ``fwd_tile_m``) and the
    dataclass's defaults for the other tuning fields; flags named like a tuning field (e.g.
    ``num_ctas``) go to the tuning."""
    fields = {k: flags.pop(k) for k in list(flags) if k in TUNING_FIELDS}
    tile_n = fields.pop("tile_n", SM90_FWD_TILE_N[d])
    tile_m = fields.pop("tile_m", None) or fwd_tile_m(
        d, tile_n, flags.get("causal", False), flags.get("local", False),
        flags.get("has_softcap", False),
    )  # fmt: skip
    tuning = Sm90FwdTuning(tile_m=tile_m, tile_n=tile_n, **fields)
    return _config(tuning, head_dim=d, head_dim_v=dv, **flags)


def _planned(d: int, asked: dict | None = None, dv: int | None = None, **flags) -> FwdConfig:
    """The key planning builds for (d, dv) and the flags with the tuning fields ``asked`` over
    the built-in defaults (as ``cute_fa.tuning(sm90_fwd=asked)`` does), no query length."""
    return fwd_config(_config(head_dim=d, head_dim_v=dv or d, **flags), None, asked)


def test_sm90_forward_is_dispatched_first_on_sm90(monkeypatch) -> None:
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
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
        ({"head_dim_v": 96}, "head_dim_v"),
        ({"head_dim": 256, "head_dim_v": 128}, "head_dim_v"),
        ({"tuning": Tiles(128, 64, 4)}, "not an Sm90FwdTuning"),
        # Three consumers hold at most 80 keys at d 128 in 160 registers.
        ({"tuning": Sm90FwdTuning(tile_m=192, tile_n=128)}, "tile_n 128 with tile_m 192"),
        # d 256 needs its own tile: 128 keys would not fit in shared memory.
        ({"head_dim": 256, "head_dim_v": 256}, "tiles need"),
        ({"tuning": Sm90FwdTuning(tile_n=256)}, "tiles need"),
        ({"tuning": Sm90FwdTuning(pingpong=False), "seqused_k": True}, "pingpong off"),
        ({"tuning": Sm90FwdTuning(tma_store=True), "varlen_q": True}, "tma_store"),
        ({"tuning": Sm90FwdTuning(tma_store=True), "head_dim": 192}, "tma_store"),
        ({"tuning": Sm90FwdTuning(num_ctas=132), "local": True}, "persistent grid"),
        ({"tuning": Sm90FwdTuning(num_ctas=132), "seqused_q": True}, "persistent grid"),
    ],
)
def test_sm90_can_implement_rejects_with_reason(changes: dict, needle: str) -> None:
    ok, reason = fwd_can_implement(_config(**changes))
    assert not ok and needle in reason, reason


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
    # The key planning builds by default is one the kernel implements too.
    planned = _planned(d, dv=dv, dtype=dtype, **flags)
    assert fwd_can_implement(planned) == (True, ""), planned.name


VARLEN = {"varlen_q": True, "varlen_k": True}
VARLEN_SEQUSED_Q = {**VARLEN, "seqused_q": True}
VARLEN_SEQUSED_K = {**VARLEN_SEQUSED_Q, "seqused_k": True}
LOCAL_SOFTCAP = {"local": True, "has_softcap": True}
# (d, dv, dtype, flags): every head-dim pair, each mask kind, softcap and varlen at least once.
# Unmarked cases run by default: plain, causal (192, 128), local with softcap (128, 64), varlen
# with seqused_k, local with softcap (and every other flag) at d 256; DEFAULT_PLANS adds d 64,
# three consumers and persistent grids.
COMPILE_CASES = [
    pytest.param(128, 128, "bf16", {}, id="d128"),
    pytest.param(128, 128, "bf16", {"causal": True}, id="d128-causal", marks=EXHAUSTIVE),
    pytest.param(128, 128, "fp16", {}, id="d128-fp16", marks=EXHAUSTIVE),
    pytest.param(64, 64, "bf16", {}, id="d64", marks=EXHAUSTIVE),
    pytest.param(64, 64, "fp16", {"causal": True}, id="d64-fp16-causal", marks=EXHAUSTIVE),
    pytest.param(96, 96, "bf16", {}, id="d96", marks=EXHAUSTIVE),
    pytest.param(96, 96, "bf16", {"causal": True}, id="d96-causal", marks=EXHAUSTIVE),
    pytest.param(192, 192, "bf16", {}, id="d192", marks=EXHAUSTIVE),
    pytest.param(192, 192, "bf16", {"causal": True}, id="d192-causal", marks=EXHAUSTIVE),
    pytest.param(192, 128, "bf16", {}, id="d192x128", marks=EXHAUSTIVE),
    pytest.param(192, 128, "bf16", {"causal": True}, id="d192x128-causal"),
    pytest.param(128, 64, "bf16", {}, id="d128x64", marks=EXHAUSTIVE),
    pytest.param(128, 64, "bf16", LOCAL_SOFTCAP, id="d128x64-local-softcap"),
    pytest.param(256, 256, "bf16", {}, id="d256", marks=EXHAUSTIVE),
    pytest.param(256, 256, "bf16", {"causal": True}, id="d256-causal", marks=EXHAUSTIVE),
    pytest.param(256, 256, "fp16", {"causal": True}, id="d256-fp16-causal", marks=EXHAUSTIVE),
    pytest.param(128, 128, "bf16", {"has_softcap": True}, id="d128-softcap", marks=EXHAUSTIVE),
    pytest.param(
        64,
        64,
        "bf16",
        {"causal": True, "has_softcap": True},
        id="d64-causal-softcap",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(96, 96, "fp16", {"has_softcap": True}, id="d96-fp16-softcap", marks=EXHAUSTIVE),
    pytest.param(
        192,
        128,
        "bf16",
        {"causal": True, "has_softcap": True},
        id="d192x128-causal-softcap",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(
        256,
        256,
        "bf16",
        {"causal": True, "has_softcap": True},
        id="d256-causal-softcap",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(128, 128, "bf16", {"local": True}, id="d128-local", marks=EXHAUSTIVE),
    pytest.param(64, 64, "fp16", {"local": True}, id="d64-fp16-local", marks=EXHAUSTIVE),
    pytest.param(96, 96, "bf16", {"local": True}, id="d96-local", marks=EXHAUSTIVE),
    pytest.param(192, 128, "bf16", {"local": True}, id="d192x128-local", marks=EXHAUSTIVE),
    pytest.param(192, 192, "bf16", LOCAL_SOFTCAP, id="d192-local-softcap", marks=EXHAUSTIVE),
    pytest.param(256, 256, "bf16", LOCAL_SOFTCAP, id="d256-local-softcap", marks=EXHAUSTIVE),
    pytest.param(128, 128, "bf16", VARLEN, id="d128-varlen", marks=EXHAUSTIVE),
    pytest.param(
        64, 64, "bf16", {"causal": True, **VARLEN}, id="d64-causal-varlen", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        128,
        128,
        "bf16",
        {**LOCAL_SOFTCAP, **VARLEN},
        id="d128-local-softcap-varlen",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(
        192, 128, "bf16", {"causal": True, **VARLEN}, id="d192x128-causal-varlen", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        256,
        256,
        "bf16",
        {"causal": True, **VARLEN_SEQUSED_Q},
        id="d256-causal-varlen-squ",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(96, 96, "fp16", {"varlen_k": True}, id="d96-fp16-varlen_k", marks=EXHAUSTIVE),
    pytest.param(
        128,
        128,
        "bf16",
        {"causal": True, "seqused_q": True},
        id="d128-causal-seqused_q",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(128, 128, "bf16", {**VARLEN, "seqused_k": True}, id="d128-varlen-seqused_k"),
    pytest.param(
        64,
        64,
        "bf16",
        {"causal": True, "seqused_k": True},
        id="d64-causal-seqused_k",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(256, 256, "bf16", {**LOCAL_SOFTCAP, **VARLEN_SEQUSED_K}, id="d256-all-flags"),
    # Persistent grids (Note [persistent tiles]): two Q stages at d 64 (192 rows) and d 128,
    # one at d 256.
    pytest.param(64, 64, "bf16", {"num_ctas": 132}, id="d64-persistent", marks=EXHAUSTIVE),
    pytest.param(
        128,
        128,
        "fp16",
        {"num_ctas": 132, "has_softcap": True},
        id="d128-fp16-softcap-persistent",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(256, 256, "bf16", {"num_ctas": 132}, id="d256-persistent", marks=EXHAUSTIVE),
]


@pytest.mark.compile
@pytest.mark.parametrize("d, dv, dtype, flags", COMPILE_CASES)
def test_sm90_fwd_compiles_for_sm90a(d: int, dv: int, dtype: str, flags: dict, capfd) -> None:
    _check_compiled(_tiled_config(d, dv, dtype=dtype, **flags), capfd)


# The configs planning picks by default (the measured per-head-dim choices of
# hopper/support.py ``fwd_config``, e.g. the deferred rescale at d 64, 64 keys and the rescale
# threshold at d 256, the persistent grid by length), as (d, flags, longest query sequence).
DEFAULT_PLANS = [
    pytest.param(64, {}, 2048, id="d64-2k"),
    pytest.param(64, {"causal": True}, 1024, id="d64-causal-1k"),
    pytest.param(64, {"causal": True}, 2048, id="d64-causal-2k", marks=EXHAUSTIVE),
    pytest.param(64, {"causal": True}, 8192, id="d64-causal-8k", marks=EXHAUSTIVE),
    pytest.param(
        64, {"local": True, "has_softcap": True}, 4096, id="d64-local-softcap", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        64,
        {"causal": True, "varlen_q": True, "varlen_k": True},
        None,
        id="d64-varlen",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(256, {"causal": True}, 2048, id="d256-causal-2k"),
]


@pytest.mark.compile
@pytest.mark.parametrize("d, flags, seqlen_q", DEFAULT_PLANS)
def test_sm90_fwd_default_plans_compile(monkeypatch, capfd, d, flags, seqlen_q) -> None:
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    request = FwdRequest(dtype="bf16", head_dim=d, head_dim_v=d, **flags)
    cls, config = fwd_plan((9, 0), request, seqlen_q)
    assert cls is SM90_FWD and config.arch == 90
    tuning = config.tuning
    if d == 64:
        assert tuning.defer_rescale
        # No consumer turns for causal calls with two consumers on the persistent grid.
        two_persistent = config.causal and tuning.num_ctas and config.tile_m == 128
        assert tuning.pingpong == (not two_persistent), config.name
        # ... and without the intra-warpgroup overlap up to 1k query rows.
        short = seqlen_q is not None and seqlen_q <= 1024
        assert tuning.overlap == (not (two_persistent and short)), config.name
    if d == 256:
        assert config.tile_n == 64 and tuning.rescale_threshold == 8
        assert tuning.num_ctas  # causal 1k-8k: the persistent grid, one Q stage
    _check_compiled(config, capfd)


@pytest.mark.compile
@pytest.mark.exhaustive
def test_sm90_fwd_three_consumers_persistent_causal(monkeypatch, capfd) -> None:
    """192 rows on the persistent causal grid: planning picks them for d 64 causal calls of
    4096 to 8192 query rows (hopper/support.py), not above, and they compile without spills
    (4 before the causal mask compared columns as immediates, Note [mask columns as
    immediates])."""
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    request = FwdRequest(dtype="bf16", head_dim=64, head_dim_v=64, causal=True)
    _, config = fwd_plan((9, 0), request, 16384)
    assert config.tile_m == 192 and not config.tuning.num_ctas  # past the causal limit
    _, config = fwd_plan((9, 0), request, 4096)
    assert config.tile_m == 192 and config.tuning.num_ctas and config.tuning.defer_rescale
    _check_compiled(config, capfd)


# Three consumer warpgroups (tile_m 192): d 64 without a window or softcap (those spill in 160
# registers), with and without causal, varlen and seqused; d 128 at 80 keys.
COMPILE_CASES_3WG = [
    pytest.param(64, "bf16", {}, id="d64", marks=EXHAUSTIVE),
    pytest.param(64, "bf16", {"causal": True}, id="d64-causal", marks=EXHAUSTIVE),
    pytest.param(64, "fp16", {}, id="d64-fp16", marks=EXHAUSTIVE),
    pytest.param(64, "fp16", {"causal": True}, id="d64-fp16-causal", marks=EXHAUSTIVE),
    pytest.param(64, "bf16", VARLEN, id="d64-varlen", marks=EXHAUSTIVE),
    pytest.param(
        64,
        "bf16",
        {"causal": True, **VARLEN_SEQUSED_Q},
        id="d64-causal-varlen-squ",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(64, "bf16", {"varlen_k": True}, id="d64-varlen_k", marks=EXHAUSTIVE),
    pytest.param(
        64, "bf16", {"causal": True, "seqused_k": True}, id="d64-causal-seqused_k", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(64, "bf16", {**VARLEN_SEQUSED_K, "causal": True}, id="d64-causal-all-varlen"),
    pytest.param(128, "bf16", {}, id="d128-80keys", marks=EXHAUSTIVE),
    pytest.param(128, "bf16", {"causal": True}, id="d128-80keys-causal", marks=EXHAUSTIVE),
]


@pytest.mark.compile
@pytest.mark.parametrize("d, dtype, flags", COMPILE_CASES_3WG)
def test_sm90_fwd_three_consumers_compiles(d: int, dtype: str, flags: dict, capfd) -> None:
    tuning = Sm90FwdTuning(tile_m=SM90_FWD_TILE_M_3WG, tile_n=SM90_FWD_3WG_MAX_TILE_N[d])
    config = _config(tuning, head_dim=d, head_dim_v=d, dtype=dtype, **flags)
    assert (config.tile_m, config.num_warps) == (192, 16)
    _check_compiled(config, capfd)


def test_sm90_three_consumers_only_where_they_fit(monkeypatch) -> None:
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    for d, dv in SM90_FWD_HEAD_DIM_PAIRS:
        config = _tiled_config(d, dv, tile_m=192)
        ok, reason = fwd_can_implement(config)
        fits = d in SM90_FWD_3WG_MAX_TILE_N and config.tile_n <= SM90_FWD_3WG_MAX_TILE_N[d]
        assert ok == fits, (d, dv, reason)
    # d 128 holds three consumers at 64 or 80 keys only (a tuning choice, not a default).
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128)
    for tile_n, fits in ((64, True), (80, True), (96, False)):
        assert fwd_tile_m(128, tile_n) == 128  # never by default
        assert _planned(128, {"tile_n": tile_n}).tile_m == 128
        config = _planned(128, {"tile_m": 192, "tile_n": tile_n})
        assert config.tile_m == 192 and fwd_can_implement(config)[0] == fits, tile_n
        # Where the sm90 kernel cannot take the asked tile, planning hands the call to sm80.
        with cute_fa.tuning(sm90_fwd={"tile_m": 192, "tile_n": tile_n}):
            _, planned = fwd_plan((9, 0), request, 8192)
        assert (planned.arch, planned.tile_m) == ((90, 192) if fits else (80, 128)), tile_n
    # A window or softcap would spill in 160 registers: those keep two consumers.
    for flags in ({"local": True}, {"has_softcap": True}, {"causal": True, "has_softcap": True}):
        tuning = Sm90FwdTuning(tile_m=192, tile_n=128)
        ok, reason = fwd_can_implement(_config(tuning, head_dim=64, head_dim_v=64, **flags))
        assert not ok and "tile_m 192" in reason
        assert _planned(64, **flags).tile_m == SM90_FWD_TILE_M
    # More keys than 160 registers hold (S, P and O of a consumer) are rejected, not spilled.
    tuning = Sm90FwdTuning(tile_m=192, tile_n=192)
    ok, reason = fwd_can_implement(_config(tuning, head_dim=64, head_dim_v=64))
    assert not ok and "160 registers" in reason


# Values each tuning field rejects when the tuning is built (TuningError, a ValueError), as
# (field, value): a tuning never reaches a compile key with them.
MALFORMED = [
    ("tile_m", 64), ("tile_m", 256), ("tile_m", 136), ("tile_n", 100), ("tile_n", 0),
    ("tile_n", 272), ("tile_n", "128"), ("tile_n", True), ("exp2_poly", 3), ("exp2_poly", "on"),
    ("exp2_poly", 32), ("rescale_threshold", 6), ("rescale_threshold", -4), ("num_ctas", -1),
]  # fmt: skip
# Values of another type than the field's (the kernel would read "off" as true).
MALFORMED += [
    ("defer_rescale", 2), ("defer_rescale", "yes"), ("rescale_threshold", 8.0),
    ("pingpong", "off"), ("pingpong", 2), ("overlap", "no"), ("tma_store", "yes"),
    ("num_ctas", 1.5),
]  # fmt: skip


@pytest.mark.parametrize("field, value", MALFORMED)
def test_sm90_fwd_tuning_rejects_malformed_values(field: str, value) -> None:
    with pytest.raises(TuningError, match=field):
        Sm90FwdTuning(**{field: value})


@pytest.mark.parametrize("field, value", MALFORMED)
def test_sm90_fwd_override_of_malformed_value_raises(field: str, value) -> None:
    """Through ``cute_fa.tuning`` the error reaches the caller, at the block or when planning
    builds the tuning (it checks every asked field before using one; it never falls back to the
    sm80 kernel on it)."""
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128)
    with pytest.raises(TuningError, match=field):
        with cute_fa.tuning(sm90_fwd={field: value}):
            fwd_plan((9, 0), request)


@pytest.mark.parametrize("field", ["kv_stages", "p_smem", "q_rmem", "dynamic_tiles"])
def test_sm90_fwd_removed_switches_are_no_tuning_fields(field: str) -> None:
    with pytest.raises(TypeError, match=field):
        with cute_fa.tuning(sm90_fwd={field: 1}):
            pass
    with pytest.raises(TypeError):
        Sm90FwdTuning(**{field: 1})


def test_sm90_fwd_defer_rescale_is_part_of_the_key(monkeypatch) -> None:
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    config = _planned(128)
    assert config == _tiled_config(128, 128) and fwd_kv_stages(config) == 2  # defaults of d128
    for d, dv in SM90_FWD_HEAD_DIM_PAIRS:
        config = _planned(d, {"defer_rescale": True}, dv=dv)
        assert config.tuning.defer_rescale and fwd_kv_stages(config) == 2, (d, dv)
        assert fwd_can_implement(config) == (True, "")
        assert fwd_smem_bytes(config, fwd_kv_stages(config)) <= SMEM_CAPACITY["sm_90a"]
        # The field is part of the compile key: another name, another cache entry.
        assert config.name != _tiled_config(d, dv).name and "defer" in config.name
        assert _planned(d, {"defer_rescale": False}, dv=dv).name != config.name


# Tuning fields (compile-time variants), each over the built-in defaults of its problem:
# (field, value, d, tile_m or None, flags). Unmarked cases run by default: the three of
# OVERLAP_WINDOW_EXPONENTIALS and one SASS fact of every other field.
CAUSAL_SEQUSED_K = {"causal": True, "seqused_k": True}
TUNING_CASES = [
    pytest.param("defer_rescale", True, 128, None, {}, id="defer-d128"),
    pytest.param("defer_rescale", True, 256, None, {}, id="defer-d256"),
    pytest.param(
        "defer_rescale",
        True,
        128,
        None,
        CAUSAL_SEQUSED_K,
        id="defer-d128-causal-squk",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param(
        "defer_rescale", True, 256, None, {"causal": True}, id="defer-d256-causal", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        "defer_rescale",
        True,
        128,
        None,
        LOCAL_SOFTCAP,
        id="defer-d128-local-softcap",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param("defer_rescale", True, 64, SM90_FWD_TILE_M_3WG, {}, id="defer-d64-3wg"),
    pytest.param(
        "exp2_poly", 8, 64, SM90_FWD_TILE_M_3WG, {}, id="poly8-d64-3wg", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param("exp2_poly", 8, 64, None, {"causal": True}, id="poly8-d64-causal"),
    pytest.param(
        "exp2_poly", 4, 128, None, LOCAL_SOFTCAP, id="poly4-d128-local-softcap", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param("rescale_threshold", 8, 256, None, {}, id="thr8-d256"),
    pytest.param(
        "rescale_threshold", 8, 64, SM90_FWD_TILE_M_3WG, {}, id="thr8-d64-3wg", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        "rescale_threshold",
        4,
        128,
        None,
        LOCAL_SOFTCAP,
        id="thr4-d128-local-softcap",
        marks=EXHAUSTIVE,
    ),  # fmt: skip
    pytest.param("pingpong", False, 128, None, {}, id="nopingpong-d128"),
    pytest.param(
        "pingpong", False, 64, None, {"causal": True}, id="nopingpong-d64-causal", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        "pingpong", False, 64, SM90_FWD_TILE_M_3WG, {}, id="nopingpong-d64-3wg", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param("tma_store", True, 128, None, {}, id="tmastore-d128"),
    pytest.param(
        "tma_store", True, 64, SM90_FWD_TILE_M_3WG, {}, id="tmastore-d64-3wg", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        "tma_store", True, 256, None, {"causal": True}, id="tmastore-d256-causal", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        "tma_store", True, 128, None, VARLEN, id="tmastore-d128-varlen-not-taken", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param("overlap", False, 128, None, {}, id="nooverlap-d128"),
    pytest.param(
        "overlap", False, 64, None, {"causal": True}, id="nooverlap-d64-causal", marks=EXHAUSTIVE
    ),  # fmt: skip
    pytest.param(
        "overlap", False, 256, None, {"causal": True}, id="nooverlap-d256-causal", marks=EXHAUSTIVE
    ),  # fmt: skip
]


# MUFU.EX2 between each ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` and the next ``0x0`` (one entry per
# key-block loop) of the deferred-rescale cases, per CuTe DSL build (its ptxas; conftest prints
# which one runs), counted on nvidia-cutlass-dsl 4.8.1 with libs-cu12 (CUDA 12.9) and libs-cu13
# (CUDA 13.4). CUDA 12 keeps all of a loop step's exponentials inside the window at d128 and
# d256 (tile_n / 2 of P + 2 rescale factors, or tile_n / 2 where the d256 threshold's vote puts
# the factors' EX2 behind a branch) and at least P's with three consumers (66 and 64 of 66).
# CUDA 13 puts the wait before the exponentials whatever the anchor (hopper/flash_fwd.py
# docstring). A change in either direction fails: update the table and the docstring together.
OVERLAP_WINDOW_EXPONENTIALS = {
    "fwd_sm90_sm_90a_bf16_d128_128x128w12_defer": {12: [66, 66], 13: [0, 1]},
    "fwd_sm90_sm_90a_bf16_d256_128x64w12_defer_thr8": {12: [34, 32], 13: [5, 15]},
    "fwd_sm90_sm_90a_bf16_d64_192x128w16_defer": {12: [66, 64], 13: [0, 0]},
}


@pytest.mark.compile
@pytest.mark.parametrize("field, value, d, tile_m, flags", TUNING_CASES)
def test_sm90_fwd_tuning_field_compiles(capfd, field, value, d, tile_m, flags) -> None:
    asked = {field: value} | ({"tile_m": tile_m} if tile_m else {})
    config = _planned(d, asked, **flags)
    if tile_m:
        assert config.tile_m == tile_m
    sass = _check_compiled(config, capfd)
    if field == "defer_rescale":
        assert config.tuning.defer_rescale is value
    if field == "defer_rescale" and not flags:
        # The exponentials of a loop step (tile_n / 2 of P, 2 of the rescale factors) sit
        # between wgmma wait_group 1 and wait_group 0 (class docstring), exactly as many per
        # loop as OVERLAP_WINDOW_EXPONENTIALS says for this build's ptxas.
        inside = _exponentials_in_overlap_window(sass)
        expected = OVERLAP_WINDOW_EXPONENTIALS[config.name]
        major = dsl_cuda_major()
        assert major in expected, f"no expectation for the CUDA {major} build: counted {inside}"
        assert inside == expected[major], (config.name, major, inside)
    if field == "rescale_threshold":
        # Each key-block loop skips its O rescale behind one warp vote; with the deferred
        # rescale (d64 by default) the rescale before the last P V has one too.
        assert config.tuning.rescale_threshold == value and f"thr{value}" in config.name
        votes = (3 if config.local else 2) + (1 if config.tuning.defer_rescale else 0)
        assert sass.count("VOTE.ANY") == votes, sass.count("VOTE.ANY")
    if field == "pingpong":
        # No turns: the consumers' named-barrier waits and arrivals of the pingpong are gone
        # (the epilogue's barriers stay).
        default = _sass(config.with_tuning(pingpong=True))
        assert not config.tuning.pingpong and "nopingpong" in config.name
        turns = default.count("BAR.ARV") + default.count("BAR.SYNC")
        assert sass.count("BAR.ARV") + sass.count("BAR.SYNC") < turns
    if field == "tma_store":
        # O by TMA store: one UTMASTG per 64-column box of a consumer's (64, dv) tile, no
        # 16-byte global stores left (the two STG.E are the LSE); varlen queries keep them.
        stores = len(re.findall(r"\bUTMASTG", sass))
        wide = sass.count("STG.E.128")
        if config.varlen_q:
            assert not config.tuning.tma_store and stores == 0 and wide > 0
        else:
            assert config.tuning.tma_store and "tmastore" in config.name
            assert stores == max(1, config.head_dim_v // 64) and wide == 0, (stores, wide)
    if field == "overlap":
        # No overlap: every wait after an issue is wait_group 0 (the default's loops wait for
        # S alone with wait_group 1).
        assert not config.tuning.overlap and "nooverlap" in config.name
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in sass
        assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") >= 3
    if field == "exp2_poly":
        # Each thread's row of an unmasked block (tile_n / 2 scores) has tile_n / 2 / k
        # polynomial exponentials; the kernel has one unmasked loop.
        default = _sass(config.with_tuning(exp2_poly=0))
        assert config.tuning.exp2_poly == value and f"poly{value}" in config.name
        fewer = default.count("MUFU.EX2") - sass.count("MUFU.EX2")
        assert fewer == config.tile_n // 2 // config.tuning.exp2_poly, fewer


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


# Compiles of this process: config -> (compile_and_inspect's report, what ptxas printed), so a
# test that compares a tuning field's SASS with the default's reuses a compile made before.
_COMPILED: dict[FwdConfig, tuple[dict, str]] = {}


def _compile(config: FwdConfig, capfd=None) -> tuple[dict, str]:
    if config not in _COMPILED:
        if capfd is not None:
            capfd.readouterr()
        info = compile_and_inspect(config)
        out, err = capfd.readouterr() if capfd is not None else ("", "")
        _COMPILED[config] = (info, out + err)
    return _COMPILED[config]


def _sass(config: FwdConfig) -> str:
    """The SASS of ``config`` (compiled once a process)."""
    return _compile(config)[0]["sass_text"]


def _check_compiled(config: FwdConfig, capfd) -> str:
    """Compile ``config`` for sm_90a and check its SASS (see the module docstring)."""
    d = config.head_dim
    info, output = _compile(config, capfd)
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
    assert "setmaxnreg" not in output.lower(), "ptxas warned about setmaxnreg"
    # The WGMMA serialization warnings (C7510-C7520: wgmma serialized for some reason) never
    # appear (the WARPGROUP.ARRIVE count above sees the effect, this the warning itself).
    assert not re.search(r"C75(1\d|20)", output), "ptxas serialized WGMMAs"
    return sass


# --------------------------------------------------------------------------------------------
# Split-KV (FwdConfig.split_kv): fp32 partial O and LSE of one range of key blocks a CTA.

SPLIT_CASES = [
    pytest.param(128, 128, {}, id="d128"),
    pytest.param(64, 64, {"causal": True}, id="d64-causal"),
    pytest.param(256, 256, {**VARLEN_SEQUSED_K, "causal": True}, id="d256-causal-varlen-seqused"),
    pytest.param(192, 128, LOCAL_SOFTCAP, id="d192x128-local-softcap", marks=EXHAUSTIVE),
    pytest.param(96, 96, {"varlen_k": True}, id="d96-varlen_k", marks=EXHAUSTIVE),
]


@pytest.mark.compile
@pytest.mark.parametrize("d, dv, flags", SPLIT_CASES)
def test_sm90_fwd_split_kv_compiles(d: int, dv: int, flags: dict, capfd) -> None:
    """The split variant planning builds (one CTA a tile, O by the registers' fp32 stores)
    passes every SASS check of the unsplit kernel, stores O with 8-byte STG (pairs of
    neighbouring fp32 columns of the accumulator) and stages nothing in shared memory for it."""
    config = _planned(d, dv=dv, split_kv=True, **flags)
    assert config.split_kv and config.name.endswith("_splitkv")
    assert not config.tuning.num_ctas and not config.tuning.tma_store
    sass = _check_compiled(config, capfd)
    assert re.search(r"STG\.E\.64\b", sass), "fp32 O pairs stored as 8-byte vectors"
    # Only the V tail zeroing of seqused_k stores to shared memory (_check_compiled): O is not
    # staged there.
    assert "STS.U16" in sass or "STS" not in sass
    assert "UTMASTG" not in sass


def test_sm90_split_kv_rejects_persistent_and_tma_store() -> None:
    for tuning, needle in ((Sm90FwdTuning(num_ctas=132), "persistent grid"),
                           (Sm90FwdTuning(tma_store=True), "tma_store")):  # fmt: skip
        ok, reason = fwd_can_implement(_config(tuning, split_kv=True))
        assert not ok and needle in reason and "split-KV" in reason, reason
    # Asked for (an override), planning keeps a split call off both.
    config = _planned(128, {"num_ctas": 132, "tma_store": True}, split_kv=True)
    assert fwd_can_implement(config) == (True, "")
    assert not config.tuning.num_ctas and not config.tuning.tma_store


def test_sm90_split_kv_keeps_the_unsplit_keys() -> None:
    """split_kv off changes no existing compile key or name (the cache's entries stay valid)."""
    config = _planned(128)
    assert "split" not in config.name and not config.split_kv
    assert config.replace(split_kv=True).name == config.name + "_splitkv"


# --------------------------------------------------------------------------------------------
# Packed GQA (FwdConfig.pack_gqa, Note [packed GQA] in cute_fa/dsl/pack_gqa.py): the query heads
# of a K/V head as (G, seqlen) rows of one tile.

PACK_CASES = [
    pytest.param(128, 128, 4, {"causal": True}, id="d128-g4-causal"),
    pytest.param(64, 64, 8, {**VARLEN_SEQUSED_K, "causal": True}, id="d64-g8-varlen-seqused"),
    pytest.param(128, 128, 2, {"split_kv": True}, id="d128-g2-split"),
    pytest.param(256, 256, 16, LOCAL_SOFTCAP, id="d256-g16-local-softcap", marks=EXHAUSTIVE),
    pytest.param(192, 128, 64, {}, id="d192x128-g64", marks=EXHAUSTIVE),
]


@pytest.mark.compile
@pytest.mark.parametrize("d, dv, group, flags", PACK_CASES)
def test_sm90_fwd_pack_gqa_compiles(d: int, dv: int, group: int, flags: dict, capfd) -> None:
    """The packed variant passes every SASS check of the unpacked kernel; Q comes in by one
    5-D TMA box a consumer and d-chunk (d, G, seqlen, K/V heads, batch), where the unpacked Q
    box is 4-D; K and V stay 4-D."""
    config = _planned(d, dv=dv, pack_gqa=group, **flags)
    assert config.pack_gqa == group and f"_packgqa{group}" in config.name
    assert not config.tuning.num_ctas and not config.tuning.tma_store
    sass = _check_compiled(config, capfd)
    assert "UTMALDG.5D" in sass, "packed Q by a 5-D TMA box"
    assert "UTMALDG.4D" in sass, "K and V by 4-D TMA boxes"
    unpacked = _sass(config.replace(pack_gqa=0))
    assert "UTMALDG.5D" not in unpacked


def test_sm90_pack_gqa_keeps_the_unpacked_keys() -> None:
    """pack_gqa off changes no existing compile key or name (the cache's entries stay valid)."""
    config = _planned(128)
    assert "pack" not in config.name and not config.pack_gqa
    assert config.replace(pack_gqa=4).name == config.name + "_packgqa4"


# --------------------------------------------------------------------------------------------
# Paged K/V (FwdConfig.page_size): a key block as TMA boxes of gcd(page_size, tile_n) keys, each
# from the page the page table names.

PAGE_CASES = [
    pytest.param(128, 128, 16, {**CAUSAL_SEQUSED_K}, id="d128-page16-causal-seqused"),
    pytest.param(128, 128, 128, {}, id="d128-page128"),
    pytest.param(
        64,
        64,
        48,
        {"varlen_q": True, "split_kv": True, "pack_gqa": 4},
        id="d64-page48-varlen_q-split-pack",
    ),  # fmt: skip
    pytest.param(192, 128, 16, LOCAL_SOFTCAP, id="d192x128-page16-local-softcap", marks=EXHAUSTIVE),
    pytest.param(256, 256, 256, {"seqused_k": True}, id="d256-page256-seqused", marks=EXHAUSTIVE),
]


@pytest.mark.compile
@pytest.mark.parametrize("d, dv, page_size, flags", PAGE_CASES)
def test_sm90_fwd_paged_compiles(d: int, dv: int, page_size: int, flags: dict, capfd) -> None:
    """The paged variant passes every SASS check of the unpaged kernel (0 spills: the producer
    warp's 24 registers hold the box loop) and loads K and V by 4-D TMA boxes."""
    config = _planned(d, dv=dv, page_size=page_size, **flags)
    assert config.page_size == page_size and config.name.endswith(f"_page{page_size}")
    assert not config.tuning.num_ctas
    sass = _check_compiled(config, capfd)
    assert "UTMALDG.4D" in sass


@pytest.mark.parametrize("page_size", [1, 4, 12, 20])
def test_sm90_paged_needs_boxes_of_eight_keys(page_size: int) -> None:
    ok, reason = fwd_can_implement(_config(page_size=page_size))
    assert not ok and "multiples of 8" in reason, reason


@pytest.mark.parametrize("d, dv", [(96, 96), (192, 192), (192, 128)])
def test_sm90_paged_narrow_swizzles_need_boxes_of_sixteen_keys(d: int, dv: int) -> None:
    """d96 / d192 tiles (narrower swizzle atoms) take boxes of 16 keys or more
    (hopper/support.py: SM90_FWD_PAGE_BOX_ALIGN_NARROW, from the GPU runs); other head dims
    boxes of 8."""
    narrow = _tiled_config(d, dv)
    ok, reason = fwd_can_implement(narrow.replace(page_size=8))
    assert not ok and "multiples of 16" in reason, reason
    assert fwd_can_implement(narrow.replace(page_size=16)) == (True, "")
    assert fwd_can_implement(_tiled_config(128, 128).replace(page_size=8)) == (True, "")
