"""The benchmark's pieces that need no GPU: FLOPs, grid, rotation, table, CSV, CLI."""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys

import pytest
import torch

from cute_fa.tools import bench


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


def test_value_head_dim_and_softcap_cases(tmp_path):
    """--dv and --softcap reach the cases, the FLOPs (PV counts dv), the table's d column and the
    CSV."""
    args = _args(["--d", "192", "--dv", "128", "--seqlen", "8k", "--causal", "1",
                  "--softcap", "15", "--hidden", "1536"])  # fmt: skip
    (case,) = bench.grid_cases(args)
    assert case == bench.Case(192, 8192, True, 2, 8, 128, 15.0)
    assert case.dv == 128 and case.d_label == "192x128"
    assert bench.Case(128, 512, False, 32, 16).d_label == "128"
    flops = bench.attention_flops(2, 8, 8192, 8192, 192, True, "bwd", 128)
    assert flops == 2.5 * 0.5 * 2 * 2 * 8 * 8192 * 8192 * (192 + 128)
    result = bench.Result("bwd", case, "cute_fa", flops / 300e12 * 1e3)
    assert result.tflops == pytest.approx(300)
    table = bench.format_table([result], "bwd", ["cute_fa"])
    assert table.splitlines()[-1].split()[:2] == ["192x128", "8192"]
    path = tmp_path / "bench.csv"
    bench.write_csv(str(path), [result], "bf16")
    (row,) = csv.DictReader(path.open())
    assert row["head_dim"] == "192" and row["head_dim_v"] == "128" and row["softcap"] == "15.0"


def test_window_cases_and_exact_flops(tmp_path):
    """--window replaces --causal, its FLOPs count the kept pairs, and it reaches the table's
    title, the CSV and the SDPA peers' refusal."""
    assert bench.visible_pairs(4, 4, 1 << 29, 0) == 10  # causal 4x4: 1 + 2 + 3 + 4
    assert bench.visible_pairs(4, 6, 1, 0) == 8  # bottom-right: each row its key and one left
    assert bench.visible_pairs(3, 3, -5, -4) == 0  # a band that misses every key
    args = _args(["--d", "64", "--seqlen", "1k", "--window", "128,0"])
    args.causal = [0]  # main() does this with --window
    (case,) = bench.grid_cases(args)
    assert case.window == (128, 0) and not case.causal
    pairs = sum(min(i, 128) + 1 for i in range(1024))
    assert bench.visible_pairs(1024, 1024, 128, 0) == pairs
    flops = bench.attention_flops(16, 32, 1024, 1024, 64, False, "fwd", None, (128, 0))
    assert flops == 2.0 * 16 * 32 * pairs * 128
    result = bench.Result("fwd", case, "cute_fa", flops / 100e12 * 1e3)
    assert result.tflops == pytest.approx(100)
    assert "window 128,0" in bench.format_table([result], "fwd", ["cute_fa"]).splitlines()[0]
    path = tmp_path / "bench.csv"
    bench.write_csv(str(path), [result], "bf16")
    (row,) = csv.DictReader(path.open())
    assert row["window_left"] == "128" and row["window_right"] == "0"
    with pytest.raises(bench.ImplUnavailable, match="sliding window"):
        bench.Impl("cudnn").forward_fn(*(torch.zeros(1, 4, 1, 64),) * 3, False, 0.0, (128, 0))
    with pytest.raises(SystemExit):
        bench.main(["--window", "128,0", "--causal", "1"])


def test_sdpa_peers_refuse_softcap():
    impl = bench.Impl("flash")
    q = torch.zeros(1, 4, 1, 64)
    with pytest.raises(bench.ImplUnavailable, match="softcap"):
        impl.forward_fn(q, q, q, False, softcap=15.0)


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


