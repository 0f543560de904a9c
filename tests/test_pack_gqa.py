"""Packed GQA on the CPU: the ``pack_gqa`` argument, the heuristic, planning (which kernels
pack which group sizes) and the compile key. tests/test_compile_sm90.py compiles the packed
kernels; tests/test_pack_gqa_gpu.py runs them."""

from __future__ import annotations

import pytest
import torch

from cute_fa import flash_attn_func, flash_attn_varlen_func, ops, planning, settings
from cute_fa.api import resolve_pack_gqa
from cute_fa.checks import Shapes
from cute_fa.config import FwdConfig, Sm90FwdTuning
from cute_fa.planning import FwdRequest, pack_gqa_helps, try_plan

NEEDS_CUDA = "cute_fa runs on CUDA GPUs"


def _qkv(sq=1, h=8, hk=2, d=128):
    return (torch.randn(1, sq, h, d, dtype=torch.bfloat16),
            torch.randn(1, 300, hk, d, dtype=torch.bfloat16),
            torch.randn(1, 300, hk, d, dtype=torch.bfloat16))  # fmt: skip


@pytest.mark.parametrize("value, want", [(None, -1), (False, 0), (True, 1)])
def test_resolve_pack_gqa(value, want) -> None:
    assert resolve_pack_gqa(value) == want


@pytest.mark.parametrize("value", [1, 0, "yes", 1.0])
def test_pack_gqa_must_be_a_bool_or_none(value) -> None:
    with pytest.raises(TypeError, match="pack_gqa must be True, False or None"):
        flash_attn_func(*_qkv(), pack_gqa=value)


@pytest.mark.parametrize("value", [None, True, False])
def test_pack_gqa_is_accepted(value) -> None:
    """No NotImplementedError: CPU tensors go on to the device check."""
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_func(*_qkv(), pack_gqa=value)
    q, k, v = (t[0] for t in _qkv())
    cu_q = torch.tensor([0, 1], dtype=torch.int32)
    cu_k = torch.tensor([0, 300], dtype=torch.int32)
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, pack_gqa=value)


@pytest.mark.parametrize(
    "seqlen_q, group, tile_m, want",
    [
        (1, 4, 128, True),  # 1 of 128 rows against 4 of 128
        (1, 1, 128, False),  # MHA: nothing to pack
        (0, 4, 128, False),
        (4, 8, 128, True),
        (128, 4, 128, False),  # full tiles either way
        (2048, 8, 128, False),
        (100, 2, 128, False),  # 100 / 128 and 200 / 256: the same share
        (40, 2, 128, True),  # 40 / 128 against 80 / 128: doubled
        (65, 2, 128, False),  # 65 / 128 against 130 / 256
        (64, 2, 192, True),  # 0.33 against 0.67
        (1000, 4, 192, False),  # 0.87 against 0.99 (a prefill: the persistent grid's calls)
        (20, 4, 128, True),
    ],
)
def test_pack_gqa_heuristic(seqlen_q, group, tile_m, want) -> None:
    assert pack_gqa_helps(seqlen_q, group, tile_m) is want


@pytest.mark.parametrize("group", [2, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("flags", [{}, {"causal": True}, {"local": True, "has_softcap": True},
                                   {"varlen_q": True, "varlen_k": True, "seqused_k": True},
                                   {"split_kv": True}])  # fmt: skip
def test_the_sm90_forward_packs_groups_that_divide_its_boxes(group, flags) -> None:
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, pack_gqa=group, **flags)
    cls, config, why = try_plan((9, 0), request, 4)
    assert cls is planning.SM90_FWD, why
    assert config.pack_gqa == group and f"packgqa{group}" in config.name
    assert not config.tuning.num_ctas and not config.tuning.tma_store  # one CTA a tile


@pytest.mark.parametrize("group", [3, 5, 6, 7, 12, 96])
def test_the_sm90_forward_does_not_pack_other_groups(group) -> None:
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, pack_gqa=group)
    cls, config, why = try_plan((9, 0), request, 1)
    assert cls is None and "pack_gqa" in why and "divide 64" in why, why


