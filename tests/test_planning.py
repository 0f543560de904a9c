"""Small contracts of ``cute_fa.planning`` that dispatch tests only pass through: the kernel
classes of each family (imported, so the CuTe DSL loads), and the coresident order of the
deterministic sm80 backward."""

from __future__ import annotations

import pytest

from cute_fa import planning, settings
from cute_fa.config import BwdConfig, Tiles


def test_forward_kernel_class_of_each_family():
    assert planning.fwd_kernel_class(80).__name__ == "FlashAttentionForwardSm80"
    assert planning.fwd_kernel_class(90).__name__ == "FlashAttentionForwardSm90"
    assert planning.fwd_kernel_class(100).__name__ == "FlashAttentionForwardSm100"
    with pytest.raises(NotImplementedError) as info:
        planning.fwd_kernel_class(120)
    assert str(info.value) == "cute_fa has no sm120 forward kernel yet"


def test_backward_kernel_classes_of_each_family():
    names = [cls.__name__ for cls in planning.bwd_kernel_classes(80)]
    assert names == [
        "FlashAttentionBackwardPreprocessSm80",
        "FlashAttentionBackwardSm80",
        "FlashAttentionBackwardPostprocessSm80",
    ]
    names = [cls.__name__ for cls in planning.bwd_kernel_classes(90)]
    assert names == [
        "FlashAttentionBackwardPreprocessSm80",
        "FlashAttentionBackwardSm90",
        "FlashAttentionBackwardPostprocessSm80",
    ]
    names = [cls.__name__ for cls in planning.bwd_kernel_classes(100)]
    assert names == [
        "FlashAttentionBackwardPreprocessSm80",
        "FlashAttentionBackwardSm100",
        "FlashAttentionBackwardPostprocessSm80",
    ]
    with pytest.raises(NotImplementedError) as info:
        planning.bwd_kernel_classes(120)
    assert str(info.value) == "cute_fa has no sm120 backward kernel yet"


def _det(**flags) -> BwdConfig:
    return BwdConfig(80, "sm_80", "bf16", 128, 128, Tiles(64, 128, 8), deterministic=True, **flags)


def test_coresident_order_needs_the_key_blocks_on_half_the_sms(monkeypatch):
    monkeypatch.delenv(settings.BWD_DET_ORDER, raising=False)
    # 128 keys a CTA: 66 key blocks fit on half of 132 SMs, 67 do not; 133 SMs: still 66
    assert planning.coresident_fits(_det(), 66 * 128, 132)
    assert planning.coresident_fits(_det(), 66 * 128 - 127, 132)
    assert not planning.coresident_fits(_det(), 66 * 128 + 1, 132)
    assert not planning.coresident_fits(_det(), 66 * 128 + 1, 133)
    assert planning.coresident_fits(_det(), 1, 2)
    assert not planning.coresident_fits(_det(), 1, 1)
    assert not planning.coresident_fits(_det(local=True), 128, 132)
    assert not planning.coresident_fits(_det().replace(deterministic=False), 128, 132)
    assert not planning.coresident_fits(_det().replace(arch=90), 128, 132)
    monkeypatch.setenv(settings.BWD_DET_ORDER, "chain")
    assert not planning.coresident_fits(_det(), 128, 132)


def test_sm80_forward_takes_the_tuned_entry_of_its_causal_problem_class(monkeypatch):
    from cute_fa import tuned
    from cute_fa.planning import SM80_FWD, FwdRequest, fwd_config_for_target

    key = tuned.TableKey("GPU", 1, 0, "0", "0")
    table = tuned.Table(key, {"sm80_fwd": {"d128-causal": {"tile_n": 32}, "d128": {"tile_n": 48}}})
    causal, _ = fwd_config_for_target(
        SM80_FWD, "sm_80", FwdRequest("bf16", 128, 128, True), None, table
    )
    plain, _ = fwd_config_for_target(SM80_FWD, "sm_80", FwdRequest("bf16", 128, 128), None, table)
    assert (causal.tile_n, plain.tile_n) == (32, 48)


def test_sm100_forward_takes_the_tuned_entry_of_its_problem_class():
    from cute_fa import tuned
    from cute_fa.planning import SM100_FWD, FwdRequest, fwd_config_for_target

    key = tuned.TableKey("GPU", 1, 0, "0", "0")
    entries = {"d128-causal": {"tile_n": 64}, "d128": {"tile_n": 128}, "d64": {"tile_n": 32}}
    table = tuned.Table(key, {"sm100_fwd": entries})

    def plan(d, causal=False, dtype="bf16"):
        request = FwdRequest(dtype, d, d, causal)
        return fwd_config_for_target(SM100_FWD, "sm_100a", request, None, table)

    config, reason = plan(128, dtype="fp16")
    assert reason == "" and (config.tile_n, config.dtype, config.head_dim_v) == (128, "fp16", 128)
    # the sm100 forward declines any other tile, and its reason names the tile it was given
    assert plan(128, causal=True) == (
        None,
        "tile 256x64w16: the sm100 forward needs tile_m in (128, 256), tile_n 128, 16 warps",
    )
    assert plan(64)[1].startswith("tile 256x32w16:")


