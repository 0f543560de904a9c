"""The benchmark's decode mode without a GPU: options, points, bytes and bandwidth, paged
inputs, the peers' decode calls on the CPU, timing with stand-ins, table and CSV."""

from __future__ import annotations

import csv

import pytest
import torch

from cute_fa.tools import bench
from cute_fa.tools.bench import decode, grid

GIB = 1 << 30


def test_default_points():
    args = bench.parse_args(["--decode"])
    assert args.batch == [1, 8, 64] and args.seqlen_q == [1, 4]
    assert args.seqlen == [4096, 32768, 131072] and args.d == [128]
    assert args.layouts == ["contiguous", "page16", "page128"]
    assert args.peers == ["cute_fa", "fa4", "flash", "cudnn"]
    points = bench.decode_points(args)
    assert len(points) == 2 * 3 * 3 * 3
    assert len(set(points)) == len(points)
    for p in points:
        assert (p.heads, p.heads_kv, p.head_dim, p.dv) == (32, 8, 128, 128)
    assert points[0] == bench.DecodePoint(1, 1, 4096, "contiguous")
    assert points[-1] == bench.DecodePoint(64, 4, 131072, "page128")
    assert max(p.kv_bytes for p in points) == 32 * GIB  # 64 x 128k keys x 8 heads x 2 x 256 B


def test_subset_points():
    args = bench.parse_args(["--decode", "--batch", "1,8", "--seqlen", "4k,32k", "--seqlen-q",
                             "1", "--layouts", "contiguous,page16",
                             "--peers", "cute_fa,fa4"])  # fmt: skip
    points = bench.decode_points(args)
    assert len(points) == 2 * 2 * 1 * 2
    assert {(p.batch, p.cache_len, p.seqlen_q, p.layout) for p in points} == {
        (b, c, 1, layout)
        for b in (1, 8)
        for c in (4096, 32768)
        for layout in ("contiguous", "page16")
    }
    assert args.peers == ["cute_fa", "fa4"]
    # Without --decode the grid's options and peers stay as they were.
    grid_args = bench.parse_args([])
    assert grid_args.peers == list(bench.DEFAULT_PEERS) and grid_args.seqlen == [
        512, 1024, 2048, 4096, 8192, 16384
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode", "--layouts", "page0"], "unknown K/V layout"),
        (["--decode", "--layouts", "paged"], "unknown K/V layout"),
        (["--decode", "--layouts", "contiguous,contiguous"], "named twice"),
        (["--decode", "--batch", "0"], "positive integers"),
        (["--decode", "--batch", "eight"], "positive integers"),
        (["--decode", "--seqlen-q", "0,1"], "positive integers"),
        (["--decode", "--mode", "bwd"], "forward only"),
        (["--decode", "--causal", "1"], "causal"),
        (["--decode", "--window", "128,0"], "--window"),
        (["--decode", "--softcap", "15"], "--softcap"),
        (["--decode", "--overhead"], "separate modes"),
        (["--decode", "--ceilings"], "separate modes"),
        (["--batch", "8"], "only with --decode"),
        (["--layouts", "page16", "--seqlen-q", "1"], "--seqlen-q, --layouts: only with --decode"),
        (["--decode", "--seqlen", "1000", "--layouts", "page16"], "whole number of page16"),
        (["--decode", "--seqlen", "2", "--seqlen-q", "4"], "shorter than seqlen_q"),
    ],
)
def test_bad_options_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_no_gpu_exits_before_timing():
    if not torch.cuda.is_available():
        assert bench.main(["--decode", "--batch", "1", "--seqlen", "4k"]) == 2


