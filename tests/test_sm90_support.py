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


def _bwd(d: int, **flags):
    from cute_fa import planning

    return planning.bwd_config("sm_90a", "bf16", d, d, arch=90, **flags)


def test_backward_takes_two_q_stages_up_to_d192():
    assert [support.bwd_q_stages(_bwd(d)) for d in (64, 96, 128, 192, 256)] == [2, 2, 2, 2, 1]
    assert support.bwd_q_stages(_bwd(128).with_tuning(q_stages=3)) == 3


def test_backward_d64_steps_128_query_rows_but_64_with_softcap():
    assert (_bwd(64).tile_m, _bwd(64, has_softcap=True).tile_m) == (128, 64)
    base = _bwd(64, has_softcap=True)
    assert support.bwd_config(base).tile_m == 64
    assert support.bwd_config(base.replace(has_softcap=False)).tile_m == 128


def test_backward_shared_memory_and_the_split_d_tile():
    # d 128, 64 x 128 tiles: K and V (128 x 256), two Q / dO stages (64 x 256), two dS buffers
    # (64 x 128), all 16-bit; LSE and delta (2 stages x 2 x 64 fp32); the fp32 dQ tile
    # (64 x 128); 1 KiB of slack
    expected = (128 * 256 + 2 * 64 * 256 + 2 * 64 * 128) * 2 + 2 * 2 * 64 * 4 + 64 * 128 * 4
    assert support.bwd_smem_bytes(_bwd(128)) == expected + 1024
    # d 192 splits d (64 keys a CTA): one more 64 x 64 tile, P^T
    expected = (64 * 384 + 2 * 64 * 384 + 3 * 64 * 64) * 2 + 2 * 2 * 64 * 4 + 64 * 192 * 4
    assert support.bwd_smem_bytes(_bwd(192)) == expected + 1024


def test_backward_default_tuning_is_the_one_without_softcap():
    assert support.bwd_default_tuning(64) == support.bwd_default_tuning(64, False)
    assert support.bwd_default_tuning(64).tile_m == 128


def test_backward_reasons():
    from cute_fa.config import Tiles

    config = _bwd(128)
    coresident = config.replace(deterministic=True, det_coresident=True)
    assert support.bwd_can_implement(coresident) == (
        False,
        "det_coresident is a mode of the sm80 backward",
    )
    assert support.bwd_can_implement(config.replace(tuning=Tiles(64, 128, 8))) == (
        False,
        "tuning Tiles is not an Sm90BwdTuning",
    )
    assert support.bwd_can_implement(_bwd(192).with_tuning(tile_n=128)) == (
        False,
        "tile_n 128: the sm90 backward at head_dim 192 runs 64 keys a CTA (two consumers of "
        "32 keys)",
    )
    # an sm_90 target other than sm_90a has no known shared memory: nothing fits
    assert support.bwd_can_implement(config.replace(target="sm_90")) == (
        False,
        "tiles need 198656 B of shared memory, more than sm_90 has",
    )


def test_forward_tile_m_defaults_to_a_plain_call():
    # d 64 takes three consumers (192 rows) unless causal (short), local or softcapped
    assert support.fwd_tile_m(64, 128) == 192
    assert support.fwd_tile_m(64, 128, causal=True) == 128
    assert support.fwd_tile_m(64, 128, local=True) == 128
    assert support.fwd_tile_m(64, 128, has_softcap=True) == 128
    assert support.fwd_tile_ms(64) == (128, 192)


def test_forward_q_stages_of_a_persistent_grid():
    from cute_fa.config import FwdConfig, Sm90FwdTuning

    def config(target, d, tile_m, tile_n, num_ctas=132):
        tuning = Sm90FwdTuning(tile_m=tile_m, tile_n=tile_n, num_ctas=num_ctas)
        return FwdConfig(90, target, "bf16", d, d, tuning)

    assert support.fwd_q_stages(config("sm_90a", 128, 128, 128)) == 2
    assert support.fwd_q_stages(config("sm_90a", 128, 128, 128, num_ctas=0)) == 1
    assert support.fwd_q_stages(config("sm_90a", 256, 128, 80)) == 1
    # a target of unknown shared memory: one stage
    assert support.fwd_q_stages(config("sm_90", 128, 128, 128)) == 1


