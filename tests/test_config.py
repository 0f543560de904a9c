"""Small contracts of ``cute_fa.config``: the sm80 tile tables' edges and messages (the tables
themselves: tests/test_dispatch.py, tests/test_compile_sm80*.py)."""

from __future__ import annotations

import pytest

from cute_fa.config import (
    SM80_TILE_HEAD_DIMS,
    BwdConfig,
    FwdConfig,
    Sm90BwdTuning,
    Sm90FwdTuning,
    Tiles,
    TuningError,
    capability_for_target,
    check_field_types,
    dq_accum_head_dim,
    sm80_bwd_tile,
    sm80_fwd_tile,
    tile_head_dim,
)


def test_sm80_backward_tile_of_an_unknown_head_dim_is_named():
    with pytest.raises(NotImplementedError) as info:
        sm80_bwd_tile(84, "sm_80")
    assert str(info.value) == (
        "the sm80 backward kernel: head_dim 84 is not a positive multiple of 8 up to 256"
    )
    with pytest.raises(NotImplementedError, match="the sm80 forward kernel: head_dim 264"):
        sm80_fwd_tile(264, "sm_80")


def test_tile_head_dim_rounds_up_to_the_next_tile():
    """Note [rounded head dims]: every multiple of 8 up to 256 takes the smallest tile head dim
    that holds it, and its tiles are that head dim's."""
    expect = {
        8: 64,
        32: 64,
        40: 64,
        64: 64,
        72: 96,
        80: 96,
        96: 96,
        104: 128,
        112: 128,
        128: 128,
        136: 192,
        160: 192,
        192: 192,
        200: 256,
        224: 256,
        248: 256,
        256: 256,
    }
    for d in range(8, 257, 8):
        t = tile_head_dim(d)
        assert t in SM80_TILE_HEAD_DIMS and d <= t
        assert all(u < d for u in SM80_TILE_HEAD_DIMS if u < t)
        assert t == expect.get(d, t)
        for target in ("sm_80", "sm_86", "sm_90a"):
            for causal in (False, True):
                assert sm80_fwd_tile(d, target, causal) == sm80_fwd_tile(t, target, causal)
            assert sm80_bwd_tile(d, target) == sm80_bwd_tile(t, target)
        assert dq_accum_head_dim(80, d) == t and dq_accum_head_dim(90, d) == d
    for bad in (0, 4, 12, 260, 264, -8):
        with pytest.raises(NotImplementedError, match=f"head_dim {bad} is not"):
            tile_head_dim(bad)
    for bad in (64.0, True, "64"):
        with pytest.raises(ValueError, match="must be an int"):
            tile_head_dim(bad)


def test_sm80_backward_tile_of_an_unknown_target_is_the_small_one():
    # a target without a known shared-memory size gets the tiles of 99 KiB targets
    assert sm80_bwd_tile(128, "sm_70") == Tiles(64, 64, 8) == sm80_bwd_tile(128, "sm_86")
    assert sm80_bwd_tile(64, "sm_70") == Tiles(64, 128, 8)


def test_sm80_forward_tile_defaults_to_non_causal_and_small_unknown_targets():
    assert sm80_fwd_tile(256, "sm_80") == Tiles(128, 64, 8)  # causal d256: 64x64 w4
    assert sm80_fwd_tile(256, "sm_80", causal=True) == Tiles(64, 64, 4)
    assert sm80_fwd_tile(64, "sm_70") == Tiles(128, 128, 4) == sm80_fwd_tile(64, "sm_86")


def test_sm80_tiles_name_a_bad_warp_count():
    with pytest.raises(TuningError) as info:
        Tiles(128, 64, 6)
    assert str(info.value) == "num_warps must be 4 or 8, got 6"


def test_compile_key_names():
    # the names of cache entries and messages: family, target, dtype, head dims, tile, flags
    fwd = FwdConfig(80, "sm_80", "bf16", 192, 128, Tiles(128, 64, 8), has_softcap=True, local=True)
    assert fwd.name == "fwd_sm80_sm_80_bf16_d192x128_128x64w8_local_softcap"
    plain = FwdConfig(80, "sm_86", "fp16", 64, 64, Tiles(64, 64, 4), causal=True, varlen_q=True)
    assert plain.name == "fwd_sm80_sm_86_fp16_d64_64x64w4_causal_varlen_q"


def test_an_unknown_target_is_named():
    with pytest.raises(ValueError) as info:
        capability_for_target("sm_70")
    assert str(info.value) == (
        "unknown target 'sm_70'; known: sm_100a, sm_103a, sm_120a, sm_80, sm_86, sm_87, sm_89, "
        "sm_90a"
    )