def test_bytes_and_bandwidth():
    assert bench.bandwidth_tbps(1e12, 1000.0) == pytest.approx(1.0)
    assert bench.bandwidth_tbps(4.2e9, 1.0) == pytest.approx(4.2)
    point = bench.DecodePoint(8, 1, 32768, "page16")
    assert point.kv_bytes == 8 * 32768 * 8 * 128 * 2 * 2 == GIB
    assert point.qo_bytes == 8 * 1 * 32 * 256 * 2
    assert (point.page_size, point.pages_per_seq) == (16, 2048)
    assert bench.DecodePoint(8, 1, 32768, "contiguous").page_size is None
    result = bench.DecodeResult(point, "cute_fa", 0.4)  # 1 GiB in 400 us: 2.684 TB/s
    assert result.us == pytest.approx(400.0)
    assert result.kv_tbps == pytest.approx(GIB / 0.4e-3 / 1e12) == pytest.approx(2.68435456)
    assert result.of_copy(4.0) == pytest.approx(result.kv_tbps / 4.0)
    assert result.of_copy(None) is None
    failed = bench.DecodeResult(point, "fa4", None, "n/a", "no")
    assert failed.kv_tbps is None and failed.of_copy(4.0) is None
    assert point.label == "sq=1 b=8 cache=32k page16"


def test_one_input_set_for_large_points():
    l2 = 50 << 20
    assert bench.num_input_sets(32 * GIB, l2, min_sets=1) == 1
    assert bench.num_input_sets(3 * l2, l2, min_sets=1) == 1
    small = bench.DecodePoint(1, 1, 4096, "contiguous").kv_bytes  # 16 MiB
    n = bench.num_input_sets(small, l2, min_sets=1)
    assert n > 1 and n * small >= 3 * l2
    assert bench.num_input_sets(32 * GIB, l2) == 2  # the grid keeps two


def test_page_table_is_a_shuffled_permutation():
    gen = torch.Generator().manual_seed(0)
    table = bench.make_page_table(4, 8, device="cpu", generator=gen)
    assert table.shape == (4, 8) and table.dtype == torch.int32
    assert sorted(table.flatten().tolist()) == list(range(32))  # every page once
    for row in table.tolist():
        assert len(set(row)) == 8
    assert table.flatten().tolist() != list(range(32))  # shuffled


def test_inputs_of_each_layout():
    gen = torch.Generator().manual_seed(1)
    paged = bench.DecodePoint(3, 4, 256, "page16", heads=4, heads_kv=2, head_dim=64,
                              head_dim_v=32)  # fmt: skip
    x = bench.make_inputs(paged, torch.bfloat16, "cpu", gen)
    assert x.q.shape == (3, 4, 4, 64)
    assert x.k.shape == (3 * 16, 16, 2, 64) and x.v.shape == (3 * 16, 16, 2, 32)
    assert x.page_table.shape == (3, 16)
    assert sorted(x.page_table.flatten().tolist()) == list(range(48))
    assert x.seqused_k.dtype == torch.int32 and x.seqused_k.tolist() == [256] * 3
    flat = bench.DecodePoint(3, 1, 256, "contiguous", heads=4, heads_kv=2, head_dim=64)
    y = bench.make_inputs(flat, torch.bfloat16, "cpu", gen)
    assert y.k.shape == y.v.shape == (3, 256, 2, 64) and y.page_table is None
    assert y.q.dtype == y.k.dtype == torch.bfloat16


def test_sdpa_decode_is_bottom_right_causal():
    """The SDPA peers see each query row's keys up to its position at the end of the cache: one
    row sees every key, and CUDNN's explicit mask matches torch's lower-right causal bias."""
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 4, 32, generator=gen)
    k, v = (torch.randn(2, 10, 2, 32, generator=gen) for _ in range(2))
    used = torch.full((2,), 10, dtype=torch.int32)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    F = torch.nn.functional
    want = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=causal_lower_right(4, 10), enable_gqa=True
    ).transpose(1, 2)
    got = bench.Impl("cudnn").decode_fn(q, k, v, used)()
    torch.testing.assert_close(got.transpose(1, 2), want)
    one = bench.Impl("cudnn").decode_fn(q[:, -1:], k, v, used)()
    torch.testing.assert_close(one.transpose(1, 2), want[:, -1:])


