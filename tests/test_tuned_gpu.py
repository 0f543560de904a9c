"""The per-GPU tuned table on a GPU (marker ``gpu``; needs an sm90 device): a table written for
this GPU's key changes the kernel dispatch runs, ``tune --show`` reports it, and removing it
brings the built-in default back (cute_fa/tuned.py; tests/test_tuning.py checks the layering on
the CPU).

The table goes to a temporary ``CUTE_FA_CACHE_DIR`` (the compile cache keeps the folder it
first used, so the kernels still land in the session's cache); tables read earlier are
forgotten before and after each test.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gpu_support import fwd_plan_configs, poison_free_memory, seed  # noqa: F401
from test_fwd_gpu import _qkv, _reserve_for, check_against_ref

import cute_fa
from cute_fa import settings, tuned

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs an sm90 GPU",
    ),
]

# d128 non-causal: the sm90 forward's built-in tile_n is 128 (hopper/support.py
# SM90_FWD_TILE_N); the table asks for 112 (Q and two K/V stages of 112 keys fit in shared
# memory, also with the persistent grid's two Q stages; tests/test_dispatch.py plans it).
D, TABLE_TILE_N, DEFAULT_TILE_N = 128, 112, 128
ENTRIES = {"sm90_fwd": {tuned.problem_class(D, D, False): {"tile_n": TABLE_TILE_N}}}


@pytest.fixture
def table_key(monkeypatch, tmp_path):
    """This GPU's table key, with tables read from and written to ``tmp_path``."""
    from cute_fa.device import table_key

    if settings.forced_fwd_arch() == 80:
        pytest.skip("CUTE_FA_FWD_ARCH=80 runs the sm80 forward")
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(settings.TUNED, raising=False)
    tuned.forget_loaded()
    yield table_key(torch.device("cuda", torch.cuda.current_device()))
    tuned.forget_loaded()


def forward(monkeypatch):
    """One d128 forward with launch plans emptied first: (q, k, v, out, lse, the compile key
    of the kernel it launched)."""
    monkeypatch.setattr(cute_fa.ops, "_plans", {})
    q, k, v = _qkv(2, 1000, 1000, 6, 2, D, torch.bfloat16)
    poison_free_memory(_reserve_for((2, 1000, 6, D), torch.bfloat16, (2, 6, 1000)))
    out, lse = cute_fa.flash_attn_func(q, k, v, return_lse=True)
    (config,) = fwd_plan_configs()
    return q, k, v, out, lse, config


def test_tuned_table_picks_the_kernel(monkeypatch, table_key):
    """A table giving the d128 sm90 forward 112 keys a block: the call runs the kernel of that
    key (its launch plan's kernel, held by the compile cache under tile_n 112) and matches the
    reference; after ``reset_table`` a new call runs the built-in 128 keys again."""
    from cute_fa.compile import fwd_cache

    *_, before = forward(monkeypatch)
    assert (before.arch, before.tile_n) == (90, DEFAULT_TILE_N), before.name

    path = tuned.write_table(tuned.Table(table_key, ENTRIES))
    assert path.is_file() and path.parent.parent == settings.cache_base_dir()
    q, k, v, out, lse, config = forward(monkeypatch)
    assert (config.arch, config.tile_n) == (90, TABLE_TILE_N), config.name
    assert config in fwd_cache() and config == before.with_tuning(tile_n=TABLE_TILE_N)
    check_against_ref(out, lse, q, k, v)

    # Read back from the file, as a new process would.
    tuned.forget_loaded()
    *_, reread = forward(monkeypatch)
    assert reread == config, reread.name

    assert tuned.reset_table(table_key) and not path.exists()
    *_, after = forward(monkeypatch)
    assert after == before, after.name


def show() -> list[str]:
    """The lines ``python -m cute_fa tune --show --d 128`` prints in a new process (which reads
    the table from the cache folder of this test's environment)."""
    result = subprocess.run(
        [sys.executable, "-m", "cute_fa", "tune", "--show", "--d", str(D)],
        env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def row(lines: list[str], family: str, problem: str) -> str:
    (found,) = [line for line in lines if line.split()[:2] == [family, problem]]
    return found


def test_tune_show_prints_the_table(table_key):
    """``tune --show`` names the table's file, prints the table's field with the source
    "tuned table" and every other field unmarked (built-in); without the table, none."""
    path = tuned.write_table(tuned.Table(table_key, ENTRIES))
    lines = show()
    assert any(line.startswith("GPU ") and f"tuned table: {path}" in line for line in lines)
    problem = tuned.problem_class(D, D, False)
    plain = row(lines, "sm90_fwd", problem)
    assert f"tile_n={TABLE_TILE_N} (tuned table)" in plain and "tile_m=128 " in plain, plain
    assert plain.count("(tuned table)") == 1, plain
    for family, other in (("sm90_fwd", problem + "-causal"), ("sm90_bwd", problem)):
        line = row(lines, family, other)
        assert "(tuned table)" not in line, line
    assert f"tile_n={DEFAULT_TILE_N}" in row(lines, "sm90_fwd", problem + "-causal")

    assert tuned.reset_table(table_key)
    lines = show()
    assert any(f"tuned table: none at {path}" in line for line in lines), lines
    assert f"tile_n={DEFAULT_TILE_N}" in row(lines, "sm90_fwd", problem)
    assert not any("(tuned table)" in line for line in lines), lines
