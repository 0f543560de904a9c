"""The benchmark's pieces that need no GPU: FLOPs, grid, rotation, table, CSV, CLI."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch

from cute_fa import bench


def test_flops_helper():
    # 4 * b * h * sq * sk * d, halved for causal, x2.5 for backward.
    assert bench.attention_flops(2, 16, 1024, 1024, 128, False) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.attention_flops(2, 16, 1024, 1024, 128, True) == 2 * 2 * 16 * 1024 * 1024 * 128
    fwd = bench.attention_flops(1, 8, 512, 2048, 64, True)
    assert bench.attention_flops(1, 8, 512, 2048, 64, True, "bwd") == 2.5 * fwd
    with pytest.raises(ValueError):
        bench.attention_flops(1, 1, 1, 1, 64, False, "both")


def _args(argv):
    args = bench.build_parser().parse_args(argv)
    args.d = args.d or list(bench.GRID_D)
    args.seqlen = args.seqlen or list(bench.GRID_SEQLEN)
    args.causal = args.causal or list(bench.GRID_CAUSAL)
    return args


def test_standard_grid():
    cases = bench.grid_cases(_args([]))
    assert len(cases) == 3 * 6 * 2
    for c in cases:
        assert c.batch * c.seqlen == 16384 and c.heads * c.head_dim == 2048
    one = bench.grid_cases(_args(["--d", "128", "--seqlen", "8k", "--causal", "0"]))
    assert one == [bench.Case(128, 8192, False, 2, 16)]


def test_rotation_and_set_count():
    calls = []
    rot = bench.Rotation([lambda i=i: calls.append(i) for i in range(3)])
    for _ in range(7):
        rot()
    assert calls == [0, 1, 2, 0, 1, 2, 0]
    l2 = 60 << 20
    assert bench.num_input_sets(192 << 20, l2) == 2  # big sets: still two
    n = bench.num_input_sets(1 << 20, l2)
    assert n * (1 << 20) >= 3 * l2 or n == 16


def test_table_and_csv(tmp_path):
    case = bench.Case(128, 8192, False, 2, 16)
    flops = bench.attention_flops(2, 16, 8192, 8192, 128, False)
    ms = flops / 400e12 * 1e3  # 400 TFLOPs/s
    results = [
        bench.Result("fwd", case, "cute_fa", ms),
        bench.Result("fwd", case, "flash", 2 * ms),
        bench.Result("fwd", case, "cudnn", None, "err", "RuntimeError: no kernel"),
        bench.Result("bwd", case, "cute_fa", None, "n/a", "not implemented"),
    ]
    assert results[0].tflops == pytest.approx(400)
    table = bench.format_table(results, "fwd", ["cute_fa", "flash", "cudnn"])
    last = table.splitlines()[-1].split()
    assert last[:5] == ["128", "8192", "0", "2", "16"]
    assert last[5:] == ["400.0", "200.0", "err", "2.00", "-"]
    assert "cute_fa/FLASH" in table and "cute_fa/CUDNN" in table
    assert "n/a" in bench.format_table(results, "bwd", ["cute_fa"])

    path = tmp_path / "bench.csv"
    bench.write_csv(str(path), results, "bf16")
    rows = list(csv.DictReader(path.open()))
    assert [r["status"] for r in rows] == ["ok", "ok", "err", "n/a"]
    assert float(rows[0]["tflops"]) == pytest.approx(400, rel=1e-3)


def test_cli_help_and_no_gpu():
    out = subprocess.run(
        [sys.executable, "-m", "cute_fa", "bench", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--peers" in out.stdout
    if not torch.cuda.is_available():
        assert bench.main(["--d", "64", "--seqlen", "512"]) == 2