def test_decode_peers_that_cannot_take_a_point(monkeypatch):
    import sys

    q = torch.zeros(1, 1, 4, 64)
    k = torch.zeros(4, 16, 2, 64)
    used = torch.full((1,), 64, dtype=torch.int32)
    table = torch.arange(4, dtype=torch.int32).reshape(1, 4)
    for name in ("flash", "cudnn"):
        with pytest.raises(bench.ImplUnavailable, match="paged"):
            bench.Impl(name).decode_fn(q, k, k, used, table, 64)
    with pytest.raises(bench.ImplUnavailable, match="decode"):
        bench.Impl("flex").decode_fn(q, k, k, used)
    # cute_fa takes a paged cache; on CPU tensors the call stops at the device check, which the
    # decode table reads as n/a.
    with pytest.raises(ValueError, match="CUDA") as e:
        bench.Impl("cute_fa").decode_fn(q.bfloat16(), k.bfloat16(), k.bfloat16(), used, table,
                                        64)()  # fmt: skip
    assert bench.unavailable(e.value)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(bench.ImplUnavailable, match="fa4"):
        bench.Impl("fa4").decode_fn(q, k, k, used, table, 64)


def test_fa4_splits_only_where_its_forward_splits():
    assert [bench.fa4_decode_splits(m) for m in (8, 9, 10, 11, 12)] == [1, 1, 0, 0, 1]


def test_what_reads_na():
    assert bench.unavailable(bench.ImplUnavailable("x"))
    assert bench.unavailable(NotImplementedError("x"))
    assert bench.unavailable(ValueError("x"))
    assert bench.unavailable(RuntimeError("No available kernel. Aborting execution."))
    assert bench.unavailable(RuntimeError("No viable backend for scaled_dot_product_attention"))
    assert not bench.unavailable(RuntimeError("CUDA error: an illegal memory access"))
    assert not bench.unavailable(AssertionError("x"))


class _FakeDecodeImpl(bench.Impl):
    """Records the inputs of its decode calls; ``fail``: raise it when built or called."""

    def __init__(self, name, seen, fail=None):
        super().__init__(name)
        self.seen, self.fail = seen, fail

    def decode_fn(self, q, k, v, seqused_k, page_table=None, max_seqlen_k=None):
        if isinstance(self.fail, NotImplementedError):
            raise self.fail
        self.seen.setdefault(self.name, []).append((id(k), page_table is None, max_seqlen_k))

        def run():
            if isinstance(self.fail, RuntimeError):
                raise self.fail

        return run


