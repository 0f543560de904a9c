"""``python -m cute_fa precompile --jobs N``: worker processes (spawned, so what they run must
be importable by name) and what happens when one dies."""

from __future__ import annotations

import os
import subprocess
import sys

from precompile_workers import StubConfig, dies_on_b

from cute_fa import __main__ as cli
from cute_fa import cache


def test_a_dying_worker_fails_only_its_config(capsys):
    todo = [(StubConfig(name), name) for name in "abc"]
    assert cli.precompile(todo, 2, dies_on_b) == 1
    out = capsys.readouterr().out
    assert "a worker process died" in out
    assert "FAIL  b (b): its worker process died" in out
    assert "compiled a (a)" in out and "compiled c (c)" in out


def test_precompile_with_jobs_from_python_m(tmp_path):
    """``python -m cute_fa precompile --jobs 2``: the workers unpickle their task (entries are
    already on disk, so nothing compiles)."""
    env = {**os.environ, cache.ENV_CACHE_DIR: str(tmp_path)}
    env.pop(cache.ENV_CACHE, None)
    plans = cli.precompile_configs("sm80", "sm_90a", [64], ["bf16"], ["plain", "causal"])
    directory = tmp_path / cache.fingerprint()
    directory.mkdir()
    for config, _, _ in plans:
        (directory / cache.entry_name(config)).write_bytes(cache.pack_entry(b"stub"))
    argv = ["--target", "sm_90a", "--head-dims", "64", "--dtypes", "bf16", "--jobs", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "cute_fa", "precompile", *argv, "--variants", "plain,causal"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("hit      bf16 d64") == 2, proc.stdout
