"""``python -m cute_fa precompile --jobs N``: worker processes (spawned, so what they run must
be importable by name) and what happens when one dies."""

from __future__ import annotations

import os
import subprocess
import sys

from precompile_workers import StubConfig, dies_on_b

from cute_fa import cache
from cute_fa.tools import precompile


def test_a_dying_worker_fails_only_its_config(capsys):
    todo = [(StubConfig(name), name) for name in "abc"]
    assert precompile.precompile(todo, 2, dies_on_b) == 1
    out = capsys.readouterr().out
    assert "a worker process died" in out
    assert "FAIL  b (b): its worker process died" in out
    assert "compiled a (a)" in out and "compiled c (c)" in out


def test_precompile_with_jobs_from_python_m(tmp_path):
    """``python -m cute_fa precompile --jobs 2``: the workers unpickle their task (entries are
    already on disk, so nothing compiles), forward and backward kernels alike."""
    env = {**os.environ, cache.ENV_CACHE_DIR: str(tmp_path)}
    env.pop(cache.ENV_CACHE, None)
    plans = precompile.precompile_configs(
        "auto", "sm_90a", [64], ["bf16"], ["plain", "causal"], "both"
    )
    tasks = [task for task, _, _ in plans if task is not None]
    assert {task.kind for task in tasks} == {"fwd", "bwd", "bwd-pre", "bwd-post"}
    directory = tmp_path / cache.fingerprint()
    directory.mkdir()
    for task in tasks:
        (directory / cache.entry_name(task.config)).write_bytes(cache.pack_entry(b"stub"))
    argv = ["--target", "sm_90a", "--head-dims", "64", "--dtypes", "bf16", "--jobs", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "cute_fa", "precompile", *argv, "--variants", "plain,causal"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hits = [line for line in proc.stdout.splitlines() if line.startswith("hit ")]
    assert len(hits) == len(tasks), proc.stdout
    assert "compiled" not in proc.stdout, proc.stdout


def test_precompile_auto_lists_what_dispatch_runs():
    """--arch auto (the default) on sm_90a: the forward configs are those dispatch plans for an
    sm90 device (short and long query sequences included), the backward's those the backward
    builds; --arch sm80 forces the sm80 family for both."""
    from cute_fa.planning import FwdRequest, bwd_config, fwd_plan, post_config, pre_config

    variants = ["plain", "causal", "local+softcap", "varlen+causal"]
    plans = precompile.precompile_configs("auto", "sm_90a", [64, 128], ["bf16"], variants, "both")
    configs = {(task.kind, task.config) for task, _, _ in plans if task is not None}
    assert all(task is not None for task, _, _ in plans), [p for p in plans if p[0] is None]
    for d in (64, 128):
        for variant in variants:
            flags = precompile._variant_flags(variant)
            request = FwdRequest(dtype="bf16", head_dim=d, head_dim_v=d, **flags)
            for hint in (
                None,
                1,
                1000,
                2048,
                3000,
                4096,
                6000,
                8192,
                9000,
                precompile.LONG_SEQLEN_HINT,
            ):
                assert ("fwd", fwd_plan((9, 0), request, hint)[1]) in configs, (d, variant, hint)
            main = bwd_config("sm_90a", "bf16", d, d, **flags)
            assert main.arch == 90 and ("bwd", main) in configs
            assert ("bwd-pre", pre_config(main, True)) in configs
            assert ("bwd-post", post_config(main)) in configs
    forced = precompile.precompile_configs("sm80", "sm_90a", [128], ["bf16"], ["causal"], "both")
    assert {task.config.arch for task, _, _ in forced if task is not None} == {80}
    fwd_only = precompile.precompile_configs("auto", "sm_90a", [128], ["bf16"], ["causal"], "fwd")
    assert {task.kind for task, _, _ in fwd_only} == {"fwd"}