def test_time_point_builds_inputs_once_and_reports_every_peer(monkeypatch, capsys):
    """One point: its input sets are built once and shared by every implementation; one that
    cannot take the point reads n/a and one that fails err, both with reasons on stderr; the
    others get their median."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: type("P", (), {"L2_cache_size": 1 << 20})()
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(decode, "DEVICE", "cpu")
    built = []

    def make_inputs(point, dtype, device):
        built.append(point)
        return bench.DecodeInputs(*(torch.zeros(1) for _ in range(4)), None)

    monkeypatch.setattr(decode, "make_inputs", make_inputs)
    monkeypatch.setattr(grid, "median_ms", lambda fn, warmup, rep: fn() or 0.25)
    seen: dict = {}
    impls = [
        _FakeDecodeImpl("cute_fa", seen),
        _FakeDecodeImpl("fa4", seen, NotImplementedError("fa4: nothing for this")),
        _FakeDecodeImpl("flash", seen, RuntimeError("No available kernel. Aborting execution.")),
        _FakeDecodeImpl("cudnn", seen, RuntimeError("launch failed")),
    ]
    args = type("Args", (), {"rounds": 2, "warmup": 1.0, "rep": 1.0})()
    point = bench.DecodePoint(64, 1, 131072, "contiguous")  # 32 GiB: one input set
    results = bench.time_point(point, impls, torch.bfloat16, args, bench.ErrorLog())
    assert built == [point]
    (cute_k,) = {k for k, _, _ in seen["cute_fa"]}
    assert seen["cute_fa"] == [(cute_k, True, 131072)]
    assert [k for k, _, _ in seen["flash"]] == [cute_k]  # the same tensors
    by = {r.impl: r for r in results}
    assert [r.impl for r in results] == ["cute_fa", "fa4", "flash", "cudnn"]
    assert by["cute_fa"].ms == 0.25 and by["cute_fa"].status == "ok"
    assert by["fa4"].status == "n/a" and "nothing for this" in by["fa4"].reason
    assert by["flash"].status == "n/a" and by["cudnn"].status == "err"
    err = capsys.readouterr().err
    for name in ("fa4", "flash", "cudnn"):
        assert f"[{name}] decode sq=1 b=64 cache=128k contiguous:" in err
    small = bench.DecodePoint(1, 1, 4096, "page16")
    built.clear()
    bench.time_point(small, impls[:1], torch.bfloat16, args, bench.ErrorLog())
    assert len(built) == bench.num_input_sets(small.kv_bytes + small.qo_bytes, 1 << 20, min_sets=1)


def test_decode_table_and_csv(tmp_path):
    point = bench.DecodePoint(8, 1, 32768, "contiguous")
    paged = bench.DecodePoint(8, 1, 32768, "page16")
    ms = point.kv_bytes / 3e12 * 1e3  # 3 TB/s
    results = [
        bench.DecodeResult(point, "cute_fa", ms),
        bench.DecodeResult(point, "fa4", ms * 1.25),
        bench.DecodeResult(point, "flash", ms * 1.5),
        bench.DecodeResult(point, "cudnn", None, "n/a", "RuntimeError: No available kernel"),
        bench.DecodeResult(paged, "cute_fa", None, "n/a", "NotImplementedError: page_table"),
        bench.DecodeResult(paged, "fa4", ms),
        bench.DecodeResult(paged, "flash", None, "n/a", "ImplUnavailable: paged"),
        bench.DecodeResult(paged, "cudnn", None, "err", "RuntimeError: boom"),
    ]
    assert bench.best_peer(results[:4]).impl == "fa4"
    assert bench.cute_fa_over_best(results[:4]) == pytest.approx(1.25)
    assert bench.cute_fa_over_best(results[4:]) is None
    names = ["cute_fa", "fa4", "flash", "cudnn"]
    table = bench.format_decode_table(results, names, 4.0)
    lines = table.splitlines()
    assert "4.00 TB/s" in lines[0] and "heads 32/8, d 128" in lines[0]
    assert lines[1].split() == ["cute_fa", "FA4", "SDPA", "FLASH", "SDPA", "CUDNN"]
    header = lines[2].split()
    assert header[:7] == ["sq", "batch", "cache", "layout", "us", "TB/s", "/copy"]
    assert header[-3:] == ["best", "peer", "cute_fa/best"]
    first, second = lines[4].split(), lines[5].split()
    assert first[:4] == ["1", "8", "32k", "contiguous"]
    assert first[4:7] == [f"{ms * 1e3:.1f}", "3.00", "0.75"]
    assert first[7:10] == [f"{ms * 1.25e3:.1f}", "2.40", "0.60"]
    assert first[10:13] == [f"{ms * 1.5e3:.1f}", "2.00", "0.50"]
    assert first[13:] == ["n/a", "-", "-", "FA4", "1.25"]
    assert second[4:7] == ["n/a", "-", "-"] and second[13:] == ["err", "-", "-", "FA4", "-"]
    path = tmp_path / "decode.csv"
    bench.write_decode_csv(str(path), results, "bf16", 4.0)
    rows = list(csv.DictReader(path.open()))
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "n/a", "n/a", "ok", "n/a", "err"]
    assert rows[0]["kv_bytes"] == str(point.kv_bytes) and rows[0]["page_size"] == ""
    assert float(rows[0]["kv_tbps"]) == pytest.approx(3.0) and rows[0]["copy_tbps"] == "4.0000"
    assert float(rows[0]["of_copy"]) == pytest.approx(0.75)
    assert (
        rows[4]["page_size"] == "16" and rows[4]["ms"] == "" and "page_table" in rows[4]["reason"]
    )
    assert "not measured" in bench.format_decode_table(results, names, None).splitlines()[0]


def test_error_log_names_grid_cases_and_decode_points(capsys):
    log = bench.ErrorLog()
    log.report("cute_fa", bench.Case(128, 8192, True, 2, 16), "fwd", RuntimeError("x"))
    log.report("fa4", bench.DecodePoint(1, 4, 4096, "page128"), "decode", ValueError("y"))
    err = capsys.readouterr().err
    assert "[cute_fa] fwd d=128 s=8192 causal=1: RuntimeError: x" in err
    assert "[fa4] decode sq=4 b=1 cache=4k page128: ValueError: y" in err
