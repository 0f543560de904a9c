"""Process-wide settings: the one module of the library that reads the environment.

Nothing here changes generated code. Kernel tuning (tiles, schedules, numerics switches) is
never read from the environment: it is typed (``cute_fa.config``'s tuning dataclasses) and set
by built-in defaults, a per-GPU table written by ``python -m cute_fa tune --write``, or an
explicit override (``cute_fa.tuning``).

Each function reads its variable when called, so a test or a tool may set a variable for the
rest of a process; a forward launch plan keeps what it found when it was made (once per input
signature), the backward asks on every call.

| variable | effect |
|---|---|
| ``CUTE_FA_CACHE`` | ``0`` turns the on-disk compile cache off; default on |
| ``CUTE_FA_CACHE_DIR`` | base folder of the disk cache and of the tuned tables |
| ``CUTE_FA_LINKER`` | linker for disk-cache entries (default ``ld``); ``0``: object files only |
| ``CUTE_FA_SKIP_CHECKS`` | ``1`` skips the value checks of cu_seqlens / seqused (a host sync) |
| ``CUTE_FA_FWD_ARCH`` | ``80``, ``90`` or ``100``: the forward uses only that family (testing) |
| ``CUTE_FA_BWD_ARCH`` | ``80``, ``90`` or ``100``: the backward's main kernel family (testing) |
| ``CUTE_FA_BWD_DET_ORDER`` | ``chain``: deterministic sm80 backward calls keep key-block order |
| ``CUTE_FA_TUNED`` | ``0`` ignores the per-GPU tuned table (built-in defaults only) |
| ``CUTE_FA_SELFTEST`` | ``0`` turns the first-use self-check off; ``force`` checks every variant |
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE = "CUTE_FA_CACHE"
CACHE_DIR = "CUTE_FA_CACHE_DIR"
LINKER = "CUTE_FA_LINKER"
SKIP_CHECKS = "CUTE_FA_SKIP_CHECKS"
FWD_ARCH = "CUTE_FA_FWD_ARCH"
BWD_ARCH = "CUTE_FA_BWD_ARCH"
BWD_DET_ORDER = "CUTE_FA_BWD_DET_ORDER"
TUNED = "CUTE_FA_TUNED"
SELFTEST = "CUTE_FA_SELFTEST"
# The CuTe DSL's own variable naming the folders of its runtime libraries (read by the DSL
# too); the disk cache looks there for the runtime library when it loads without the DSL.
DSL_LIBS = "CUTE_DSL_LIBS"

_OFF = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A malformed setting (raised as is: never a reason to fall back)."""


def _get(name: str) -> str:
    return os.environ.get(name, "").strip()


def _flag(name: str, default: bool) -> bool:
    value = _get(name).lower()
    return default if not value else value not in _OFF


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """The variable's value ("" when unset); SettingError when it is not one of ``choices``."""
    value = _get(name)
    if value and value not in choices:
        raise SettingError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def disk_cache_enabled() -> bool:
    return _flag(CACHE, True)


def cache_base_dir() -> Path:
    """Base folder of the disk cache: ``CUTE_FA_CACHE_DIR``, else ``$XDG_CACHE_HOME/cute-fa``,
    else ``~/.cache/cute-fa``."""
    base = _get(CACHE_DIR)
    if base:
        return Path(base).expanduser()
    xdg = _get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cute-fa"


def linker() -> str | None:
    """The linker's name ("ld" by default), or None when ``CUTE_FA_LINKER=0``."""
    value = _get(LINKER)
    if value.lower() in (*_OFF, "none"):
        return None
    return value or "ld"


def skip_value_checks() -> bool:
    return _flag(SKIP_CHECKS, False)


def forced_fwd_arch() -> int | None:
    """The forward kernel family ``CUTE_FA_FWD_ARCH`` forces, or None."""
    value = _choice(FWD_ARCH, ("80", "90", "100"))
    return int(value) if value else None


def forced_bwd_arch() -> int | None:
    """The backward main-kernel family ``CUTE_FA_BWD_ARCH`` forces, or None."""
    value = _choice(BWD_ARCH, ("80", "90", "100"))
    return int(value) if value else None


def deterministic_chain_order() -> bool:
    """``CUTE_FA_BWD_DET_ORDER=chain``: deterministic sm80 backward calls never take the
    coresident order (a GPU shared in ways its SM count does not show)."""
    return _choice(BWD_DET_ORDER, ("auto", "chain")) == "chain"


def tuned_table_enabled() -> bool:
    return _flag(TUNED, True)


def selftest_mode() -> str:
    """``CUTE_FA_SELFTEST`` (``cute_fa.selftest``): "on" (default: the kernels of GPU families
    never run here are checked at first use), "off" (``0``, ``off``, ...) or "force" (every
    variant is checked)."""
    value = _get(SELFTEST).lower()
    if not value or value in ("1", "on", "true", "yes"):
        return "on"
    if value in _OFF:
        return "off"
    if value == "force":
        return "force"
    raise SettingError(f"{SELFTEST}={value!r}: expected 0 (off), 1 (default) or force")


def dsl_library_dirs() -> list[str]:
    """Folders ``CUTE_DSL_LIBS`` lists (``os.pathsep`` separated), in order."""
    return [p for p in _get(DSL_LIBS).split(os.pathsep) if p]


def describe() -> list[tuple[str, str]]:
    """(variable, value or "(unset)") of every setting, for tools that print what is in force."""
    names = (
        CACHE, CACHE_DIR, LINKER, SKIP_CHECKS, FWD_ARCH, BWD_ARCH, BWD_DET_ORDER, TUNED, SELFTEST,
    )  # fmt: skip
    return [(n, os.environ.get(n, "(unset)")) for n in names]