@pytest.mark.parametrize("flags", [{}, {"deterministic": True, "local": True}])
def test_a_coresident_key_needs_deterministic_and_no_window(flags):
    with pytest.raises(ValueError) as info:
        BwdConfig(80, "sm_80", "bf16", 64, 64, Tiles(64, 128, 8), det_coresident=True, **flags)
    assert str(info.value) == "BwdConfig: det_coresident needs deterministic and no window"


def test_key_and_tile_messages_name_the_field_and_the_class():
    with pytest.raises(TuningError) as info:
        Tiles(20, 64, 4)
    assert str(info.value) == "tile_m must be a multiple of 16 from 16 to 256, got 20"
    with pytest.raises(TuningError) as info:
        Tiles(64, 300, 4)
    assert str(info.value) == "tile_n must be a multiple of 16 from 16 to 256, got 300"
    with pytest.raises(ValueError) as info:
        FwdConfig(80, "sm_80", "fp32", 64, 64, Tiles(64, 64, 4))
    assert str(info.value) == "FwdConfig.dtype must be one of ('bf16', 'fp16'), got 'fp32'"
    with pytest.raises(ValueError) as info:
        BwdConfig(80, "sm_80", "bf16", 64, 64, Tiles(64, 64, 4), causal=True, local=True)
    assert str(info.value) == "BwdConfig: causal and local are exclusive"


def test_tiles_run_from_16_to_256():
    assert Tiles(16, 256, 4).label == "16x256w4"
    assert Sm90BwdTuning(tile_m=256, tile_n=16).label == "256x16w12"
    for bad in (0, 272):  # multiples of 16 outside the range
        with pytest.raises(TuningError) as info:
            Tiles(bad, 64, 4)
        assert str(info.value) == f"tile_m must be a multiple of 16 from 16 to 256, got {bad}"


def test_field_type_messages():
    with pytest.raises(TuningError) as info:
        check_field_types(Sm90BwdTuning, {"q_stages": 1.0})
    assert str(info.value) == "q_stages must be an int, got 1.0"
    with pytest.raises(TuningError) as info:
        check_field_types(Sm90BwdTuning, {"tile_m": True})
    assert str(info.value) == "tile_m must be an int, got True"
    check_field_types(Sm90BwdTuning, {"tile_m": 64, "unknown": "anything"})  # not a field: no type


def test_field_types_given_as_classes_are_read_by_name():
    # a dataclass whose annotations are types, not strings (no ``from __future__ import
    # annotations``): its int and bool fields are checked as those of cute_fa's tunings
    import dataclasses

    cls = dataclasses.make_dataclass("Made", [("n", int), ("flag", bool)])
    check_field_types(cls, {"n": 3, "flag": False})
    with pytest.raises(TuningError, match="n must be an int, got '3'"):
        check_field_types(cls, {"n": "3"})
    with pytest.raises(TuningError, match="flag must be True or False, got 1"):
        check_field_types(cls, {"flag": 1})


def test_forward_key_pack_gqa_and_page_size():
    base = FwdConfig(90, "sm_90a", "bf16", 128, 128, Sm90FwdTuning(), split_kv=True)
    assert (base.pack_gqa, base.page_size) == (0, 0)
    key = base.replace(pack_gqa=2, page_size=1)
    assert key.name == "fwd_sm90_sm_90a_bf16_d128_128x128w12_splitkv_packgqa2_page1"
    for bad in (-1, True, 16.0):
        with pytest.raises(ValueError) as info:
            base.replace(page_size=bad)
        assert str(info.value) == f"FwdConfig.page_size must be an int >= 0, got {bad!r}"
    with pytest.raises(ValueError) as info:
        base.replace(page_size=16, varlen_k=True)
    assert str(info.value) == "FwdConfig: paged K/V (page_size) takes no cu_seqlens_k (varlen_k)"
    base.replace(page_size=16, varlen_q=True)
    for bad in (True, 2.0):
        with pytest.raises(ValueError) as info:
            base.replace(pack_gqa=bad)
        assert str(info.value) == f"FwdConfig.pack_gqa must be an int, got {bad!r}"
    for bad in (1, -1):
        with pytest.raises(ValueError) as info:
            base.replace(pack_gqa=bad)
        assert str(info.value) == (
            f"FwdConfig.pack_gqa must be 0 (off) or the query heads per K/V head (>= 2), got {bad}"
        )
