"""Small contracts of the torch layer's helpers that the larger tests only pass through:
settings read from the environment, request descriptions, the sm80 dQ accumulator's size, the
package version, and the tuned table's file format, notes and state."""

from __future__ import annotations

import json
import os
from importlib import metadata

import pytest
from cute_fa.ampere import support as sm80_support

from cute_fa import cache, planning, settings, tuned
from cute_fa.config import Sm90FwdTuning
from cute_fa.planning import FwdRequest

KEY = tuned.TableKey(gpu="NVIDIA H200", sm_count=132, driver=13000, dsl="4.8.1", cute_fa="0.1.0")


@pytest.fixture
def table_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_FA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUTE_FA_TUNED", raising=False)
    tuned.forget_loaded()
    yield tmp_path
    tuned.forget_loaded()


# --------------------------------------------------------------------------------------------
# settings


def test_skip_value_checks_setting(monkeypatch):
    monkeypatch.delenv(settings.SKIP_CHECKS, raising=False)
    assert settings.skip_value_checks() is False
    monkeypatch.setenv(settings.SKIP_CHECKS, "1")
    assert settings.skip_value_checks() is True


@pytest.mark.parametrize("value, chain", [(None, False), ("auto", False), ("chain", True)])
def test_deterministic_chain_order_setting(monkeypatch, value, chain):
    if value is None:
        monkeypatch.delenv(settings.BWD_DET_ORDER, raising=False)
    else:
        monkeypatch.setenv(settings.BWD_DET_ORDER, value)
    assert settings.deterministic_chain_order() is chain


# --------------------------------------------------------------------------------------------
# planning, sm80 support, the package version


def test_request_description_and_capability_name():
    assert FwdRequest("bf16", 64, 64, causal=True).describe() == "bf16, head_dim=64, causal"
    assert (
        FwdRequest("fp16", 192, 128, local=True, varlen_q=True).describe()
        == "fp16, head_dim=192, head_dim_v=128, local, varlen_q"
    )
    assert planning.capability_name((8, 6)) == "compute capability 8.6"


def test_sm80_dq_accumulator_rows():
    # varlen: the packed rows plus one tile of room per sequence; batched: rows rounded up
    assert sm80_support.dq_accum_rows(100, 3, 64, True) == 292
    assert sm80_support.dq_accum_rows(100, 3, 64, False) == 128
    assert sm80_support.dq_accum_rows(128, 3, 64, False) == 128


def test_package_version(monkeypatch):
    assert cache.package_version() == metadata.version("cute-fa")
    monkeypatch.setattr(cache, "_distribution_version", lambda name: None)
    assert cache.package_version() == "0.0.0"


# --------------------------------------------------------------------------------------------
# the tuned table


def test_assignment_values_and_message():
    assert tuned.parse_assignment("sm90_fwd.pingpong=TRUE") == ("sm90_fwd", "pingpong", True)
    with pytest.raises(ValueError) as info:
        tuned.parse_assignment("tile_n=80")
    assert str(info.value) == "'tile_n=80': expected family.field=value, e.g. sm90_fwd.tile_n=80"


def test_table_entries_and_file_format(table_dir):
    table = tuned.Table(KEY, {"sm90_fwd": {"d64": {"tile_n": 80}}, "sm80_fwd": {}})
    assert table.entry("sm100_fwd", "d64") == {}  # no family: no fields
    text = table.to_json()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True)
    assert text.index('"sm80_fwd"') < text.index('"sm90_fwd"')  # sorted keys
    path = tuned.write_table(table)
    assert tuned.read_table(path).path == path
    path.write_text("[1]")
    with pytest.raises(ValueError) as info:
        tuned.read_table(path)
    assert str(info.value) == f"not a format-{tuned.FORMAT} tuned table"


def test_sources_without_a_table():
    assert set(tuned.sources("sm90_fwd", "d128", Sm90FwdTuning(), None).values()) <= {
        (v, "built-in") for v in Sm90FwdTuning().__dict__.values()
    }


def test_a_loaded_table_is_kept(table_dir):
    tuned.write_table(tuned.Table(KEY, {"sm90_fwd": {"d128": {"tile_n": 112}}}))
    tuned.forget_loaded()
    first = tuned.load_table(KEY)
    assert first is not None and tuned.load_table(KEY) is first


def test_a_table_for_another_setup_names_every_difference(table_dir):
    other = KEY._replace(dsl="4.7.0", cute_fa="0.0.9")
    tuned.write_table(tuned.Table(other, {}))
    tuned.forget_loaded()
    with pytest.warns(UserWarning) as record:
        assert tuned.load_table(KEY) is None
    assert len(record) == 1
    assert "(dsl '4.7.0' != '4.8.1'; cute_fa '0.0.9' != '0.1.0')" in str(record[0].message)
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add frames
        assert record[0].filename == __file__  # the warning points at the caller of load_table


