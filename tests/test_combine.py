"""``flash_attn_combine`` on the CPU: its argument checks (each error before any device check,
so CPU tensors reach them) and compile-only checks of the combine kernel
(``ampere/flash_combine.py``) with a SASS read. tests/test_combine_gpu.py runs it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from cute_fa.ampere.support import CombineConfig, combine_can_implement

import cute_fa
from cute_fa.tools.sass import count_opcodes, disassemble, resource_usage


def _partials(s=3, b=2, sq=5, h=4, d=64, dtype=torch.float32):
    return torch.randn(s, b, sq, h, d, dtype=dtype), torch.randn(s, b, sq, h)


def test_combine_is_exported_with_fa4s_signature() -> None:
    import inspect

    params = list(inspect.signature(cute_fa.flash_attn_combine).parameters)
    assert params == ["out_partial", "lse_partial", "out", "out_dtype", "cu_seqlens", "seqused",
                      "virtual_batch_idx", "return_lse"]  # fmt: skip


def test_combine_valid_cpu_input_reaches_the_device_check() -> None:
    op, lp = _partials()
    with pytest.raises(ValueError, match="runs on CUDA GPUs: out_partial"):
        cute_fa.flash_attn_combine(op, lp)
    packed_op, packed_lp = op[:, 0], lp[:, 0]
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    used = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="runs on CUDA GPUs"):
        cute_fa.flash_attn_combine(packed_op, packed_lp, cu_seqlens=cu, seqused=used)


def _bad_cases():
    op, lp = _partials()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    return [
        ("int-partial", dict(out_partial=op.int(), lse_partial=lp), TypeError, "out_partial must"),
        ("fp16-lse", dict(out_partial=op, lse_partial=lp.half()), TypeError, "lse_partial must"),
        ("not-tensor", dict(out_partial=op.tolist(), lse_partial=lp), TypeError, "torch.Tensor"),
        ("out-dtype", dict(out_partial=op, lse_partial=lp, out_dtype=torch.int8), TypeError,
         "out_dtype"),
        ("out-vs-out_dtype", dict(out_partial=op, lse_partial=lp, out=torch.empty(op.shape[1:]),
                                  out_dtype=torch.bfloat16), TypeError, "differs from out_dtype"),
        ("rank3", dict(out_partial=op[0, 0], lse_partial=lp[0, 0]), ValueError, "5-D"),
        ("lse-shape", dict(out_partial=op, lse_partial=lp[:, :, :4]), ValueError,
         "lse_partial must have shape"),
        ("head-dim", dict(out_partial=op[..., :12], lse_partial=lp), ValueError, "multiple of 8"),
        ("head-dim-big", dict(out_partial=torch.zeros(2, 1, 1, 1, 520), lse_partial=torch.zeros(
            2, 1, 1, 1)), ValueError, "up to 512"),
        ("out-shape", dict(out_partial=op, lse_partial=lp, out=torch.empty(2, 5, 4, 32)),
         ValueError, "out must have shape"),
        ("stride", dict(out_partial=torch.zeros(3, 2, 5, 4, 66)[..., :64], lse_partial=lp),
         ValueError, "not a multiple of 4"),
        ("last-dim", dict(out_partial=op.transpose(-1, -2).contiguous().transpose(-1, -2),
                          lse_partial=lp), ValueError, "contiguous in its last dim"),
        ("cu-batched", dict(out_partial=op, lse_partial=lp, cu_seqlens=cu), ValueError,
         "packed input"),
        ("seqused-packed-no-cu", dict(out_partial=op[:, 0], lse_partial=lp[:, 0],
                                      seqused=torch.zeros(1, dtype=torch.int32)), ValueError,
         "needs cu_seqlens"),
        ("cu-dtype", dict(out_partial=op[:, 0], lse_partial=lp[:, 0], cu_seqlens=cu.long()),
         TypeError, "cu_seqlens must be torch.int32"),
        ("seqused-len", dict(out_partial=op, lse_partial=lp,
                             seqused=torch.zeros(3, dtype=torch.int32)), ValueError,
         "seqused must have 2 entries"),
        ("cu-total", dict(out_partial=op[:, 0], lse_partial=lp[:, 0],
                          cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError,
         r"cu_seqlens\[-1\] \(4\) must equal total"),
        ("seqused-room", dict(out_partial=op, lse_partial=lp,
                              seqused=torch.tensor([5, 6], dtype=torch.int32)), ValueError,
         r"seqused\[1\] = 6 is outside \[0, 5\]"),
        ("seqused-room-packed", dict(out_partial=op[:, 0], lse_partial=lp[:, 0], cu_seqlens=cu,
                                     seqused=torch.tensor([3, 3], dtype=torch.int32)),
         ValueError, r"seqused\[0\] = 3 is outside \[0, 2\]"),
        ("virtual-batch", dict(out_partial=op, lse_partial=lp,
                               virtual_batch_idx=torch.zeros(2, dtype=torch.int32)),
         NotImplementedError, "virtual_batch_idx"),
    ]  # fmt: skip


@pytest.mark.parametrize("kwargs, error, match", [pytest.param(*c[1:], id=c[0])
                                                  for c in _bad_cases()])  # fmt: skip
def test_combine_rejects_bad_input(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        cute_fa.flash_attn_combine(**kwargs)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"arch": 90}, "sm90"),
        ({"head_dim": 12}, "multiple of 8"),
        ({"head_dim": 520}, "up to 512"),
        ({"varlen": True}, "varlen only matters with seqused"),
    ],
)
def test_combine_can_implement_rejects(changes: dict, needle: str) -> None:
    values = dict(arch=80, target="sm_90a", dtype_partial="fp32", dtype="bf16", head_dim=128)
    values.update(changes)
    ok, reason = combine_can_implement(CombineConfig(**values))
    assert not ok and needle in reason, reason


def test_combine_config_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="dtype_partial"):
        CombineConfig(arch=80, target="sm_80", dtype_partial="fp8", dtype="bf16", head_dim=64)


def _compile_and_read(config: CombineConfig) -> tuple[dict, str]:
    import cutlass.cute as cute
    from cute_fa.ampere.flash_combine import FlashAttentionCombine

    kernel = FlashAttentionCombine(config)
    with tempfile.TemporaryDirectory(prefix="cute-fa-combine-") as d:
        compiled = cute.compile(
            kernel, *FlashAttentionCombine.fake_args(config),
            options=f"--gpu-arch {config.target} --keep-cubin --dump-dir {d}",
        )  # fmt: skip
        cubin = compiled.__cubin__
        path = Path(d) / "combine.cubin"
        path.write_bytes(cubin if isinstance(cubin, bytes) else cubin.encode("latin-1"))
        (usage,) = resource_usage(path).values()
        return usage, disassemble(path)


COMBINE_CASES = [
    pytest.param("sm_80", "fp32", "bf16", 128, True, False, False, id="sm80-fp32-bf16-d128"),
    pytest.param("sm_90a", "fp32", "fp16", 64, True, False, True, id="sm90-d64-seqused"),
    pytest.param("sm_90a", "fp32", "bf16", 256, True, True, True, id="sm90-d256-varlen-seqused"),
    pytest.param("sm_90a", "bf16", "fp32", 96, False, False, False, id="sm90-bf16-fp32-d96-nolse"),
    pytest.param("sm_100a", "fp32", "bf16", 192, True, False, False, id="sm100-d192"),
]


@pytest.mark.compile
@pytest.mark.parametrize("target, dtype_partial, dtype, d, has_lse, varlen, seqused",
                         COMBINE_CASES)  # fmt: skip
def test_combine_compiles(target, dtype_partial, dtype, d, has_lse, varlen, seqused) -> None:
    """The combine kernel cross-compiles; its SASS loads the partial rows in 16-byte (fp32) or
    8-byte (16-bit) vectors, stores 4 elements a vector, uses MUFU.EX2 and MUFU.LG2, and
    neither spills nor uses a stack."""
    config = CombineConfig(arch=80, target=target, dtype_partial=dtype_partial, dtype=dtype,
                           head_dim=d, has_lse=has_lse, varlen=varlen, seqused=seqused)  # fmt: skip
    usage, sass = _compile_and_read(config)
    counts = count_opcodes(sass)
    assert usage["stack"] == 0 and usage["local"] == 0, usage
    assert counts["LDL"] + counts["STL"] == 0
    load = "LDG.E.128" if dtype_partial == "fp32" else "LDG.E.64"
    store = "STG.E.128" if dtype == "fp32" else "STG.E.64"
    assert load in sass and store in sass
    assert "MUFU.EX2" in sass and "MUFU.LG2" in sass
    assert usage["regs"] <= 128, usage


def test_used_rows_mask_matches_the_kernels_rule() -> None:
    """The rows a zero-split combine writes (done with torch ops, no launch): row m of batch b
    below seqused[b]; packed, row m of the last sequence starting at or before it."""
    from cute_fa.combine import _used_rows

    out = torch.empty(2, 5, 3, 8)
    used = torch.tensor([4, 0], dtype=torch.int32)
    mask = _used_rows(out, False, None, used).expand(out.shape)
    for b in range(2):
        for m in range(5):
            assert bool(mask[b, m].all()) == (m < used[b]) and bool(mask[b, m].any()) == (
                m < used[b]
            )
    cu = torch.tensor([0, 2, 2, 5, 7], dtype=torch.int32)
    used = torch.tensor([1, 0, 3, 0], dtype=torch.int32)
    lse = torch.empty(3, 7).transpose(0, 1)  # (total, nheads)
    mask = _used_rows(lse, True, cu, used).expand(lse.shape)
    want = [True, False, True, True, True, False, False]
    assert mask[:, 0].tolist() == want and mask.all(1).tolist() == want
    assert _used_rows(out, False, None, None).all()


# --------------------------------------------------------------------------------------------
# The combine's first-use self-check (it has not run on a GPU yet) and its torch fallback


def _combine_config(**changes):
    from cute_fa.ampere.support import CombineConfig

    values = dict(arch=80, target="sm_90a", dtype_partial="fp32", dtype="bf16", head_dim=64)
    return CombineConfig(**(values | changes))


@pytest.mark.parametrize("flags", [{}, {"seqused": True}, {"varlen": True, "seqused": True},
                                   {"has_lse": False, "dtype": "fp32"}],
                         ids=lambda f: "+".join(f) or "plain")  # fmt: skip
def test_combine_check_passes_the_torch_combine_and_fails_wrong_ones(flags) -> None:
    from cute_fa import combine as combine_mod
    from cute_fa.combine import torch_combine

    config = _combine_config(**flags)
    cpu = torch.device("cpu")
    assert combine_mod.run_check(torch_combine, config, cpu) == (True, "")

    def scaled(part, lse_part, out, lse, cu, used):  # a 1 % error in the weights
        torch_combine(part * 1.01, lse_part, out, lse, cu, used)

    ok, error = combine_mod.run_check(scaled, config, cpu)
    assert not ok and error.startswith("AssertionError")
    if config.seqused:

        def writes_everything(part, lse_part, out, lse, cu, used):  # ignores seqused
            torch_combine(part, lse_part, out, lse, None, None)

        ok, error = combine_mod.run_check(writes_everything, config, cpu)
        assert not ok, "rows past seqused must keep their values"


def test_a_combine_kernel_that_fails_is_replaced_by_the_torch_combine(monkeypatch, tmp_path):
    from cute_fa import combine, selftest, settings

    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(settings.SELFTEST, raising=False)
    monkeypatch.setattr(combine, "capability", lambda _: (9, 0))
    monkeypatch.setattr(selftest, "gpu_name", lambda _: "Fake H200")
    selftest.forget_loaded()

    def wrong(part, lse_part, out, lse, cu, used):
        out.fill_(0.5)

    class Cache:
        def get(self, config):
            return wrong

    monkeypatch.setattr(combine, "combine_cache", Cache)
    cpu = torch.device("cpu")
    with pytest.warns(RuntimeWarning, match="combine.*failed its first-use self-check.*torch"):
        chosen = combine.combine_kernel(cpu, torch.float32, torch.bfloat16, 64, True, False, False)
    assert chosen is combine.torch_combine
    monkeypatch.setenv(settings.SELFTEST, "0")  # off: the kernel itself, unchecked
    args = (cpu, torch.float32, torch.bfloat16, 64, True, False, False)
    assert combine.combine_kernel(*args) is wrong
    selftest.forget_loaded()
