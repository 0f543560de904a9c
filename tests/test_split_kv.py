"""Split-KV on the CPU: the ``num_splits`` argument, the heuristic, and planning (which kernels
split). tests/test_compile_sm90.py compiles the split kernels; tests/test_split_kv_gpu.py runs
them."""

from __future__ import annotations

import pytest
import torch

from cute_fa import flash_attn_func, flash_attn_varlen_func, ops, planning
from cute_fa.api import resolve_num_splits
from cute_fa.checks import Shapes
from cute_fa.planning import FwdRequest, fwd_plan, num_splits_heuristic, try_plan

NEEDS_CUDA = "cute_fa runs on CUDA GPUs"


def _qkv(b=1, sq=1, sk=300, h=4, hk=2, d=64):
    return (torch.randn(b, sq, h, d, dtype=torch.bfloat16),
            torch.randn(b, sk, hk, d, dtype=torch.bfloat16),
            torch.randn(b, sk, hk, d, dtype=torch.bfloat16))  # fmt: skip


@pytest.mark.parametrize("value, want", [(None, 0), (0, 0), (-3, 0), (1, 1), (2, 2), (300, 300)])
def test_resolve_num_splits(value, want) -> None:
    assert resolve_num_splits(value) == want


@pytest.mark.parametrize("value", ["2", 2.0, True])
def test_num_splits_must_be_an_int(value) -> None:
    with pytest.raises(TypeError, match="num_splits must be an int"):
        flash_attn_func(*_qkv(), num_splits=value)


@pytest.mark.parametrize("num_splits", [0, None, 2, 3, 7])
def test_num_splits_is_accepted(num_splits) -> None:
    """No NotImplementedError any more: CPU tensors go on to the device check."""
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_func(*_qkv(), num_splits=num_splits)
    q, k, v = (t[0] for t in _qkv())
    cu_q = torch.tensor([0, 1], dtype=torch.int32)
    cu_k = torch.tensor([0, 300], dtype=torch.int32)
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               num_splits=num_splits)  # fmt: skip


@pytest.mark.parametrize(
    "tiles, key_blocks, sms, want",
    [
        (32, 64, 132, 4),  # decode, 32 heads: 132 // 32 SMs a tile
        (8, 64, 132, 16),  # key blocks // 4
        (1, 4096, 132, 128),  # at most SPLIT_MAX
        (1, 8, 132, 2),  # the shortest range that splits: 2 * 4 blocks
        (1, 7, 132, 1),
        (66, 64, 132, 2),  # tiles fill exactly half the SMs
        (67, 64, 132, 1),  # more than half
        (0, 64, 132, 1),
        (200, 4096, 132, 1),
    ],
)
def test_num_splits_heuristic(tiles, key_blocks, sms, want) -> None:
    assert num_splits_heuristic(tiles, key_blocks, sms) == want


def test_clamp_num_splits_to_the_grid() -> None:
    assert planning.clamp_num_splits(7, 1) == 7
    assert planning.clamp_num_splits(7, 0) == 7
    assert planning.clamp_num_splits(7, 20000) == 3  # 20000 * 3 <= 65535
    assert planning.clamp_num_splits(7, 65535) == 1


def _shapes(batch, sq, sk, h, varlen_k=False) -> Shapes:
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, varlen_k=varlen_k)
    return Shapes(batch, sq, sk, h, h, 128, 128, False, varlen_k, request)


def test_heuristic_splits_of_a_plan(monkeypatch) -> None:
    """ops counts tiles with the unsplit plan's tile and the device's SMs; packed keys use the
    average length."""
    monkeypatch.setattr(ops, "sm_count", lambda device: 132)
    _, config = fwd_plan((9, 0), _shapes(1, 1, 8192, 8).request, 1)
    assert (config.tile_m, config.tile_n) == (128, 128)
    device = torch.device("cpu")
    assert ops._heuristic_splits(config, _shapes(1, 1, 8192, 8), 1, device) == 16
    assert ops._heuristic_splits(config, _shapes(2, 1, 8192, 32), 1, device) == 2
    assert ops._heuristic_splits(config, _shapes(1, 4096, 8192, 32), 4096, device) == 1
    assert ops._heuristic_splits(config, _shapes(1, 1, 512, 8), 1, device) == 1  # 4 key blocks
    # Packed keys: 4 sequences of 16384 keys in all, 4096 on average (32 blocks).
    shapes = _shapes(4, 1, 16384, 2, varlen_k=True)
    assert ops._heuristic_splits(config, shapes, 1, device) == min(132 // 8, 32 // 4)


@pytest.mark.parametrize(
    "flags",
    [{}, {"causal": True}, {"local": True, "has_softcap": True},
     {"varlen_q": True, "varlen_k": True, "seqused_q": True, "seqused_k": True}],
)  # fmt: skip
def test_split_kv_plans_the_sm90_kernel(flags) -> None:
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, split_kv=True, **flags)
    cls, config = fwd_plan((9, 0), request, 1)
    assert cls is planning.SM90_FWD and config.split_kv
    assert not config.tuning.num_ctas  # one CTA a (query block, head, batch, split)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_split_kv_elsewhere_plans_the_sm80_kernel(capability) -> None:
    """Off sm90 the sm80 forward splits (sm100 has no split kernel yet: its GPUs run the sm80
    one for split calls, and the sm100 one for the rest)."""
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, split_kv=True)
    cls, config, why = try_plan(capability, request)
    assert cls is not None and cls.arch == 80 and config.split_kv, why
    unsplit, _, _ = try_plan(capability, FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128))
    assert unsplit.arch == (100 if capability[0] == 10 else 80)