def test_the_sm100_forward_packs_powers_of_two() -> None:
    for group in (2, 4, 8, 16, 128):
        request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, pack_gqa=group)
        cls, config, why = try_plan((10, 0), request)
        assert cls is planning.SM100_FWD and config.pack_gqa == group, why
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, pack_gqa=6)
    assert try_plan((10, 0), request)[0] is None


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (12, 0)])
@pytest.mark.parametrize("flags", [{}, {"causal": True}, {"local": True, "has_softcap": True},
                                   {"varlen_q": True, "seqused_k": True, "split_kv": True,
                                    "page_size": 16}])  # fmt: skip
def test_the_sm80_forward_packs_groups_that_divide_its_tile(capability, flags) -> None:
    """The sm80 forward (tile_m 128 at d 128) packs groups that divide its tile or are a
    multiple of it, with split-KV and paged K/V too; the others it declines."""
    for group in (2, 4, 8, 16, 32, 64, 128, 256):
        request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, pack_gqa=group, **flags)
        cls, config, why = try_plan(capability, request, 4)
        assert cls is planning.SM80_FWD, why
        assert config.pack_gqa == group and f"packgqa{group}" in config.name
    for group in (3, 6, 12, 96):
        request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, pack_gqa=group, **flags)
        cls, _, why = try_plan(capability, request, 4)
        assert cls is None and "pack_gqa" in why and "divide tile_m 128" in why, why


def test_the_sm80_forward_packs_on_an_sm90_when_forced(monkeypatch) -> None:
    """CUTE_FA_FWD_ARCH=80 on an sm90 GPU (how the H200 runs the sm80 forward's GPU tests)."""
    monkeypatch.setenv(settings.FWD_ARCH, "80")
    request = FwdRequest(dtype="bf16", head_dim=64, head_dim_v=64, pack_gqa=8, split_kv=True,
                         page_size=1, seqused_k=True, causal=True)  # fmt: skip
    cls, config, why = try_plan((9, 0), request, 8)
    assert cls is planning.SM80_FWD and config.target == "sm_90a", why
    assert config.pack_gqa == 8 and config.split_kv and config.page_size == 1


def _shapes(sq, h, hk, **flags) -> Shapes:
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, **flags)
    return Shapes(2, sq, 4096, h, hk, 128, 128, False, False, request)


def _plan_args(shapes: Shapes, capability=(9, 0)):
    return (capability, shapes.request, shapes.seqlen_q, None)


@pytest.mark.parametrize(
    "sq, h, hk, pack, want",
    [
        (1, 32, 8, -1, 4),  # decode: None packs
        (1, 32, 8, 1, 4),
        (1, 32, 8, 0, 0),  # False never
        (4096, 32, 8, -1, 0),  # prefill: None does not
        (4096, 32, 8, 1, 4),  # True does
        (1, 8, 8, 1, 0),  # MHA: nothing to pack
        (1, 24, 4, 1, 0),  # a group of 6: the sm90 boxes do not take it, unpacked
        (1, 64, 1, -1, 64),  # MQA
    ],
)
def test_packed_plans(sq, h, hk, pack, want) -> None:
    shapes = _shapes(sq, h, hk)
    args = _plan_args(shapes)
    _, config = planning.fwd_plan(*args)
    packed_args, packed = ops._packed(args, config, shapes, pack)
    assert packed.pack_gqa == want
    assert packed_args[1].pack_gqa == want
    if want:  # the packed tile's rows: the group's heads of each position
        assert packed_args[2] == sq * want
    else:
        assert packed_args is args and packed is config


