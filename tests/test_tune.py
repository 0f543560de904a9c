"""``python -m cute_fa tune`` on a CPU machine: its candidates and its command line."""

from __future__ import annotations

import pytest
from cute_fa.hopper.support import SM90_FWD_HEAD_DIMS

from cute_fa.config import SM80_BWD_TILES, SM80_BWD_TILES_SMALL_SMEM, SM80_FWD_TILES
from cute_fa.tools import bench
from cute_fa.tools.tune import (
    BWD_CANDIDATES,
    CANDIDATES,
    build_parser,
    bwd_candidate_tiles,
    candidate_configs,
    main,
    sm90_fwd_variants,
)


@pytest.mark.parametrize("d", sorted(SM80_FWD_TILES))
def test_the_tuned_tile_is_among_the_candidates(d):
    assert SM80_FWD_TILES[d] in CANDIDATES[d]


def test_candidates_are_implementable_and_filtered_by_shared_memory():
    big = candidate_configs(256, "sm_90a", causal=False)
    small = candidate_configs(256, "sm_86", causal=False)
    assert {(c.tile_m, c.tile_n, c.num_warps) for c in big} == set(CANDIDATES[256])
    assert len(small) < len(big)  # 128x64 at d256 needs 128 KiB, more than sm86's 99 KiB
    assert all(c.target == "sm_86" for c in small)


def test_command_line():
    args = build_parser().parse_args(["--d", "128", "--seqlen", "2k,8k", "--causal", "1"])
    assert args.d == [128] and args.seqlen == [2048, 8192] and args.causal == [1]


@pytest.mark.parametrize("d", sorted(SM80_BWD_TILES))
def test_the_backward_tile_is_among_the_candidates_and_implementable(d):
    assert SM80_BWD_TILES[d] in BWD_CANDIDATES[d]
    assert SM80_BWD_TILES[d] in bwd_candidate_tiles(d, "sm_90a", causal=False)
    if d in SM80_BWD_TILES_SMALL_SMEM:  # the 99 KiB targets' tile is a candidate there
        assert SM80_BWD_TILES_SMALL_SMEM[d] in bwd_candidate_tiles(d, "sm_86", causal=False)


def test_backward_candidates_are_filtered_by_shared_memory():
    assert len(bwd_candidate_tiles(64, "sm_86", causal=True)) < len(
        bwd_candidate_tiles(64, "sm_90a", causal=True)
    )


def test_backward_mode_on_the_command_line():
    assert build_parser().parse_args(["--mode", "bwd", "--d", "64"]).mode == "bwd"


@pytest.mark.parametrize("d", SM90_FWD_HEAD_DIMS)
def test_sm90_variants_are_valid_peers_that_change_something(d):
    from cute_fa.tools.tune import variant_fields

    peers = sm90_fwd_variants(d)
    assert peers[0] == "cute_fa" and peers[1] == "cute_fa:CUTE_FA_FWD_ARCH=90"  # the null one
    assert bench._name_list(",".join([*peers, "cudnn"])) == [*peers, "cudnn"]
    # Each field is set against the default of this head dim: the deferred rescale is on by
    # default at d64 only, the rescale threshold at d256 only.
    assert ("cute_fa:sm90_fwd.defer_rescale=false" in peers) == (d == 64)
    assert ("cute_fa:sm90_fwd.rescale_threshold=0" in peers) == (d == 256)
    for peer in ("pingpong=false", "overlap=false", "tma_store=true", "num_ctas=0", "num_ctas=1"):
        assert f"cute_fa:sm90_fwd.{peer}" in peers
    assert ("cute_fa:sm90_fwd.pingpong=true" in peers) == (d == 64)  # off for some d64
    # Three consumers: d64 at its default keys, d128 at the 64 or 80 keys they hold.
    three = [p for p in peers if "sm90_fwd.tile_m=192" in p]
    if d == 128:
        assert three == [f"cute_fa:sm90_fwd.tile_m=192:sm90_fwd.tile_n={n}" for n in (64, 80)]
    assert bool(three) == (d in (64, 128))
    # Every typed variant's fields build a valid tuning; the null variant has none.
    assert variant_fields(peers[1]) is None
    for peer in peers[2:]:
        assert variant_fields(peer)


def test_winner_needs_the_margin():
    from cute_fa.tools.tune import WRITE_MARGIN, pick_winner

    scores = {"cute_fa": (100.0, {}), "a": (100.0 * WRITE_MARGIN - 0.1, {"tile_n": 80})}
    assert pick_winner(scores, "cute_fa") is None
    scores["b"] = (100.0 * WRITE_MARGIN + 0.1, {"pingpong": False})
    assert pick_winner(scores, "cute_fa") == {"pingpong": False}
    assert pick_winner({"a": (1.0, {})}, "cute_fa") is None  # the default failed: keep it


def test_sm90_tuning_is_forward_only():
    with pytest.raises(SystemExit):
        main(["--arch", "90", "--mode", "bwd"])
    with pytest.raises(SystemExit):  # the sm80 sweeps time each tile once
        main(["--rounds", "2"])
    args = build_parser().parse_args(["--arch", "90", "--d", "256", "--out", "x"])
    assert args.arch == 90 and args.out == "x"


def test_sm90_tuning_runs_one_benchmark_per_head_dim(monkeypatch, tmp_path):
    import torch

    runs = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "main", lambda argv, results_out=None: runs.append(argv) or 0)
    assert main(["--arch", "90", "--d", "64,256", "--seqlen", "1k,4k", "--causal", "1",
                 "--rounds", "3", "--out", str(tmp_path)]) == 0  # fmt: skip
    assert len(runs) == 2
    for d, argv in zip((64, 256), runs, strict=True):
        args = bench.build_parser().parse_args(argv)
        assert args.d == [d] and args.seqlen == [1024, 4096] and args.causal == [1]
        assert args.rounds == 3
        assert args.peers == [*sm90_fwd_variants(d), "cudnn"]
        assert args.out == str(tmp_path / f"d{d}")
