"""Dispatch by compute capability, compile keys from calls, the feature matrix, the CLI."""

from __future__ import annotations

import pytest
import torch
from cute_fa.ampere import FlashAttentionForwardSm80

from cute_fa import checks, planning, settings
from cute_fa.config import (
    SM80_FWD_TILES,
    SM80_FWD_TILES_SMALL_SMEM,
    SMEM_CAPACITY,
    TARGETS,
    FwdConfig,
    sm80_bwd_tile,
    sm80_fwd_tile,
    tile_head_dim,
)
from cute_fa.planning import FwdRequest, supported_capabilities
from cute_fa.tools import cli, precompile


def req(**kw) -> FwdRequest:
    return FwdRequest(**{"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, **kw})


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_every_arch_from_sm80_uses_the_sm80_kernel_for_its_own_target(capability, d, monkeypatch):
    monkeypatch.setenv(settings.FWD_ARCH, "80")  # on sm90 the sm90 family comes first
    cls, config = planning.fwd_plan(capability, req(head_dim=d, head_dim_v=d, causal=True))
    assert cls.load() is FlashAttentionForwardSm80
    assert config.arch == 80 and config.target == TARGETS[capability]
    assert config.tuning == sm80_fwd_tile(d, config.target, True)
    assert config.causal and not config.local
    _, plain = planning.fwd_plan(capability, req(head_dim=d, head_dim_v=d))
    small = capability in ((8, 6), (8, 9), (12, 0))
    table = SM80_FWD_TILES_SMALL_SMEM if small else SM80_FWD_TILES
    assert (plain.tile_m, plain.tile_n, plain.num_warps) == table[d]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_takes_what_it_implements_and_sm80_the_rest(d, causal, monkeypatch):
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    request = req(head_dim=d, head_dim_v=d, causal=causal)
    cls, config = planning.fwd_plan((9, 0), request)
    sm90_config, why = planning.fwd_config_for_target(planning.SM90_FWD, "sm_90a", request)
    if sm90_config is not None:
        assert cls is planning.SM90_FWD and config == sm90_config and config.arch == 90
    else:
        assert why and cls is planning.SM80_FWD and config.arch == 80
    assert planning.fwd_plan((8, 0), request)[0] is planning.SM80_FWD


def test_fwd_arch_env_restricts_the_family(monkeypatch):
    monkeypatch.setenv(settings.FWD_ARCH, "90")
    assert planning.fwd_plan((9, 0), req())[0] is planning.SM90_FWD
    with pytest.raises(NotImplementedError, match="CUTE_FA_FWD_ARCH=90 leaves no family"):
        planning.fwd_plan((8, 0), req())
    with pytest.raises(NotImplementedError, match="FlashAttentionForwardSm90"):
        planning.fwd_plan((9, 0), req(head_dim=80, head_dim_v=80))
    monkeypatch.setenv(settings.FWD_ARCH, "80")
    assert planning.fwd_plan((9, 0), req())[0] is planning.SM80_FWD
    monkeypatch.setenv(settings.FWD_ARCH, "70")
    with pytest.raises(ValueError, match="CUTE_FA_FWD_ARCH"):
        planning.fwd_plan((9, 0), req())


@pytest.mark.parametrize("capability", [(10, 0), (10, 3)])
def test_sm100_takes_what_it_implements_and_sm80_the_rest(capability, monkeypatch):
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    target = TARGETS[capability]
    for d in (64, 128):
        for flags in ({}, {"causal": True}, {"varlen_q": True, "varlen_k": True},
                      {"local": True}, {"has_softcap": True},
                      {"varlen_q": True, "varlen_k": True, "seqused_k": True}):  # fmt: skip
            cls, config = planning.fwd_plan(capability, req(head_dim=d, head_dim_v=d, **flags))
            assert cls is planning.SM100_FWD and config.arch == 100
            assert config.target == target and config.tile_m == 256 and config.num_warps == 16
    # d 256 and (192, 192): the sm100 forward with one Q tile a CTA (tile_m 128).
    for d in (192, 256):
        for flags in ({}, {"causal": True, "varlen_q": True, "varlen_k": True},
                      {"local": True, "has_softcap": True}):  # fmt: skip
            cls, config = planning.fwd_plan(capability, req(head_dim=d, head_dim_v=d, **flags))
            assert cls is planning.SM100_FWD and config.arch == 100 and config.tile_m == 128
            assert config.target == target and not config.tuning.cta_pair
    # What the sm100 forward does not take goes to the sm80 kernel: (128, 64).
    cls, config = planning.fwd_plan(capability, req(head_dim=128, head_dim_v=64))
    assert cls is planning.SM80_FWD and config.target == target
    # exclude: the self-check's fallback for one request.
    cls, config = planning.fwd_plan(capability, req(), exclude=(100,))
    assert cls is planning.SM80_FWD and config.target == target
    with pytest.raises(NotImplementedError, match="excluding sm80, sm100 leaves no family"):
        planning.fwd_plan(capability, req(), exclude=(80, 100))
    # The sm120 (consumer Blackwell) has no tcgen05: the sm80 kernel.
    assert planning.fwd_plan((12, 0), req())[0] is planning.SM80_FWD


def test_fwd_arch_env_100_forces_the_sm100_family(monkeypatch):
    monkeypatch.setenv(settings.FWD_ARCH, "100")
    assert planning.fwd_plan((10, 0), req())[0] is planning.SM100_FWD
    assert planning.fwd_plan((10, 0), req(head_dim=256, head_dim_v=256))[1].tile_m == 128
    with pytest.raises(NotImplementedError, match="FlashAttentionForwardSm100"):
        planning.fwd_plan((10, 0), req(head_dim=256, head_dim_v=128))
    with pytest.raises(NotImplementedError, match="CUTE_FA_FWD_ARCH=100 leaves no family"):
        planning.fwd_plan((9, 0), req())
    # the setting, not the excluded family, is what leaves none
    _, _, reasons = planning.try_plan((9, 0), req(), exclude=(90,))
    assert reasons == "CUTE_FA_FWD_ARCH=100 leaves no family"


def test_try_plan_gives_every_familys_reason_or_none(monkeypatch):
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    cls, config, reasons = planning.try_plan((9, 0), req())
    assert (cls, config.arch, reasons) == (planning.SM90_FWD, 90, "")
    assert planning.try_plan((9, 0), req(head_dim=64, head_dim_v=128)) == (
        None,
        None,
        "FlashAttentionForwardSm90: head_dim_v 128 with head_dim 64 is not supported by the sm90 "
        "forward (pairs ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128), "
        "(128, 64))); "
        "FlashAttentionForwardSm80: head_dim_v 128 with head_dim 64 is not supported on sm80 "
        "(head_dim_v == head_dim, or the pairs ((128, 64), (192, 128)))",
    )


@pytest.mark.parametrize("arch, capability", [(90, (9, 0)), (100, (10, 0))])
def test_a_family_off_by_default_serves_only_when_forced(arch, capability, monkeypatch):
    monkeypatch.setattr(planning, f"SM{arch}_FWD_BY_DEFAULT", False)
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    assert planning.fwd_kernel_classes(capability) == [planning.SM80_FWD]
    monkeypatch.setenv(settings.FWD_ARCH, str(arch))
    assert [s.arch for s in planning.fwd_kernel_classes(capability)] == [arch]


def test_sm100_tuning_reaches_the_compile_key():
    import cute_fa

    with cute_fa.tuning(sm100_fwd={"tile_n": 64}):
        cls, config = planning.fwd_plan((10, 0), req())
    assert cls is planning.SM80_FWD  # the sm100 forward declines another tile, with its reason
    with cute_fa.tuning(sm100_fwd={"tile_n": 128}):
        assert planning.fwd_plan((10, 0), req())[1].arch == 100


def test_config_carries_the_call_flags():
    request = req(local=True, has_softcap=True, varlen_q=True, varlen_k=True, seqused_k=True)
    _, config = planning.fwd_plan((9, 0), request)
    assert (config.local, config.has_softcap, config.varlen_q, config.varlen_k) == (True,) * 4
    assert config.seqused_k and not config.seqused_q and not config.causal


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1)])
def test_old_gpus_are_rejected(capability):
    with pytest.raises(NotImplementedError, match="compute capability 8.0"):
        planning.fwd_plan(capability, req())