@pytest.mark.parametrize(
    "sq, h, hk, pack, want",
    [
        (1, 32, 8, -1, 4),  # decode: None packs (Note [pack_gqa heuristic], tile_m 128)
        (4, 32, 4, -1, 8),
        (1, 64, 1, -1, 64),  # MQA
        (4096, 32, 8, -1, 0),  # prefill: None does not
        (4096, 32, 8, 1, 4),  # True does
        (1, 32, 8, 0, 0),  # False never
        (1, 24, 4, 1, 0),  # a group of 6 does not divide the tile: unpacked
    ],
)
def test_packed_plans_on_sm80(sq, h, hk, pack, want) -> None:
    """The sm80 forward's plans pack as the sm90 forward's do (the same heuristic on its own
    tile_m)."""
    shapes = _shapes(sq, h, hk)
    args = _plan_args(shapes, (8, 0))
    _, config = planning.fwd_plan(*args)
    packed_args, packed = ops._packed(args, config, shapes, pack)
    assert packed.arch == 80 and packed.pack_gqa == want
    if not want:
        assert packed_args is args and packed is config


def test_split_heuristic_counts_packed_tiles(monkeypatch) -> None:
    """A packed decode step has one tile per (K/V head, batch), not per query head: the split
    heuristic sees 4x fewer tiles for a group of 4."""
    monkeypatch.setattr(ops, "sm_count", lambda device: 132)
    shapes = _shapes(1, 32, 8)
    _, config = planning.fwd_plan(*_plan_args(shapes))
    _, packed = ops._packed(_plan_args(shapes), config, shapes, 1)
    cpu = torch.device("cpu")
    # 2 batch x 32 heads = 64 tiles: 132 // 64 splits; packed 2 x 8 = 16 tiles: 132 // 16,
    # capped by 32 key blocks / 4.
    assert ops._heuristic_splits(config, shapes, 1, cpu) == 2
    assert ops._heuristic_splits(packed, shapes, 1, cpu) == min(132 // 16, 32 // 4) == 8


@pytest.mark.parametrize("bad", [1, -2, True, 2.0])
def test_fwd_config_pack_gqa_values(bad) -> None:
    with pytest.raises(ValueError, match="pack_gqa"):
        FwdConfig(arch=90, target="sm_90a", dtype="bf16", head_dim=128, head_dim_v=128,
                  tuning=Sm90FwdTuning(), pack_gqa=bad)  # fmt: skip


def test_describe_names_the_group() -> None:
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, causal=True, pack_gqa=8)
    assert request.describe() == "bf16, head_dim=128, causal, pack_gqa=8"


def test_a_split_call_keeps_its_packing(monkeypatch) -> None:
    """num_splits and pack_gqa together plan one kernel that splits and packs (the split plan
    starts from the packed request)."""
    compiled = []
    monkeypatch.setattr(ops, "_plans", {})
    monkeypatch.setattr(ops, "device_of", lambda *named: named[0][0].device)
    monkeypatch.setattr(ops, "capability", lambda _: (9, 0))
    monkeypatch.setattr(ops, "sm_count", lambda _: 132)
    monkeypatch.setattr(ops, "tuned_table", lambda _: None)
    monkeypatch.setattr(ops, "_compiled_kernel", lambda config: compiled.append(config) or
                        (lambda *args: None))  # fmt: skip
    monkeypatch.setattr(ops, "combine_kernel", lambda *args: "combine")
    monkeypatch.setattr(ops, "launch_combine", lambda *args: None)
    monkeypatch.setenv(settings.SELFTEST, "0")
    for num_splits, pack_gqa in ((3, True), (0, None)):
        compiled.clear()
        q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8192, 2, 128, dtype=torch.bfloat16) for _ in range(2))
        flash_attn_func(q, k, v, num_splits=num_splits, pack_gqa=pack_gqa)
        (config,) = compiled
        assert config.split_kv and config.pack_gqa == 4, config.name


def test_none_keeps_a_persistent_prefill_unpacked() -> None:
    """A prefill of 1000 rows (the persistent grid's default at d 128) stays unpacked with None;
    True packs it."""
    shapes = _shapes(1000, 16, 4)
    args = _plan_args(shapes)
    _, config = planning.fwd_plan(*args)
    assert config.tuning.num_ctas
    assert ops._packed(args, config, shapes, -1) == (args, config)
    assert ops._packed(args, config, shapes, 1)[1].pack_gqa == 4