def test_forward_shared_memory_and_a_foreign_tuning():
    from cute_fa.config import FwdConfig, Sm90FwdTuning, Tiles

    config = FwdConfig(90, "sm_90a", "bf16", 128, 128, Sm90FwdTuning(tile_m=128, tile_n=128))
    # one Q stage of 128 x 128 and two K / V stages of 128 x (128 + 128), 16-bit; 1 KiB slack
    assert support.fwd_smem_bytes(config) == (128 * 128 + 2 * 128 * 256) * 2 + 1024
    assert support.fwd_smem_bytes(config, 3, 2) == (2 * 128 * 128 + 3 * 128 * 256) * 2 + 1024
    assert support.fwd_can_implement(config.replace(tuning=Tiles(128, 128, 8))) == (
        False,
        "tuning Tiles is not an Sm90FwdTuning",
    )
    assert support.fwd_can_implement(
        config.replace(head_dim=96, head_dim_v=96).with_tuning(tile_m=192)
    ) == (
        False,
        "tile_m 192 (three consumer warpgroups of 160 registers a thread) runs only head_dim "
        "(64, 128) without local or has_softcap (more spills)",
    )
    # an sm_90 target other than sm_90a has no known shared memory: nothing fits
    assert support.fwd_can_implement(config.replace(target="sm_90")) == (
        False,
        "tiles need 164864 B of shared memory, more than sm_90 has",
    )


def test_forward_reasons_of_the_tuning_flags():
    from cute_fa.config import FwdConfig, Sm90FwdTuning

    config = FwdConfig(90, "sm_90a", "bf16", 128, 128, Sm90FwdTuning(tile_m=128, tile_n=128))
    no_turns = config.replace(seqused_k=True).with_tuning(pingpong=False)
    assert support.fwd_can_implement(no_turns) == (
        False,
        "pingpong off with seqused_k: the consumers' turns order the zeroing of the V rows past "
        "seqused_k before any P V GEMM reads them",
    )
    tma_store = config.replace(varlen_q=True).with_tuning(tma_store=True)
    assert support.fwd_can_implement(tma_store) == (
        False,
        "tma_store takes dense query rows (no cu_seqlens_q / seqused_q), dv == d and no split-KV "
        "or pack_gqa",
    )
    persistent = config.replace(local=True).with_tuning(num_ctas=132)
    assert support.fwd_can_implement(persistent) == (
        False,
        "a persistent grid (num_ctas) takes dense calls without a window, seqused, "
        "split-KV, pack_gqa or paged K/V (their tiles cost different amounts; Note "
        "[persistent tiles])",
    )


def test_forward_defaults_of_causal_calls_on_a_persistent_grid():
    from cute_fa.config import FwdConfig, Sm90FwdTuning

    def tuning(d=64, causal=True, seqlen_q=None, asked=None):
        base = FwdConfig(90, "sm_90a", "bf16", d, d, Sm90FwdTuning(), causal=causal)
        t = support.fwd_config(base, seqlen_q, asked).tuning
        return t.num_ctas, t.pingpong, t.overlap

    # d 64, causal, two consumers on the persistent grid: no turns; up to 1024 rows no overlap
    assert tuning(seqlen_q=1024) == (132, False, False)
    assert tuning(seqlen_q=1025) == (132, False, True)
    # ... only where they are not asked, only causal, only on the persistent grid
    assert tuning(seqlen_q=1024, asked={"pingpong": True}) == (132, True, True)
    assert tuning(seqlen_q=1024, asked={"overlap": True}) == (132, False, True)
    assert tuning(causal=False, seqlen_q=1024, asked={"tile_m": 128}) == (132, True, True)
    assert tuning(seqlen_q=None) == (0, True, True)
    # d 128 has no short-call default: the overlap stays on without turns even for one row
    assert tuning(d=128, seqlen_q=1, asked={"pingpong": False}) == (132, False, True)