def test_unknown_capability_is_rejected():
    with pytest.raises(NotImplementedError, match="compute capability 11.5"):
        planning.fwd_plan((11, 5), req())


def test_unsupported_feature_names_feature_and_arch():
    with pytest.raises(
        NotImplementedError, match=r"head_dim=64, head_dim_v=128.*on sm_90a \(compute capability"
    ):
        planning.fwd_plan((9, 0), req(head_dim=64, head_dim_v=128))
    with pytest.raises(
        NotImplementedError, match=r"head_dim_v=96.*sm_80.*head_dim_v 96 with head_dim 128"
    ):
        planning.fwd_plan((8, 0), req(head_dim=128, head_dim_v=96))


def test_implementable_somewhere():
    planning.check_fwd_implementable_somewhere(req())
    planning.check_fwd_implementable_somewhere(req(head_dim=72, head_dim_v=72))
    with pytest.raises(NotImplementedError, match="on any GPU"):
        planning.check_fwd_implementable_somewhere(req(head_dim=72, head_dim_v=64))


@pytest.mark.parametrize("d", [8, 32, 40, 72, 80, 112, 160, 224, 248])
@pytest.mark.parametrize("causal", [False, True])
def test_rounded_head_dims_run_the_sm80_kernels_everywhere(d, causal, monkeypatch):
    """Note [rounded head dims]: the sm90 and sm100 kernels take none of these head dims, so
    every GPU runs the sm80 forward and backward (tiles of the next tile head dim)."""
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    monkeypatch.delenv(settings.BWD_ARCH, raising=False)
    request = req(head_dim=d, head_dim_v=d, causal=causal)
    for capability in supported_capabilities():
        target = TARGETS[capability]
        cls, config = planning.fwd_plan(capability, request)
        assert cls is planning.SM80_FWD and config.head_dim == d and config.target == target
        assert config.tuning == sm80_fwd_tile(tile_head_dim(d), target, causal)
        assert f"_d{d}_" in config.name
        if SMEM_CAPACITY[target] < 160 * 1024 and tile_head_dim(d) > 128:
            with pytest.raises(NotImplementedError, match="shared memory"):
                planning.bwd_config(target, "bf16", d, d, causal=causal)
            continue
        bwd = planning.bwd_config(target, "bf16", d, d, causal=causal)
        assert bwd.arch == 80 and bwd.head_dim == d and bwd.tuning == sm80_bwd_tile(d, target)
        assert planning.pre_config(bwd, False).head_dim == tile_head_dim(d)
        post = planning.post_config(bwd)
        assert (post.head_dim, post.acc_cols) == (d, tile_head_dim(d))
        assert post.acc_head_dim == (0 if d == tile_head_dim(d) else tile_head_dim(d))


