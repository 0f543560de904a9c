"""Stand-in precompile workers for tests/test_precompile.py, in a module of their own so that
spawned worker processes import only this (no torch, no DSL)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class StubConfig:
    name: str


def dies_on_b(config: StubConfig) -> tuple[str, float]:
    if config.name == "b":
        os._exit(3)  # as a worker killed for memory, or a crash in the compiler
    return "compiled", 0.0
