"""The environment variables of ``cute_fa.settings``: each one's default, the values that turn
a flag off, malformed values, and ``describe``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cute_fa import settings

ALL = (
    settings.CACHE, settings.CACHE_DIR, settings.LINKER, settings.SKIP_CHECKS, settings.FWD_ARCH,
    settings.BWD_ARCH, settings.BWD_DET_ORDER, settings.TUNED, settings.SELFTEST,
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in (*ALL, settings.DSL_LIBS, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("flag", [settings.disk_cache_enabled, settings.tuned_table_enabled])
def test_flags_on_by_default_and_off_by_their_words(monkeypatch, flag):
    name = settings.CACHE if flag is settings.disk_cache_enabled else settings.TUNED
    assert flag() is True
    for value in ("", "  ", "1", "yes", "on", "true", "anything"):
        monkeypatch.setenv(name, value)
        assert flag() is True, value
    for value in ("0", "false", "FALSE", " No ", "off", "Off"):
        monkeypatch.setenv(name, value)
        assert flag() is False, value


def test_skip_value_checks_off_by_default(monkeypatch):
    assert settings.skip_value_checks() is False
    monkeypatch.setenv(settings.SKIP_CHECKS, "yes")
    assert settings.skip_value_checks() is True
    monkeypatch.setenv(settings.SKIP_CHECKS, "off")
    assert settings.skip_value_checks() is False


def test_cache_base_dir(monkeypatch, tmp_path):
    assert settings.cache_base_dir() == Path.home() / ".cache" / "cute-fa"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_base_dir() == tmp_path / "xdg" / "cute-fa"
    monkeypatch.setenv(settings.CACHE_DIR, f" {tmp_path / 'mine'} ")
    assert settings.cache_base_dir() == tmp_path / "mine"
    monkeypatch.setenv(settings.CACHE_DIR, "~/cute")
    assert settings.cache_base_dir() == Path.home() / "cute"


def test_linker(monkeypatch):
    assert settings.linker() == "ld"
    for value, linker in (("ld.lld", "ld.lld"), (" gold ", "gold"), ("", "ld")):
        monkeypatch.setenv(settings.LINKER, value)
        assert settings.linker() == linker
    for value in ("0", "false", "no", "off", "None", "OFF"):
        monkeypatch.setenv(settings.LINKER, value)
        assert settings.linker() is None, value


@pytest.mark.parametrize(
    "name, read, families",
    [(settings.FWD_ARCH, settings.forced_fwd_arch, (80, 90, 100)),
     (settings.BWD_ARCH, settings.forced_bwd_arch, (80, 90, 100))],
)  # fmt: skip
def test_forced_arch(monkeypatch, name, read, families):
    """The forward's families include sm100 (its compile-only kernel); the backward's do not."""
    assert read() is None
    monkeypatch.setenv(name, " 90 ")
    assert read() == 90
    for family in families:
        monkeypatch.setenv(name, str(family))
        assert read() == family
    monkeypatch.setenv(name, "70")
    with pytest.raises(settings.SettingError) as info:
        read()
    expected = ", ".join(str(f) for f in families)
    assert str(info.value) == f"{name}='70': expected one of {expected}"


def test_deterministic_order_rejects_other_values(monkeypatch):
    monkeypatch.setenv(settings.BWD_DET_ORDER, "coresident")
    with pytest.raises(settings.SettingError) as info:
        settings.deterministic_chain_order()
    assert str(info.value) == "CUTE_FA_BWD_DET_ORDER='coresident': expected one of auto, chain"


def test_dsl_library_dirs(monkeypatch):
    assert settings.dsl_library_dirs() == []
    monkeypatch.setenv(settings.DSL_LIBS, os.pathsep.join(["/a", "", "/b/c", ""]))
    assert settings.dsl_library_dirs() == ["/a", "/b/c"]


def test_describe_lists_every_setting(monkeypatch):
    assert settings.describe() == [(name, "(unset)") for name in ALL]
    monkeypatch.setenv(settings.LINKER, " 0 ")
    monkeypatch.setenv(settings.TUNED, "0")
    described = dict(settings.describe())
    assert described[settings.LINKER] == " 0 "  # as set
    assert described[settings.TUNED] == "0"
    assert described[settings.CACHE] == "(unset)"
