"""``flash_attn_combine`` on a GPU against a torch reference in fp64 (marker ``gpu``).

The reference: lse = logsumexp_s(lse_s) and out = sum_s exp(lse_s - lse) out_s, with splits of
lse_s = -inf weighing 0 and rows whose splits are all -inf giving out 0, lse -inf. The partial
outputs of splits with lse_s = -inf are NaN here, so a kernel that reads them (and multiplies
by a zero weight) fails; outputs the API allocates land in memory filled with NaN first
(``poison_free_memory``), so unwritten elements fail too.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import cu_seqlens, poison_free_memory, seed  # noqa: F401

import cute_fa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _partials(shape_rows, num_splits: int, d: int, dtype, empty_frac: float = 0.3):
    """out_partial (S, *rows, d) and lse_partial (S, *rows): LSEs spread over ~40 nats, a
    fraction of (split, row) pairs empty (-inf, their out NaN), and the first row's splits all
    empty."""
    out_p = torch.randn(num_splits, *shape_rows, d, device="cuda").to(dtype)
    lse_p = torch.randn(num_splits, *shape_rows, device="cuda") * 10
    empty = torch.rand(num_splits, *shape_rows, device="cuda") < empty_frac
    if lse_p.numel():
        empty.view(num_splits, -1)[:, 0] = True
    lse_p[empty] = float("-inf")
    out_p[empty] = float("nan")
    return out_p, lse_p


def _reference(out_p, lse_p):
    """(out, lse) in fp64; rows are every dim but the first (splits) and, for out, the last."""
    lse64 = lse_p.double()
    lse = torch.logsumexp(lse64, dim=0)
    weight = torch.exp(lse64 - lse)  # -inf - -inf = NaN where every split is empty
    weight = torch.where(torch.isneginf(lse64), torch.zeros_like(weight), weight)
    terms = weight.unsqueeze(-1) * torch.nan_to_num(out_p.double(), nan=0.0)
    terms = torch.where(weight.unsqueeze(-1) == 0, torch.zeros_like(terms), terms)
    return terms.sum(0), lse


def _check(out, lse, out_ref, lse_ref, dtype) -> None:
    assert not torch.isnan(out).any(), "NaN in out (unwritten, or an empty split was read)"
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), out_ref, rtol=1e-5, atol=1e-5)
    else:  # the fp64 result rounded once to 16 bits, plus the fp32 arithmetic before
        torch.testing.assert_close(out.double(), out_ref.to(dtype).double(), rtol=2e-2, atol=2e-2)
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        err = (out.double() - out_ref).abs()
        assert (err <= ulp * out_ref.abs().clamp_min(2.0**-6) + 1e-6).all(), err.max()
    if lse is not None:
        assert not torch.isnan(lse).any()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
        finite = torch.isfinite(lse_ref)
        torch.testing.assert_close(lse.double()[finite], lse_ref[finite], rtol=1e-6, atol=1e-5)
        assert (out[torch.isneginf(lse)] == 0).all(), "rows without keys must be exactly 0"


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])  # fmt: skip
def test_combine_batched(num_splits, d, out_dtype):
    b, sq, h = 2, 37, 5
    out_p, lse_p = _partials((b, sq, h), num_splits, d, torch.float32)
    poison_free_memory(8 * b * sq * h * d + (16 << 20))
    out, lse = cute_fa.flash_attn_combine(out_p, lse_p, out_dtype=out_dtype)
    assert out.shape == (b, sq, h, d) and out.dtype == (out_dtype or torch.float32)
    assert lse.shape == (b, sq, h) and lse.transpose(-1, -2).is_contiguous()
    _check(out, lse, *_reference(out_p, lse_p), out.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_combine_16bit_partials(dtype):
    out_p, lse_p = _partials((3, 19, 4), 5, 128, dtype)
    out, lse = cute_fa.flash_attn_combine(out_p, lse_p, out_dtype=torch.float32)
    _check(out, lse, *_reference(out_p, lse_p), torch.float32)


def test_combine_into_out_without_lse_and_strided_lse_partial():
    """``out`` given (written and returned), return_lse=False, and lse_partial as the split
    forward keeps it: (S, b, h, sq) storage viewed (S, b, sq, h)."""
    s, b, sq, h, d = 4, 2, 33, 3, 64
    out_p, lse_store = _partials((b, h, sq), s, d, torch.float32)
    out_p = out_p.transpose(2, 3).contiguous()  # (S, b, sq, h, d)
    lse_p = lse_store.transpose(-1, -2)
    out = torch.full((b, sq, h, d), 7.0, device="cuda", dtype=torch.bfloat16)
    got, lse = cute_fa.flash_attn_combine(out_p, lse_p, out=out, return_lse=False)
    assert got is out and lse is None
    _check(out, None, *_reference(out_p, lse_p), torch.bfloat16)


def test_combine_zero_splits_and_empty_rows():
    out_p = torch.empty(0, 2, 3, 4, 64, device="cuda")
    lse_p = torch.empty(0, 2, 3, 4, device="cuda")
    out, lse = cute_fa.flash_attn_combine(out_p, lse_p)
    assert (out == 0).all() and torch.isneginf(lse).all()
    given = torch.full((2, 3, 4, 64), 7.0, device="cuda")
    used = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    cute_fa.flash_attn_combine(out_p, lse_p, out=given, seqused=used)
    assert (given[0, :2] == 0).all() and (given[0, 2:] == 7).all() and (given[1] == 7).all()
    out, lse = cute_fa.flash_attn_combine(torch.empty(2, 2, 0, 4, 64, device="cuda"),
                                          torch.empty(2, 2, 0, 4, device="cuda"))  # fmt: skip
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 0, 4)


def test_combine_seqused_batched():
    """Rows past seqused are not touched: a given out keeps its values, an allocated one is 0
    with LSE -inf."""
    s, b, sq, h, d = 3, 3, 40, 2, 128
    out_p, lse_p = _partials((b, sq, h), s, d, torch.float32)
    used = torch.tensor([40, 0, 17], dtype=torch.int32, device="cuda")
    out_ref, lse_ref = _reference(out_p, lse_p)
    keep = torch.arange(sq, device="cuda")[None, :] < used[:, None].long()  # (b, sq)
    out, lse = cute_fa.flash_attn_combine(out_p, lse_p, seqused=used)
    _check(out[keep], lse[keep], out_ref[keep], lse_ref[keep], torch.float32)
    assert (out[~keep] == 0).all() and torch.isneginf(lse[~keep]).all()
    given = torch.full((b, sq, h, d), 7.0, device="cuda")
    cute_fa.flash_attn_combine(out_p, lse_p, out=given, seqused=used)
    assert (given[~keep] == 7.0).all()
    _check(given[keep], None, out_ref[keep], None, torch.float32)


@pytest.mark.parametrize("with_seqused", [False, True], ids=["cu", "cu-seqused"])
def test_combine_packed(with_seqused):
    lens = [5, 0, 70, 1, 33]
    total, s, h, d = sum(lens), 7, 4, 64
    cu = cu_seqlens(lens).cuda()
    out_p, lse_p = _partials((total, h), s, d, torch.float32)
    out_ref, lse_ref = _reference(out_p, lse_p)
    used = torch.tensor([3, 0, 70, 0, 20], dtype=torch.int32, device="cuda")
    out, lse = cute_fa.flash_attn_combine(
        out_p, lse_p, out_dtype=torch.bfloat16, cu_seqlens=cu,
        seqused=used if with_seqused else None,
    )  # fmt: skip
    assert out.shape == (total, h, d) and lse.shape == (total, h)
    keep = torch.ones(total, dtype=torch.bool, device="cuda")
    if with_seqused:
        starts = [sum(lens[:i]) for i in range(len(lens))]
        keep[:] = False
        for start, u in zip(starts, used.tolist(), strict=True):
            keep[start : start + u] = True
        assert (out[~keep] == 0).all() and torch.isneginf(lse[~keep]).all()
    _check(out[keep], lse[keep], out_ref[keep], lse_ref[keep], torch.bfloat16)
