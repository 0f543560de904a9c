"""Small contracts of ``cute_fa.config``: the sm80 tile tables' edges and messages (the tables
themselves: tests/test_dispatch.py, tests/test_compile_sm80*.py)."""

from __future__ import annotations

import pytest

from cute_fa.config import Tiles, sm80_bwd_tile


def test_sm80_backward_tile_of_an_unknown_head_dim_is_named():
    with pytest.raises(NotImplementedError) as info:
        sm80_bwd_tile(80, "sm_80")
    assert str(info.value) == (
        "head_dim=80 is not supported by the sm80 backward kernel "
        "(supported: [64, 96, 128, 192, 256])"
    )


def test_sm80_backward_tile_of_an_unknown_target_is_the_small_one():
    # a target without a known shared-memory size gets the tiles of 99 KiB targets
    assert sm80_bwd_tile(128, "sm_70") == Tiles(64, 64, 8) == sm80_bwd_tile(128, "sm_86")
    assert sm80_bwd_tile(64, "sm_70") == Tiles(64, 128, 8)
