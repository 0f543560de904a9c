"""Lazy exports of the arch packages: their kernel classes import the CuTe DSL, so a package
loads each on first use (``from cute_fa.hopper import FlashAttentionForwardSm90`` works as
usual) and its ``support`` module answers what they can do without that import."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module relative
    to the package) on the first access of ``name`` and keeps the value in the package."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