def test_pre_and_post_configs_follow_the_main_config():
    from cute_fa.ampere.flash_bwd_prepost import BwdPostConfig, BwdPreConfig

    main = BwdConfig(80, "sm_86", "fp16", 96, 96, Tiles(64, 128, 8), varlen_q=True)
    assert planning.pre_config(main, True) == BwdPreConfig(80, "sm_86", "fp16", 96, 96, True)
    assert planning.post_config(main) == BwdPostConfig(
        arch=80, target="sm_86", dtype="fp16", head_dim=96, tile_m=64, num_warps=8, varlen_q=True
    )


def test_backward_arch_and_causal_tuned_entries(monkeypatch):
    from cute_fa import tuned

    monkeypatch.delenv(settings.BWD_ARCH, raising=False)
    with pytest.raises(settings.SettingError) as info:
        planning.bwd_config("sm_80", "bf16", 128, 128, arch=120)
    assert str(info.value) == "backward arch 120: expected 80, 90 or 100"
    with pytest.raises(NotImplementedError, match="the sm100 backward needs one of"):
        planning.bwd_config("sm_80", "bf16", 128, 128, arch=100)
    key = tuned.TableKey("GPU", 1, 0, "0", "0")
    table = tuned.Table(key, {"sm80_bwd": {"d128-causal": {"tile_m": 32}}})
    causal = planning.bwd_config("sm_80", "bf16", 128, 128, causal=True, table=table)
    plain = planning.bwd_config("sm_80", "bf16", 128, 128, table=table)
    assert (causal.tile_m, plain.tile_m) == (32, 64)
    assert causal.causal and not plain.causal  # the flag reaches the compile key
    assert planning.bwd_config("sm_90a", "bf16", 128, 128, causal=True).causal
    table = tuned.Table(
        key, {"sm90_bwd": {"d128-causal": {"q_stages": 2}, "d128": {"q_stages": 1}}}
    )
    causal = planning.bwd_config("sm_90a", "bf16", 128, 128, causal=True, table=table)
    plain = planning.bwd_config("sm_90a", "bf16", 128, 128, table=table)
    assert (causal.arch, causal.tuning.q_stages, plain.tuning.q_stages) == (90, 2, 1)


BWD_FLAGS = ("local", "has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k")


@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("flag", [*BWD_FLAGS, "deterministic"])
def test_each_backward_flag_reaches_the_compile_key(target, flag):
    config = planning.bwd_config(target, "bf16", 128, 128, **{flag: True})
    assert config.arch == int(target[3:5])
    assert [f for f in (*BWD_FLAGS, "causal", "deterministic") if getattr(config, f)] == [flag]


def test_sm100_forward_numerics_are_typed_tuning_fields():
    """exp2_poly, rescale_threshold and kv_stages of Sm100FwdTuning: FA4's values by default
    (8, 8, the ring of the head dims), taken from overrides and tuned tables, in the compile
    key's name when not the default, checked when made; kv_stages sizes the shared memory."""
    from cute_fa.blackwell import support as sm100

    import cute_fa
    from cute_fa import tuned
    from cute_fa.config import Sm100FwdTuning, TuningError
    from cute_fa.planning import SM100_FWD, FwdRequest, fwd_config_for_target

    def plan(d=128, table=None):
        request = FwdRequest("bf16", d, d, False)
        return fwd_config_for_target(SM100_FWD, "sm_100a", request, None, table)

    config, _ = plan()
    assert (config.tuning.exp2_poly, config.tuning.rescale_threshold) == (8, 8)
    assert config.tuning.kv_stages == 0 and sm100.fwd_kv_stages(config) == 4
    assert config.name.endswith("_256x128w16"), config.name
    with cute_fa.tuning(sm100_fwd={"exp2_poly": 0, "rescale_threshold": 0, "kv_stages": 3}):
        asked, reason = plan()
    assert reason == "" and asked.name.endswith("_256x128w16_poly0_thr0_kv3"), asked.name
    assert sm100.fwd_kv_stages(asked) == 3
    assert sm100.fwd_smem_bytes(config) - sm100.fwd_smem_bytes(asked) == 128 * 128 * 2
    key = tuned.TableKey("GPU", 1, 0, "0", "0")
    table = tuned.Table(key, {"sm100_fwd": {"d64": {"exp2_poly": 16}}})
    assert plan(64, table)[0].tuning.exp2_poly == 16
    # (192, 128) holds two stages: four do not fit 227 KiB, and the reason says so.
    with cute_fa.tuning(sm100_fwd={"kv_stages": 4}):
        request = FwdRequest("bf16", 192, 128, False)
        config, reason = fwd_config_for_target(SM100_FWD, "sm_100a", request)
    assert config is None and "shared memory" in reason
    for field, bad in (("exp2_poly", 3), ("exp2_poly", True), ("rescale_threshold", 6),
                       ("kv_stages", 1), ("kv_stages", 7), ("cta_pair", 1)):  # fmt: skip
        with pytest.raises(TuningError, match=field):
            Sm100FwdTuning(**{field: bad})