def test_tuning_variants_parse_and_get_columns():
    setting = "sm90_fwd.rescale_threshold"
    assert "CUTE_FA_FWD_ARCH" in bench.family_settings()
    name = f"cute_fa:{setting}=8:sm90_fwd.tile_n=64"
    assert bench.split_impl(name) == ("cute_fa", ((setting, "8"), ("sm90_fwd.tile_n", "64")))
    assert bench.split_impl("cudnn") == ("cudnn", ())
    assert bench.impl_label(name) == "cute_fa sm90_fwd.rescale_threshold=8 sm90_fwd.tile_n=64"
    assert bench._name_list(f"cute_fa,{name},cudnn") == ["cute_fa", name, "cudnn"]
    assert bench._name_list("cute_fa:CUTE_FA_FWD_ARCH=80") == ["cute_fa:CUTE_FA_FWD_ARCH=80"]
    for bad, why in (("cudnn:CUTE_FA_FWD_ARCH=80", "only cute_fa"),
                     ("cute_fa:CUTE_FA_NO_SUCH=1", "family.field=value"),
                     ("cute_fa:sm90_fwd.no_such=1", "no field no_such"),
                     ("cute_fa:sm99_fwd.tile_n=1", "unknown tuning family"),
                     ("cute_fa:sm90_fwd.tile_n=big", "an int, true or false"),
                     (f"cute_fa:{setting}", "NAME=VALUE"),
                     ("cute_fa,cute_fa", "named twice"),
                     ("nope:CUTE_FA_FWD_ARCH=80", "unknown implementation")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            bench._name_list(bad)

    case = bench.Case(128, 4096, True, 4, 16)
    ms = bench.attention_flops(4, 16, 4096, 4096, 128, True) / 500e12 * 1e3
    results = [
        bench.Result("fwd", case, "cute_fa", ms),
        bench.Result("fwd", case, f"cute_fa:{setting}=8", ms / 1.1),
        bench.Result("fwd", case, "cudnn", ms),
    ]
    table = bench.format_table(results, "fwd", [r.impl for r in results])
    header, _, last = table.splitlines()[1:]
    assert "sm90_fwd.rescale_threshold=8/cute_fa" in header
    assert last.split()[5:] == ["500.0", "550.0", "500.0", "1.00", "1.10"]


def test_cli_help_and_no_gpu():
    out = subprocess.run(
        [sys.executable, "-m", "cute_fa", "bench", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--peers" in out.stdout
    if not torch.cuda.is_available():
        assert bench.main(["--d", "64", "--seqlen", "512"]) == 2


def _probe_report(**changes):
    report = {
        "import_torch_s": 1.0,
        "import_cute_fa_s": 0.002,
        "cuda_init_s": 0.4,
        "gc_debt_s": 0.12,
        "first_call_s": 0.050,
        "second_call_s": 0.0001,
        "gc_s": 0.0,
        "dsl_imported": False,
        "kernels": ["fwd_sm80_sm_90a_bf16_d128_128x64w4"],
        "compiles": 0,
        "disk_hits": 1,
        "steps_s": {"fingerprint": 0.003, "import tvm_ffi": 0.025, "load": 0.002},
        "sdpa_first_call_s": 0.030,
    }
    return {**report, **changes}


def test_compile_time_tables():
    """``--compile-time`` tables from probe reports: the steps of a first call add up to it
    (``rest`` is what no step covers), a staged run gets its own table, a failed run a row."""
    cold = _probe_report(
        first_call_s=5.0,
        dsl_imported=True,
        compiles=1,
        disk_hits=0,
        steps_s={"import DSL": 0.6, "cute.compile": 4.0, "export": 0.15, "link": 0.02},
    )
    staged = _probe_report(plan_load_s=0.030, first_call_s=0.020)
    del staged["sdpa_first_call_s"]
    summary, steps, stages = bench.compile_time_rows(
        [("cold", cold), ("hit", _probe_report()), ("staged", staged), ("broken", None)]
    )
    assert [r[0] for r in summary] == ["cold", "hit", "staged", "broken"]
    assert summary[0][1:3] == ["5.000", "0.10"] and summary[0][5:8] == ["120.0", "yes", "1/0"]
    assert summary[3][1] == "err"
    header = ["run", "first call", *bench.FIRST_CALL_STEPS, "rest", "GC", "SDPA 1st"]
    cold_row, hit_row = (dict(zip(header, row, strict=True)) for row in steps)
    assert cold_row["cute.compile"] == "4000.0" and cold_row["rest"] == "230.0"
    assert hit_row["import tvm_ffi"] == "25.0" and hit_row["rest"] == "20.0"
    assert hit_row["SDPA 1st"] == "30.0"
    assert stages == [["staged", "30.0", "20.0", "50.0", "0.0"]]


def test_probe_process_times_its_imports_then_runs_the_cli():
    """The probe process starts from a bootstrap that times ``import torch`` and ``import
    cute_fa`` before handing its arguments to the bench's CLI."""
    out = subprocess.run(
        [sys.executable, "-c", bench._PROBE_BOOTSTRAP, "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--compile-time" in out.stdout, out.stderr


class _FakeImpl(bench.Impl):
    """An implementation whose calls record their name; ``fail``: raise that on timing."""

    def __init__(self, name, log, fail=None):
        super().__init__(name)
        self.log, self.fail = log, fail

    def forward_fn(self, q, k, v, causal, softcap=0.0, window=None):
        if self.fail is NotImplementedError:
            raise NotImplementedError(f"{self.name}: not for this case")

        def run():
            if self.fail is RuntimeError:
                raise RuntimeError(f"{self.name}: launch failed")
            self.log.append(self.name)

        return run


def test_rounds_time_peers_in_turns_and_report_the_median(monkeypatch):
    """--rounds N times every implementation of a case N times in turns (A, B, A, B, ...) and
    reports the median of its turns; a peer that cannot run the case or fails is reported once
    and never timed again, without stopping the others."""
    log, timed = [], []
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: type("P", (), {"L2_cache_size": 1 << 20})()
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    from cute_fa.tools.bench import grid

    monkeypatch.setattr(grid, "_make_sets", lambda case, dtype, n, grad: [(None, None, None)])
    monkeypatch.setattr(grid, "_to_layout", lambda sets, layout, grad: sets)
    turn_ms = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 6.0, 4.0])}

    def fake_median_ms(fn, warmup, rep):
        fn()  # one call: records the implementation (or raises)
        name = log[-1]
        timed.append(name)
        return next(turn_ms[name])

    monkeypatch.setattr(grid, "median_ms", fake_median_ms)
    impls = [_FakeImpl("a", log), _FakeImpl("b", log), _FakeImpl("c", log, NotImplementedError),
             _FakeImpl("d", log, RuntimeError)]  # fmt: skip
    args = type("Args", (), {"rounds": 3, "warmup": 1.0, "rep": 1.0})()
    case = bench.Case(64, 512, False, 2, 4)
    results = bench.time_case(case, "fwd", impls, torch.bfloat16, args, bench.ErrorLog())
    assert timed == ["a", "b"] * 3
    by_name = {r.impl: r for r in results}
    assert [r.impl for r in results] == ["a", "b", "c", "d"]
    assert by_name["a"].ms == 2.0 and by_name["b"].ms == 5.0
    assert by_name["c"].status == "n/a" and by_name["d"].status == "err"
    assert "launch failed" in by_name["d"].reason


def test_rounds_option():
    assert bench.build_parser().parse_args([]).rounds == 1
    assert bench.build_parser().parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--rounds", "0"])


def test_fa4_peer_is_unavailable_without_flash_attn_cute(monkeypatch):
    """FA4 is a default peer; where ``flash_attn.cute`` does not import it reads n/a."""
    import sys

    assert "fa4" in bench.DEFAULT_PEERS and bench.impl_label("fa4") == "FA4"
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails as if not installed
    with pytest.raises(bench.ImplUnavailable, match="fa4"):
        bench.Impl("fa4").forward_fn(None, None, None, causal=False)


def test_table_has_the_fa4_ratio():
    case = bench.Case(128, 4096, False, 4, 16)
    ms = bench.attention_flops(4, 16, 4096, 4096, 128, False) / 500e12 * 1e3
    results = [
        bench.Result("fwd", case, "cute_fa", ms),
        bench.Result("fwd", case, "fa4", ms * 1.25),
    ]
    table = bench.format_table(results, "fwd", ["cute_fa", "fa4"])
    header, _, last = table.splitlines()[1:]
    assert "cute_fa/FA4" in header and last.split()[-1] == "1.25"