def test_a_note_points_at_the_caller_of_the_function_that_notes(table_dir, monkeypatch):
    # _note's frame, then load_table's, then load_table's caller: stacklevel 3 (checked on the
    # call, so that it holds under mutmut's trampolines too; the test above checks the file)
    calls = []
    monkeypatch.setattr(tuned.warnings, "warn", lambda *a, **kw: calls.append((a, kw)))
    tuned.write_table(tuned.Table(KEY._replace(sm_count=1), {}))
    path = tuned.table_path(KEY._replace(sm_count=1))
    path.rename(tuned.table_path(KEY))
    tuned.forget_loaded()
    assert tuned.load_table(KEY) is None
    assert len(calls) == 1
    (message, category), kw = calls[0]
    assert category is UserWarning and kw == {"stacklevel": 3}


def test_a_note_is_given_once_per_message():
    tuned.forget_loaded()
    with pytest.warns(DeprecationWarning) as record:
        tuned._note("cute_fa: a test note", DeprecationWarning)
        tuned._note("cute_fa: a test note", DeprecationWarning)
    assert [str(r.message) for r in record] == ["cute_fa: a test note"]
    tuned.forget_loaded()


def test_every_write_and_reset_gives_a_new_state(table_dir):
    states = [tuned.state()]
    tuned.write_table(tuned.Table(KEY, {}))
    states.append(tuned.state())
    tuned.reset_table(KEY)
    states.append(tuned.state())
    tuned.reset_table(KEY)
    states.append(tuned.state())
    assert len(set(states)) == 4


def test_every_write_and_forget_gives_a_new_state(table_dir):
    states = [tuned.state()]
    for step in ("forget", "write", "forget", "forget", "write", "write", "reset", "forget"):
        if step == "forget":
            tuned.forget_loaded()
        elif step == "write":
            tuned.write_table(tuned.Table(KEY, {}))
        else:
            tuned.reset_table(KEY)
        states.append(tuned.state())
    assert len(set(states)) == len(states)


def test_unknown_families_and_fields_are_named():
    with pytest.raises(TypeError) as info:
        tuned.parse_assignment("sm70_fwd.tile_n=64")
    assert str(info.value) == (
        "unknown tuning family 'sm70_fwd'; known: sm80_fwd, sm80_bwd, sm90_fwd, sm90_bwd, sm100_fwd"
    )
    with pytest.raises(TypeError) as info, tuned.tuning(sm90_fwd={"tile_k": 1, "stages": 2}):
        pass
    assert str(info.value).startswith("sm90_fwd has no field stages, tile_k; fields: [")
    with pytest.raises(TypeError) as info, tuned.tuning(sm90_bwd=3):
        pass
    assert str(info.value) == "sm90_bwd: expected a dict of fields or a Sm90BwdTuning, got 3"


@pytest.mark.parametrize(
    "gpu, slug",
    [
        ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
        ("  NVIDIA H200 (NVL) ", "nvidia-h200-nvl"),
        ("XH200", "xh200"),
        ("???", "gpu"),
    ],
)
def test_table_path_names_the_gpu(table_dir, gpu, slug):
    path = tuned.table_path(KEY._replace(gpu=gpu, sm_count=7))
    assert path == table_dir / "tuned" / f"{slug}-7sm.json"


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "entries is not an object"),
        ({"sm90_fwd": []}, "entries.sm90_fwd is not an object"),
        ({"sm90_fwd": {"d64": 3}}, "entries.sm90_fwd.d64 is not an object"),
    ],
)
def test_malformed_table_entries_are_named(table_dir, entries, message):
    with pytest.raises(TypeError) as info:
        tuned.write_table(tuned.Table(KEY, entries))
    assert str(info.value) == message


def test_a_written_table_is_loaded_with_its_key_and_path(monkeypatch, tmp_path):
    # the cache folder does not exist yet: writing creates it, parents and all
    monkeypatch.setenv("CUTE_FA_CACHE_DIR", str(tmp_path / "not" / "yet"))
    monkeypatch.delenv("CUTE_FA_TUNED", raising=False)
    tuned.forget_loaded()
    try:
        path = tuned.write_table(tuned.Table(KEY, {"sm90_fwd": {"d64": {"tile_n": 96}}}))
        assert path == tmp_path / "not" / "yet" / "tuned" / "nvidia-h200-132sm.json"
        table = tuned.load_table(KEY)  # the written table, not read again
        assert (table.key, table.path) == (KEY, path)
        assert table.entry("sm90_fwd", "d64") == {"tile_n": 96}
    finally:
        tuned.forget_loaded()


def test_problem_class_names_head_dims_and_causality():
    # the keys of a tuned table's entries (docs/tuning.md): d128, d192x128-causal
    assert tuned.problem_class(128, 128, False) == "d128"
    assert tuned.problem_class(192, 128, True) == "d192x128-causal"
    assert tuned.problem_class(64, 64, True) == "d64-causal"
