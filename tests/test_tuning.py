"""Typed tuning: the per-GPU tuned table (round trip, precedence, stale and corrupt files) and
overrides (``cute_fa.tuning``), on the CPU."""

from __future__ import annotations

import json

import pytest

import cute_fa
from cute_fa import planning, tuned
from cute_fa.config import Sm90FwdTuning, Tiles
from cute_fa.planning import FwdRequest

KEY = tuned.TableKey(gpu="NVIDIA H200", sm_count=132, driver=13000, dsl="4.8.1", cute_fa="0.1.0")


@pytest.fixture(autouse=True)
def table_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_FA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUTE_FA_TUNED", raising=False)
    tuned.forget_loaded()
    yield tmp_path
    tuned.forget_loaded()


def req(d=128, causal=False):
    return FwdRequest("bf16", d, d, causal=causal)


def test_round_trip_and_path(table_dir):
    entries = {
        "sm90_fwd": {"d128": {"tile_n": 112, "pingpong": False}},
        "sm80_fwd": {"d64-causal": {"tile_m": 64, "tile_n": 64, "num_warps": 4}},
    }
    path = tuned.write_table(tuned.Table(KEY, entries))
    assert path == table_dir / "tuned" / "nvidia-h200-132sm.json"
    assert tuned.read_table(path).entries == entries
    tuned.forget_loaded()
    table = tuned.load_table(KEY)
    assert table.key == KEY and table.entry("sm90_fwd", "d128") == {
        "tile_n": 112,
        "pingpong": False,
    }
    assert table.entry("sm90_fwd", "d64") == {}
    assert tuned.reset_table(KEY) and not path.exists() and not tuned.reset_table(KEY)
    assert tuned.load_table(KEY) is None


def test_precedence_builtin_then_table_then_override():
    table = tuned.Table(KEY, {"sm90_fwd": {"d128": {"tile_n": 112, "pingpong": False}},
                              "sm80_fwd": {"d128": {"tile_m": 64}}})  # fmt: skip
    _, default = planning.fwd_plan((9, 0), req())
    assert default.tile_n == 128 and default.tuning.pingpong
    _, tabled = planning.fwd_plan((9, 0), req(), None, table)
    assert (tabled.tile_n, tabled.tuning.pingpong) == (112, False)
    _, other = planning.fwd_plan((9, 0), req(causal=True), None, table)  # another class
    assert other.tile_n == 128
    with cute_fa.tuning(sm90_fwd={"tile_n": 96}):
        _, overridden = planning.fwd_plan((9, 0), req(), None, table)
    assert (overridden.tile_n, overridden.tuning.pingpong) == (96, False)
    _, sm80 = planning.fwd_plan((8, 0), req(), None, table)
    assert sm80.tuning == Tiles(64, 64, 4)  # the table's tile_m over the built-in 128x64w4
    sources = tuned.sources("sm90_fwd", "d128", default.tuning, table)
    assert sources["tile_n"] == (112, "tuned table") and sources["tile_m"] == (128, "built-in")
    with cute_fa.tuning(sm90_fwd=Sm90FwdTuning(tile_n=80)):
        sources = tuned.sources("sm90_fwd", "d128", default.tuning, table)
        assert sources["tile_n"] == (80, "override") and sources["pingpong"] == (True, "override")


def test_a_table_for_another_setup_is_ignored_with_a_note():
    tuned.write_table(
        tuned.Table(KEY._replace(dsl="4.7.0"), {"sm90_fwd": {"d128": {"tile_n": 112}}})
    )
    tuned.forget_loaded()
    with pytest.warns(UserWarning, match=r"another setup \(dsl '4.7.0' != '4.8.1'\)"):
        assert tuned.load_table(KEY) is None


@pytest.mark.parametrize(
    "text",
    ["{not json", json.dumps({"format": 99}), json.dumps({"format": 1, "key": {"gpu": "x"}}),
     json.dumps({"format": 1, "key": KEY._asdict(), "entries": {"sm90_fwd": {"d128": {"no": 1}}}})],
)  # fmt: skip
def test_a_corrupt_table_is_ignored_with_a_warning(table_dir, text):
    path = tuned.table_path(KEY)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.warns(UserWarning, match="ignoring the tuned table .*unreadable"):
        assert tuned.load_table(KEY) is None


def test_the_setting_turns_the_table_off(monkeypatch):
    tuned.write_table(tuned.Table(KEY, {"sm90_fwd": {"d128": {"tile_n": 112}}}))
    tuned.forget_loaded()
    monkeypatch.setenv("CUTE_FA_TUNED", "0")
    assert tuned.load_table(KEY) is None


def test_writes_change_the_state_that_keys_launch_plans():
    before = tuned.state()
    tuned.write_table(tuned.Table(KEY, {}))
    assert tuned.state() != before
    with cute_fa.tuning(sm90_fwd={"tile_n": 80}):
        inside = tuned.state()
        with cute_fa.tuning(sm90_fwd={"pingpong": False}):  # nested blocks add fields
            assert tuned.override_fields("sm90_fwd") == {"tile_n": 80, "pingpong": False}
    assert inside != tuned.state() and tuned.override_fields("sm90_fwd") == {}


def test_assignment_parsing():
    assert tuned.parse_assignment("sm90_fwd.tile_n=80") == ("sm90_fwd", "tile_n", 80)
    assert tuned.parse_assignment("sm90_fwd.pingpong=false") == ("sm90_fwd", "pingpong", False)
    for bad in ("sm90_fwd.tile_n", "sm90_fwd.nope=1", "nope.tile_n=1", "sm90_fwd.tile_n=x"):
        with pytest.raises((ValueError, TypeError)):
            tuned.parse_assignment(bad)


def test_tune_write_merges_winners(monkeypatch):
    from cute_fa.tools import tune

    monkeypatch.setattr(tune, "_this_gpu_key", lambda: KEY)
    tuned.write_table(tuned.Table(KEY, {"sm90_fwd": {"d64": {"pingpong": False},
                                                      "d128": {"tile_n": 112}}}))  # fmt: skip
    tune.write_winners("sm90_fwd", {"d256": {"rescale_threshold": 0}}, {"d128", "d256"})
    table = tuned.load_table(KEY)
    # d128 was timed and its default won: its old entry goes; d64 was not timed: it stays.
    assert table.entries["sm90_fwd"] == {"d64": {"pingpong": False},
                                         "d256": {"rescale_threshold": 0}}  # fmt: skip
