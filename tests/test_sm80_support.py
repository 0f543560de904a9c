"""What the sm80 kernels take, asked of ``ampere/support.py`` directly: each reason a forward or
backward config is declined, the backward's shared memory and Q stages, and the rows of its
dQ accumulator (the kernels themselves: tests/test_compile_sm80*.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cute_fa.ampere import support

from cute_fa.config import BwdConfig, FwdConfig, Sm90BwdTuning, Sm100FwdTuning, Tiles


def fwd(tiles=(128, 64, 4), head_dim=128, head_dim_v=None, target="sm_80", arch=80):
    return FwdConfig(
        arch=arch, target=target, dtype="bf16", head_dim=head_dim,
        head_dim_v=head_dim if head_dim_v is None else head_dim_v, tuning=Tiles(*tiles),
    )  # fmt: skip


def bwd(tuning=None, head_dim=128, head_dim_v=None, target="sm_80", arch=80):
    return BwdConfig(
        arch=arch, target=target, dtype="bf16", head_dim=head_dim,
        head_dim_v=head_dim if head_dim_v is None else head_dim_v,
        tuning=Tiles(64, 128, 8) if tuning is None else tuning,
    )  # fmt: skip


def test_forward_reasons():
    assert support.fwd_can_implement(fwd()) == (True, "")
    assert support.fwd_can_implement(fwd(arch=90)) == (
        False, "config is for sm90, this kernel is sm80"
    )  # fmt: skip
    # every multiple of 8 up to 256 (Note [rounded head dims]), and the pairs
    for d in (8, 40, 80, 112, 160, 248):
        assert support.fwd_can_implement(fwd(head_dim=d)) == (True, ""), d
    assert support.fwd_can_implement(fwd(head_dim=192, head_dim_v=128)) == (True, "")
    assert support.fwd_can_implement(fwd(head_dim=128, head_dim_v=64)) == (True, "")
    assert support.fwd_can_implement(fwd(head_dim=84)) == (
        False, "head_dim 84 is not a positive multiple of 8 up to 256"
    )  # fmt: skip
    assert support.fwd_can_implement(fwd(head_dim=264)) == (
        False, "head_dim 264 is not a positive multiple of 8 up to 256"
    )  # fmt: skip
    assert support.fwd_can_implement(fwd(head_dim=64, head_dim_v=12)) == (
        False, "head_dim_v 12 is not a positive multiple of 8 up to 256"
    )  # fmt: skip
    assert support.fwd_can_implement(fwd(head_dim=64, head_dim_v=128)) == (
        False, "head_dim_v 128 with head_dim 64 is not supported on sm80 (head_dim_v == "
        "head_dim, or the pairs ((128, 64), (192, 128)))"
    )  # fmt: skip
    # 48 rows over 4 warps: not 16 rows a warp (48 is a multiple of 16 / 4, not of 16 * 4)
    assert support.fwd_can_implement(fwd(tiles=(48, 64, 4))) == (
        False, "tile_m 48 is not a multiple of 16 * num_warps"
    )  # fmt: skip


def test_backward_reasons():
    assert support.bwd_can_implement(bwd()) == (True, "")
    assert support.bwd_can_implement(bwd(arch=90)) == (
        False, "config is for sm90, this kernel is sm80"
    )  # fmt: skip
    for d in (8, 40, 80, 112):
        assert support.bwd_can_implement(bwd(head_dim=d)) == (True, ""), d
    assert support.bwd_can_implement(bwd(Tiles(64, 64, 8), head_dim=192, head_dim_v=128)) == (
        True, ""
    )  # fmt: skip
    assert support.bwd_can_implement(bwd(head_dim=128, head_dim_v=64)) == (True, "")
    assert support.bwd_can_implement(bwd(head_dim=84)) == (
        False, "head_dim 84 is not a positive multiple of 8 up to 256"
    )  # fmt: skip
    assert support.bwd_can_implement(bwd(head_dim=96, head_dim_v=64)) == (
        False, "head_dim_v 64 with head_dim 96 is not supported on sm80 (head_dim_v == "
        "head_dim, or the pairs ((128, 64), (192, 128)))"
    )  # fmt: skip
    assert support.bwd_can_implement(bwd(Tiles(64, 96, 4))) == (
        False, "tile_n must be a multiple of 64"
    )  # fmt: skip
    # another family's tuning: 12 warps (d 64 does not split over 3 warps of 16 columns)...
    assert support.bwd_can_implement(bwd(Sm90BwdTuning(64, 192), head_dim=64)) == (
        False, "head_dim 64 does not split over 3 warps"
    )  # fmt: skip
    # ... 16 warps (four of 16 columns: d 96 does not split)
    assert support.bwd_can_implement(bwd(Sm100FwdTuning(256, 128), head_dim=96)) == (
        False, "head_dim 96 does not split over 4 warps"
    )  # fmt: skip
    # ... and a rounded head dim names its tile head dim
    assert support.bwd_can_implement(bwd(Sm100FwdTuning(256, 128), head_dim=80)) == (
        False, "head_dim 80 (tile 96) does not split over 4 warps"
    )  # fmt: skip
    # a warp count that is not a whole number of warpgroups: no tuning class has one
    odd = SimpleNamespace(arch=80, head_dim=128, head_dim_v=128, num_warps=6)
    assert support.bwd_can_implement(odd) == (False, "num_warps must be a multiple of 4")


def test_a_tile_n_off_the_mma_grid_is_declined():
    # every tuning class checks this itself: only a stand-in config reaches the kernel's check
    odd = SimpleNamespace(
        arch=80,
        head_dim=128,
        head_dim_v=128,
        tile_m=128,
        tile_n=72,
        num_warps=4,
        target="sm_80",
        split_kv=False,
        pack_gqa=0,
        page_size=0,
    )
    assert support.fwd_can_implement(odd) == (False, "tile_n 72 is not a multiple of 16")


def test_an_unknown_target_has_no_shared_memory_for_the_forward():
    assert support.fwd_can_implement(fwd(target="sm_70")) == (
        False, "tile needs 65536 B of shared memory, more than sm_70 has"
    )  # fmt: skip


def test_an_unknown_target_has_no_shared_memory():
    ok, reason = support.bwd_can_implement(bwd(target="sm_70"))
    assert (ok, reason) == (False, "tiles need 131584 B of shared memory, more than sm_70 has")
    assert support.bwd_q_stages(bwd(target="sm_70")) == 1


def test_backward_shared_memory():
    # (2 K/V tiles of 128 x 96 + 2 Q/dO stages of 64 x 96 + P and dS of 64 x 128) 16-bit,
    # + 2 stages of LSE and delta rows (fp32)
    config = bwd(head_dim=96)
    assert support.bwd_smem_bytes(config, 2) == (24576 + 24576 + 16384) * 2 + 2 * 2 * 64 * 4
    assert support.bwd_smem_bytes(config, 1) == (24576 + 12288 + 16384) * 2 + 2 * 64 * 4
    assert (
        support.bwd_smem_bytes(bwd(Tiles(32, 64, 4), head_dim=64), 1)
        == (8192 + 4096 + 4096) * 2 + 256
    )


def test_backward_q_stages(monkeypatch):
    # d 64 at 128 x 128 on sm_80: two stages and 1 KiB of barriers fill its 163 KiB exactly
    large = bwd(Tiles(128, 128, 8), head_dim=64)
    assert support.bwd_smem_bytes(large, 2) + 1024 == 163 * 1024
    assert support.bwd_q_stages(large) == 2
    assert support.bwd_q_stages(bwd(Tiles(128, 128, 8), head_dim=64, target="sm_86")) == 1
    assert support.bwd_q_stages(bwd(head_dim=128)) == 2  # 161 KiB
    # one byte less than that exact fit: one stage
    monkeypatch.setitem(support.SMEM_CAPACITY, "sm_test", 163 * 1024 - 1)
    assert support.bwd_q_stages(bwd(Tiles(128, 128, 8), head_dim=64, target="sm_test")) == 1
    # rounded head dims take the shared memory of their tile head dim
    for d in (8, 40, 56):
        config = bwd(Tiles(128, 128, 8), head_dim=d)
        assert support.bwd_smem_bytes(config, 2) == support.bwd_smem_bytes(large, 2)


def test_head_dim_pairs_shared_memory():
    """(d, dv): K-side tiles of d columns, V-side of dv (Note [rounded head dims])."""
    pair = bwd(head_dim=128, head_dim_v=64)  # 64 x 128 tiles
    tiles = 128 * (128 + 64) + 2 * 64 * (128 + 64) + 2 * 64 * 128
    assert support.bwd_smem_bytes(pair, 2) == tiles * 2 + 2 * 2 * 64 * 4
    assert support.fwd_smem_bytes(fwd(head_dim=192, head_dim_v=128)) == (
        (128 * 192 + 64 * (192 + 128)) * 2
    )
    assert support.fwd_smem_bytes(fwd(head_dim=40)) == support.fwd_smem_bytes(fwd(head_dim=64))


@pytest.mark.parametrize("varlen", [False, True])
def test_dq_accumulator_offsets(varlen):
    # varlen: sequence b's blocks start b tiles after its first query row; dense: at it
    assert support.dq_accum_offset(100, 3, 64, varlen) == (292 if varlen else 100)
    assert support.dq_accum_offset(0, 0, 64, varlen) == 0
