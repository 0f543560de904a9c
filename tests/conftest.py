"""Shared test set-up: GPU tests skip without CUDA; the compile cache goes to a temporary dir."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_report_header(config):
    """Which build of the CuTe DSL compiles the kernels (its CUDA toolkit: its ptxas)."""
    from cutlass.base_dsl.version_info import CUDA_VERSION

    lines = [f"CuTe DSL build: CUDA {CUDA_VERSION.major} (cu{CUDA_VERSION.major})"]
    if "fuzz" in str(config.getoption("markexpr", "")):
        from fuzz_seed import fuzz_settings

        seed, cases, families = fuzz_settings()
        lines.append(f"fuzz: seed {seed}, {cases} cases over {families} families "
                     f"(replay: CUTE_FA_FUZZ_SEED={seed})")  # fmt: skip
    return lines


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _isolated_compile_cache(tmp_path_factory):
    """Keep test compiles out of the user's ~/.cache (unless CUTE_FA_CACHE_DIR is set)."""
    if os.environ.get("CUTE_FA_CACHE_DIR"):
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("CUTE_FA_CACHE_DIR", str(tmp_path_factory.mktemp("cute-fa-cache")))
    yield
    mp.undo()