def test_head_dim_pairs_of_the_sm80_kernels(monkeypatch):
    """(128, 64) and (192, 128) run the sm90 kernels on Hopper, forward and backward, and the sm80
    ones elsewhere (sm100: its own forward of (192, 128))."""
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    monkeypatch.delenv(settings.BWD_ARCH, raising=False)
    for capability in supported_capabilities():
        target = TARGETS[capability]
        hopper = capability[0] == 9
        cls, config = planning.fwd_plan(capability, req(head_dim=128, head_dim_v=64))
        assert cls is (planning.SM90_FWD if hopper else planning.SM80_FWD), capability
        assert "_bf16_d128x64_" in config.name
        assert planning.bwd_config(target, "bf16", 128, 64).arch == (90 if hopper else 80)
        cls, _ = planning.fwd_plan(capability, req(head_dim=192, head_dim_v=128))
        want = {9: planning.SM90_FWD, 10: planning.SM100_FWD}.get(capability[0], planning.SM80_FWD)
        assert cls is want, capability
        bwd = planning.bwd_config(target, "bf16", 192, 128)
        assert bwd.arch == (90 if capability[0] == 9 else 80)
        assert planning.post_config(bwd).acc_head_dim == 0


def test_new_shapes_give_the_same_compile_key():
    """Sequence lengths, batch and head counts never reach the config."""

    def config_for(b, sq, sk, h, hk):
        q = torch.empty(b, sq, h, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(b, sk, hk, 128, dtype=torch.bfloat16, device="meta")
        shapes = checks.check_metadata(q, k, k, None, None, None, None, causal=True)
        request = req(head_dim=shapes.head_dim, head_dim_v=shapes.head_dim_v, causal=True)
        return planning.fwd_plan((9, 0), request)[1]

    configs = {
        config_for(*s) for s in [(1, 1, 1, 1, 1), (2, 1000, 17, 8, 2), (7, 4096, 4096, 32, 4)]
    }
    assert len(configs) == 1


# --------------------------------------------------------------------------------------------
# Feature matrix and CLI


def test_feature_matrix_is_generated_from_can_implement(monkeypatch):
    from cute_fa.settings import BWD_ARCH as BWD_ARCH_ENV
    from cute_fa.tools import features

    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    monkeypatch.delenv(BWD_ARCH_ENV, raising=False)
    columns, table, notes = features.feature_matrix()
    assert columns == [TARGETS[c] for c in sorted(TARGETS) if c >= (8, 0)]
    rows = dict(table)
    fwd_family = {"sm_90a": "sm90", "sm_100a": "sm100", "sm_103a": "sm100"}
    expect = [fwd_family.get(c, "sm80") for c in columns]
    assert rows["bf16, head_dim 128"] == expect
    assert rows["causal"] == expect
    # d 256 and (192, 192): the sm100 forward with one Q tile a CTA; what it declines goes to
    # the sm80 kernel on the same GPU ((128, 64), split-KV, paged K/V).
    for target in ("sm_100a", "sm_103a"):
        assert rows["bf16, head_dim 256"][columns.index(target)] == "sm100"
        assert rows["bf16, head_dim 192"][columns.index(target)] == "sm100"
        assert rows["head_dim 128, head_dim_v 64"][columns.index(target)] == "sm80"
        assert rows["sliding window (local)"][columns.index(target)] == "sm100"
        assert rows["bf16, head_dim 64"][columns.index(target)] == "sm100"
    # Rounded head dims: the sm80 kernels everywhere (Note [rounded head dims]); the (128, 64)
    # pair: the sm90 kernels on Hopper, the sm80 ones elsewhere; the backward of a tile head dim
    # above 128 fits no 99 KiB GPU.
    for row in ("bf16, head_dim 80", "bf16, head_dim 160", "backward, head_dim 80"):
        assert rows[row] == ["sm80"] * len(columns), row
    hopper = ["sm90" if c.startswith("sm_90") else "sm80" for c in columns]
    for row in ("head_dim 128, head_dim_v 64", "backward, head_dim 128, head_dim_v 64"):
        assert rows[row] == hopper, row
    small = [SMEM_CAPACITY[c] < 160 * 1024 for c in columns]
    assert [c.startswith("-(") for c in rows["backward, head_dim 160"]] == small
    for target in ("sm_80", "sm_90a", "sm_100a", "sm_103a"):
        family = {"sm_90a": "sm90", "sm_100a": "sm100", "sm_103a": "sm100"}.get(target, "sm80")
        assert rows["backward, head_dim 128"][columns.index(target)] == family  # Note [backward
        assert rows["backward, causal"][columns.index(target)] == family  # dispatch]
    # The sm100 backward takes windows, softcap, seqused and deterministic=True (compile-only,
    # self-checked); what it declines goes to the sm80 kernel on the same GPU.
    for target in ("sm_100a", "sm_103a"):
        for row in ("backward, sliding window", "backward, softcap",
                    "backward, seqused_q / seqused_k", "backward, deterministic=True"):  # fmt: skip
            assert rows[row][columns.index(target)] == "sm100", row
        for row in ("backward, head_dim 256", "backward, softcap, head_dim 256"):
            assert rows[row][columns.index(target)] == "sm80", row
    assert rows["backward, seqused_q / seqused_k"][columns.index("sm_90a")] == "sm90"
    # The sm90 backward does deterministic dQ too (semaphores in its dQ writer warp).
    assert rows["backward, deterministic=True"][columns.index("sm_90a")] == "sm90"
    # 99 KiB of shared memory (sm86/sm89/sm120): d128 takes a 64-key tile, d256 fits none.
    assert rows["backward, head_dim 128"][columns.index("sm_86")] == "sm80"
    assert rows["backward, head_dim 256"][columns.index("sm_86")].startswith("-(")
    served = [cell.startswith("sm") for cell in rows["backward, deterministic=True"]]
    assert served == [cell.startswith("sm") for cell in rows["backward, head_dim 128"]]
    assert any("head_dim_v 128 with head_dim 64 is not supported on sm80" in n for n in notes)


def test_features_command(capsys):
    assert cli.main(["features"]) == 0
    text = capsys.readouterr().out
    assert "sm_90a" in text and "head_dim 256" in text and "score_mod" in text
    assert cli.main(["features", "--markdown"]) == 0
    assert "| feature |" in capsys.readouterr().out


def test_precompile_plan():
    plans = precompile.precompile_configs(
        "sm80", "sm_90a", [64, 80], ["bf16"], ["plain", "causal+varlen"]
    )
    by_label = {label: (task, reason) for task, label, reason in plans}
    task, _ = by_label["fwd bf16 d64 causal+varlen"]
    config = task.config
    assert task.kind == "fwd" and isinstance(config, FwdConfig) and config.target == "sm_90a"
    assert config.causal and config.varlen_q and config.varlen_k
    task, _ = by_label["fwd bf16 d80 plain"]  # a rounded head dim (Note [rounded head dims])
    assert task.config.head_dim == 80 and task.config.arch == 80
    plans = precompile.precompile_configs("sm80", "sm_90a", [84], ["bf16"], ["plain"])
    [(task, label, reason)] = plans
    assert task is None and label == "fwd bf16 d84 plain" and "head_dim 84" in reason


def test_precompile_command_fills_the_cache(monkeypatch, tmp_path, capsys):
    from cute_fa import cache, compile

    compiled = []

    def fake_compile(config):
        compiled.append(config)
        return config.name.encode()

    fake = cache.CompileCache(
        fake_compile, lambda c, sym: c, lambda b, sym: b, directory=tmp_path, disk=True
    )
    monkeypatch.setattr(compile, "_fwd_cache", fake)
    argv = ["precompile", "--target", "sm_80", "--head-dims", "64,84", "--dtypes", "bf16"]
    argv += ["--mode", "fwd"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert len(compiled) == 2 and "skip  fwd bf16 d84 plain" in out
    assert len(list(tmp_path.glob("*.bin"))) == 2
    assert cli.main(argv) == 0  # everything is on disk now
    assert len(compiled) == 2 and "hit" in capsys.readouterr().out


def test_bench_is_dispatched_lazily(monkeypatch):
    import cute_fa.tools.bench

    seen = {}

    def fake_main(argv, prog=None):
        seen["argv"] = argv
        return 0

    monkeypatch.setattr(cute_fa.tools.bench, "main", fake_main)
    assert cli.main(["bench", "--d", "64"]) == 0
    assert seen["argv"] == ["--d", "64"]


def test_bwd_tile_override():
    import cute_fa
    from cute_fa.config import SM80_BWD_TILES, SM80_BWD_TILES_LARGE_SMEM, Tiles
    from cute_fa.planning import bwd_config

    # The override is the sm80 kernel's tile; on sm_90a d64 runs the sm90 kernel.
    with cute_fa.tuning(sm80_bwd=Tiles(64, 64, 8)):
        assert bwd_config("sm_90a", "bf16", 64, 64).arch == 90
        config = bwd_config("sm_80", "bf16", 64, 64)
        assert config.tuning == Tiles(64, 64, 8)
    with cute_fa.tuning(sm80_bwd={"tile_n": 112}):
        with pytest.raises(NotImplementedError, match="64x112 does not fit 8 warps"):
            bwd_config("sm_80", "bf16", 128, 128)
    with pytest.raises(ValueError, match="tile_n must be a multiple of 16"):
        Tiles(64, 100, 8)
    config = bwd_config("sm_80", "bf16", 64, 64)
    assert (config.tile_m, config.tile_n, config.num_warps) == SM80_BWD_TILES_LARGE_SMEM[64]
    config = bwd_config("sm_86", "bf16", 64, 64)
    assert (config.tile_m, config.tile_n, config.num_warps) == SM80_BWD_TILES[64]


def test_sm90_tile_override():
    from cute_fa.hopper.support import SM90_FWD_TILE_N

    import cute_fa

    with cute_fa.tuning(sm90_fwd={"tile_n": 192}):
        # 192 keys do not fit three consumers: the default picks two.
        _, config = planning.fwd_plan((9, 0), req(head_dim=64, head_dim_v=64))
        assert config.arch == 90 and (config.tile_m, config.tile_n) == (128, 192)
        _, config = planning.fwd_plan((9, 0), req(head_dim=256, head_dim_v=256))
        assert config.arch == 80  # 192 keys of d256 do not fit: the sm80 kernel serves it
    with pytest.raises(ValueError, match="tile_n must be a multiple of 16"):
        with cute_fa.tuning(sm90_fwd={"tile_n": 100}):
            planning.fwd_plan((9, 0), req(head_dim=64, head_dim_v=64))
    _, config = planning.fwd_plan((9, 0), req(head_dim=64, head_dim_v=64))
    assert config.tile_n == SM90_FWD_TILE_N[64]


def test_sm90_tile_m_choice():
    import cute_fa

    _, config = planning.fwd_plan((9, 0), req(head_dim=64, head_dim_v=64))
    assert (config.tile_m, config.num_warps) == (192, 16)  # the d64 default: three consumers
    _, config = planning.fwd_plan((9, 0), req(head_dim=64, head_dim_v=64, causal=True))
    assert (config.tile_m, config.num_warps) == (128, 12)  # causal: two
    # Causal with long query sequences: three (the plan passes the call's query length).
    causal64 = req(head_dim=64, head_dim_v=64, causal=True)
    from cute_fa.hopper.support import SM90_FWD_3WG_CAUSAL_MIN_SEQLEN as long_rows

    assert planning.fwd_plan((9, 0), causal64, long_rows - 1)[1].tile_m == 128
    assert planning.fwd_plan((9, 0), causal64, long_rows)[1].tile_m == 192
    assert planning.fwd_plan((9, 0), req(head_dim=128, head_dim_v=128), 8192)[1].tile_m == 128
    plans = precompile.precompile_configs("sm90", "sm_90a", [64], ["bf16"], ["causal"])
    # Plain, long sequences (192 rows), short ones (128 rows on a persistent grid: up to 1024
    # rows without the intra-warpgroup overlap, then with it) and 4096-8192 rows (192 rows on a
    # persistent grid).
    tiles = sorted(
        (t.config.tile_m, t.config.tuning.num_ctas, t.config.tuning.overlap) for t, _, _ in plans
    )
    assert tiles == [(128, 0, True), (128, 132, False), (128, 132, True), (192, 0, True),
                     (192, 132, True)]  # fmt: skip
    with cute_fa.tuning(sm90_fwd={"tile_m": 192}):
        for causal in (False, True):
            _, config = planning.fwd_plan((9, 0), req(head_dim=64, head_dim_v=64, causal=causal))
            assert (config.arch, config.tile_m, config.tile_n, config.num_warps) == (
                90, 192, 128, 16)  # fmt: skip
        # Three consumers only where they fit 160 registers: d64 without a window or softcap;
        # elsewhere the sm90 kernel declines the override and the sm80 kernel serves the call.
        for request in (req(head_dim=64, head_dim_v=64, local=True),
                        req(head_dim=64, head_dim_v=64, has_softcap=True),
                        req(head_dim=128, head_dim_v=128)):  # fmt: skip
            assert planning.fwd_plan((9, 0), request)[1].arch == 80
    # d128 holds three consumers at 80 keys or fewer (a tuning choice with tile_n).
    with cute_fa.tuning(sm90_fwd={"tile_m": 192, "tile_n": 80}):
        _, config = planning.fwd_plan((9, 0), req(head_dim=128, head_dim_v=128), 8192)
        assert (config.arch, config.tile_m, config.tile_n, config.num_warps) == (90, 192, 80, 16)
    with cute_fa.tuning(sm90_fwd={"tile_m": 128}):
        assert planning.fwd_plan((9, 0), req(head_dim=64, head_dim_v=64))[1].tile_m == 128
    for bad in (256, 64):
        with pytest.raises(ValueError, match="tile_m must be 128 or 192"):
            with cute_fa.tuning(sm90_fwd={"tile_m": bad}):
                planning.fwd_plan((9, 0), req(head_dim=64, head_dim_v=64))


def test_bwd_arch_override(monkeypatch):
    from cute_fa.planning import bwd_config, post_config, pre_config
    from cute_fa.settings import BWD_ARCH as BWD_ARCH_ENV

    monkeypatch.setenv(BWD_ARCH_ENV, "90")
    config = bwd_config("sm_90a", "bf16", 128, 128, causal=True)
    assert config.arch == 90 and (config.tile_m, config.tile_n, config.num_warps) == (64, 128, 12)
    assert pre_config(config, False).arch == 80 and post_config(config).arch == 80
    with pytest.raises(NotImplementedError, match="FlashAttentionBackwardSm90: head_dim 80"):
        bwd_config("sm_90a", "bf16", 80, 80)
    with pytest.raises(NotImplementedError, match="FlashAttentionBackwardSm90: target sm_80"):
        bwd_config("sm_80", "bf16", 128, 128)
    monkeypatch.setenv(BWD_ARCH_ENV, "70")
    with pytest.raises(ValueError, match=BWD_ARCH_ENV):
        bwd_config("sm_90a", "bf16", 128, 128)
    monkeypatch.setenv(BWD_ARCH_ENV, "80")
    assert bwd_config("sm_90a", "bf16", 128, 128).arch == 80


def test_sm90_persistent_grid_choice(monkeypatch):
    """A persistent grid by default where Q gets two stages (d <= 128) up to
    SM90_FWD_PERSISTENT_MAX_SEQLEN query rows (causal: ..._CAUSAL; pairs of tiles); the
    ``num_ctas`` tuning field forces it either way where it fits; never for windows, varlen or
    seqused."""
    from cute_fa.hopper.support import (
        SM90_FWD_PERSISTENT_MAX_SEQLEN,
        SM90_FWD_PERSISTENT_MAX_SEQLEN_CAUSAL,
        SM90_SMS,
    )

    import cute_fa

    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    short, long = SM90_FWD_PERSISTENT_MAX_SEQLEN, SM90_FWD_PERSISTENT_MAX_SEQLEN + 1
    d256 = dict(head_dim=256, head_dim_v=256)

    def num_ctas(seqlen_q, **kw):
        return planning.fwd_plan((9, 0), req(**kw), seqlen_q)[1].tuning.num_ctas

    assert num_ctas(short) == SM90_SMS
    assert num_ctas(short, head_dim=64, head_dim_v=64, has_softcap=True) == SM90_SMS
    assert num_ctas(long) == 0 and num_ctas(None) == 0
    assert num_ctas(SM90_FWD_PERSISTENT_MAX_SEQLEN_CAUSAL, causal=True) == SM90_SMS
    assert num_ctas(SM90_FWD_PERSISTENT_MAX_SEQLEN_CAUSAL + 1, causal=True) == 0
    assert num_ctas(short, **d256) == 0  # one Q stage: not by default, except causal 1k-8k
    assert [num_ctas(n, causal=True, **d256) for n in (512, 1024, 8192, 8193)] == [
        0, SM90_SMS, SM90_SMS, 0]  # fmt: skip
    # d64 causal from 4096 rows runs three consumers, on the persistent grid up to the causal
    # limit like two.
    d64 = dict(head_dim=64, head_dim_v=64, causal=True)
    assert [num_ctas(n, **d64) for n in (2048, 4096, 8192, 8193)] == [
        SM90_SMS, SM90_SMS, SM90_SMS, 0]  # fmt: skip
    assert planning.fwd_plan((9, 0), req(**d64), 4096)[1].tile_m == 192
    for kw in (dict(local=True), dict(varlen_q=True), dict(seqused_k=True)):
        assert num_ctas(short, **kw) == 0, kw
    with cute_fa.tuning(sm90_fwd={"num_ctas": 1}):
        assert num_ctas(long) == SM90_SMS and num_ctas(short, **d256) == SM90_SMS
        assert num_ctas(short, local=True) == 0
        # Forced, three consumers take the persistent causal grid too (hopper/support.py).
        assert num_ctas(1 << 20, head_dim=64, head_dim_v=64, causal=True) == SM90_SMS
    with cute_fa.tuning(sm90_fwd={"num_ctas": 0}):
        assert num_ctas(short) == 0
    # The persistent config is its own compile key and an sm90 kernel implements it.
    cls, config = planning.fwd_plan((9, 0), req(), short)
    assert "persistent" in config.name and cls.can_implement(config)[0]


# --------------------------------------------------------------------------------------------
# The GPU suite's tuning cases, planned here: each asks for a kernel that planning gives it.


def _sm90_tuning_cases():
    """(id, fields, request fields, seqlen_q) of every sm90 forward tuning case of
    tests/test_fwd_gpu.py (imported here: without CUDA its tests only skip)."""
    import test_fwd_gpu as gpu

    dtypes = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    cases = []

    def add(name, fields, d, seqlen_q, mask, softcap=0.0, dtype=torch.bfloat16, dv=None):
        causal, window = gpu.SWITCH_MASKS[mask]
        problem = dict(dtype=dtypes[dtype], head_dim=d, head_dim_v=dv or d, causal=causal,
                       local=window != (None, None), has_softcap=softcap > 0)  # fmt: skip
        cases.append(pytest.param(fields, problem, seqlen_q, id=f"{name}-{len(cases)}"))

    for seqlen_q in (4096, 4500, 5000):
        add("default-3wg-persistent", {}, 64, seqlen_q, "causal")
    for seqlen_q in (1000, 800, 777):
        add("3wg-persistent", {"tile_m": 192, "num_ctas": 1}, 64, seqlen_q, "causal")
    for d, dv, seqlen_q, _ in gpu.PERSISTENT_CASES:
        for mask in ("full", "causal"):
            for softcap in (0.0, 15.0):
                add("persistent", {"num_ctas": 1}, d, seqlen_q, mask, softcap, dv=dv)
    for d, seqlen_q, _, mask, softcap, dtype, every, _ in gpu.EXP2_POLY_CASES:
        add("poly", {"exp2_poly": every}, d, seqlen_q, mask, softcap, dtype)
    for d, seqlen_q, _, mask, fields in gpu.DEFER_CASES + gpu.SCHEDULE_SWITCH_CASES:
        add("fields", fields, d, seqlen_q, mask)
    for d, seqlen_q, _, mask, softcap, dtype, threshold, _, fields in gpu.RESCALE_THRESHOLD_CASES:
        add("threshold", {"rescale_threshold": threshold, **fields}, d, seqlen_q, mask, softcap,
            dtype)  # fmt: skip
    return cases


@pytest.mark.parametrize("fields,problem,seqlen_q", _sm90_tuning_cases())
def test_gpu_suite_sm90_tuning_cases_plan_their_fields(monkeypatch, fields, problem, seqlen_q):
    """Each sm90 forward tuning case of tests/test_fwd_gpu.py, planned as its call is on an
    sm90 device (the overrides, the query length, one CTA an SM when persistent): the sm90
    kernel implements it and its key holds every field the case asks for (what the GPU test
    asserts of the kernel that ran); the GPU suite's own persistent-grid cases have several
    work units a CTA."""
    import test_fwd_gpu as gpu

    import cute_fa

    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    monkeypatch.setattr(gpu, "sm_count", lambda: 132)
    with cute_fa.tuning(sm90_fwd=fields):
        cls, config = planning.fwd_plan((9, 0), FwdRequest(**problem), seqlen_q)
    if config.tuning.num_ctas:
        config = config.with_tuning(num_ctas=132)  # as cute_fa.ops makes the plan
    assert cls.arch == 90 and cls.can_implement(config) == (True, "")
    gpu.assert_fields(config, fields)
    if fields == {"num_ctas": 1}:  # test_fwd_persistent_grid: batch 6 x 16 heads
        m_blocks = -(-seqlen_q // config.tile_m)
        units = 6 * 16 * (-(-m_blocks // 2) if problem["causal"] else m_blocks)
        assert units > 1.4 * 132


def test_gpu_suite_sm90_tuning_cases_are_not_defaults():
    """Each sm90 tuning case of the GPU suite runs a kernel that its call does not get by
    default, except where a case checks a field on a shape whose default has it already: the
    built-in default itself, the persistent grid at d <= 128 (up to 2k rows), the rescale
    threshold 8 of d256."""
    import cute_fa

    for case in _sm90_tuning_cases():
        fields, problem, seqlen_q = case.values
        with cute_fa.tuning(sm90_fwd=fields):
            _, config = planning.fwd_plan((9, 0), FwdRequest(**problem), seqlen_q)
        _, default = planning.fwd_plan((9, 0), FwdRequest(**problem), seqlen_q)
        d = problem["head_dim"]
        expected_default = (
            not fields
            or (fields == {"num_ctas": 1} and d <= 128)
            or (fields == {"rescale_threshold": 8} and d == 256)
        )
        assert (config == default) == expected_default, (case.id, config.name)


def test_gpu_suite_tuned_table_entry_plans_its_tile():
    """tests/test_tuned_gpu.py's table (d128: 112 keys a block) gives its call (bf16, 1000 query
    rows, no mask) the sm90 kernel with 112 keys on the persistent grid, the built-in key
    otherwise unchanged; the causal class keeps 128."""
    import test_tuned_gpu as gpu

    from cute_fa import tuned

    key = tuned.TableKey("NVIDIA H200", 132, 13000, "4.8.1", "0.1.0")
    table = tuned.Table(key, gpu.ENTRIES)
    request = FwdRequest("bf16", gpu.D, gpu.D)
    cls, config = planning.fwd_plan((9, 0), request, 1000, table)
    _, default = planning.fwd_plan((9, 0), request, 1000)
    assert cls.arch == 90 and cls.can_implement(config) == (True, "")
    assert default.tile_n == gpu.DEFAULT_TILE_N and default.tuning.num_ctas
    assert config == default.with_tuning(tile_n=gpu.TABLE_TILE_N)
    causal = FwdRequest("bf16", gpu.D, gpu.D, causal=True)
    assert planning.fwd_plan((9, 0), causal, 1000, table)[1].tile_n == gpu.DEFAULT_TILE_N


def test_gpu_suite_backward_tuning_cases(monkeypatch):
    """The backward GPU tests' tuning: the sm80 kernel's 99 KiB tiles (CUTE_FA_BWD_ARCH=80 with
    an sm80_bwd override) on sm_90a, with each mask and softcap; three Q stages of the sm90
    kernel at d128; the sm80 chain order under CUTE_FA_BWD_DET_ORDER=chain (the coresident
    order otherwise, 700 keys on 132 SMs)."""
    import cute_fa
    from cute_fa.config import SM80_BWD_TILES_SMALL_SMEM, Tiles, sm80_bwd_tile
    from cute_fa.planning import bwd_config, coresident_fits

    monkeypatch.setenv(settings.BWD_ARCH, "80")
    for d, tile in SM80_BWD_TILES_SMALL_SMEM.items():
        assert sm80_bwd_tile(d, "sm_90a") != Tiles(*tile)  # the override changes the kernel
        for flags in (dict(), dict(causal=True), dict(local=True)):
            with cute_fa.tuning(sm80_bwd=Tiles(*tile)):
                config = bwd_config("sm_90a", "bf16", d, d, has_softcap=d == 128, **flags)
            assert config.arch == 80 and config.tuning == Tiles(*tile)
    config = bwd_config("sm_90a", "bf16", 128, 128, causal=True, deterministic=True)
    assert config.arch == 80 and coresident_fits(config, 700, 132)
    monkeypatch.setenv(settings.BWD_DET_ORDER, "chain")
    assert not coresident_fits(config, 700, 132)
    monkeypatch.delenv(settings.BWD_ARCH)
    for causal in (False, True):
        for deterministic in (False, True):
            with cute_fa.tuning(sm90_bwd={"q_stages": 3}):
                config = bwd_config("sm_90a", "bf16", 128, 128, causal=causal,
                                    deterministic=deterministic)  # fmt: skip
            assert config.arch == 90 and config.tuning.q_stages == 3


def test_sm100_backward_takes_what_it_implements_and_sm80_the_rest(monkeypatch):
    monkeypatch.delenv(settings.BWD_ARCH, raising=False)
    for target in ("sm_100a", "sm_103a"):
        for d in (64, 96, 128):
            for flags in ({}, {"causal": True}, {"varlen_q": True, "varlen_k": True},
                          {"local": True}, {"has_softcap": True},
                          {"causal": True, "has_softcap": True, "seqused_q": True},
                          {"local": True, "varlen_q": True, "varlen_k": True,
                           "seqused_k": True}, {"deterministic": True},
                          {"deterministic": True, "causal": True}):  # fmt: skip
                config = planning.bwd_config(target, "bf16", d, d, **flags)
                assert config.arch == 100 and config.target == target, (d, flags)
        assert planning.bwd_config(target, "bf16", 256, 256).arch == 80
        assert planning.bwd_config(target, "bf16", 256, 256, has_softcap=True).arch == 80
    # (192, 128): the sm100 backward declines it, the sm80 one takes it.
    assert planning.bwd_config("sm_100a", "bf16", 192, 128).arch == 80
    with pytest.raises(NotImplementedError, match="FlashAttentionBackwardSm100: head_dim 64"):
        planning.bwd_config("sm_100a", "bf16", 64, 128)
    monkeypatch.setenv(settings.BWD_ARCH, "100")
    with pytest.raises(NotImplementedError, match="FlashAttentionBackwardSm100: head_dim 256"):
        planning.bwd_config("sm_100a", "bf16", 256, 256)
    monkeypatch.setenv(settings.BWD_ARCH, "80")
    assert planning.bwd_config("sm_100a", "bf16", 128, 128).arch == 80
