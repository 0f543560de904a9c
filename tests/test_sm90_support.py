"""What the sm90 kernels take, asked of ``hopper/support.py`` directly (planning and the
kernels' own checks: tests/test_compile_sm90*.py, tests/test_dispatch.py)."""

from __future__ import annotations

from cute_fa.hopper import support


def test_forward_warps_by_tile_m():
    # a producer warpgroup and one consumer warpgroup per 64 query rows
    assert [support.fwd_num_consumers(m) for m in (64, 128, 192)] == [1, 2, 3]
    assert [support.fwd_num_warps(m) for m in (64, 128, 192)] == [8, 12, 16]


def test_forward_warps_are_ints():
    assert all(type(support.fwd_num_consumers(m)) is int for m in (64, 128, 192))
