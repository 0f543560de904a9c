"""Split-KV forward (``num_splits``) on a GPU against the fp32 reference (marker ``gpu``).

Each call must run the split kernel (the launch plan it made says how many splits): the sm90
forward on an sm90 GPU, the sm80 forward elsewhere or under CUTE_FA_FWD_ARCH=80 (run the file
both ways on an H200; rounded head dims and (128, 64) run the sm80 forward). Results are checked as
tests/test_fwd_gpu.py checks the unsplit forward (``check_close``: twice the baseline's error
plus a few ulps; rows that see no key exactly 0 / -inf; no NaN in outputs allocated in
NaN-poisoned memory), and the backward of a split forward against the reference's gradients.
Cases: num_splits 2, 3, 7, causal or not, GQA, seqlen_q 1 (decode) and longer, key lengths
that are not multiples of the key tile, more splits than key blocks (empty splits), packed
sequences with seqused, and the heuristic (num_splits=0) on a decode shape.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import (  # noqa: F401
    check_fwd,
    check_grads,
    cu_seqlens,
    needs_sm90_forward,
    poison_free_memory,
    randn_cuda,
    run_planned,
    seed,
    sm90_forward_here,
)

import cute_fa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(fn, *args, expect_splits: int | None, **kwargs):
    """Call ``fn`` with a fresh plan table; check the plan's split count (None: any > 1)."""
    result, plan = run_planned(fn, *args, **kwargs)
    got = plan.num_splits
    if expect_splits is None:
        assert got > 1, f"the call ran {got} split(s)"
    else:
        assert got == expect_splits, f"the call ran {got} split(s), expected {expect_splits}"
    return result


def _check_fwd(out, lse, q, k, v, causal) -> None:
    check_fwd(out, lse, q, k, v, (None, 0) if causal else (None, None))


def _reserve(b, sq, h, dv, splits) -> int:
    return 2 * (splits + 1) * b * sq * h * (dv + 1) * 4 + (16 << 20)


# (seqlen_q, seqlen_k): decode rows, a query block and a half, key lengths off the 128-key tile
# (and off 64 / 112 of d 256 / d 192), one key block only (every split but the first empty).
SEQLENS = [(1, 4224), (1, 1000), (3, 517), (200, 1211), (129, 2049), (1, 100), (77, 77)]


@pytest.mark.parametrize("seqlen_q, seqlen_k", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("h_kv", [6, 2, 1], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_fwd(num_splits, causal, h_kv, seqlen_q, seqlen_k):
    b, h, d = 2, 6, 128
    q = randn_cuda(b, seqlen_q, h, d)
    k, v = randn_cuda(b, seqlen_k, h_kv, d), randn_cuda(b, seqlen_k, h_kv, d)
    poison_free_memory(_reserve(b, seqlen_q, h, d, num_splits))
    out, lse = _run(cute_fa.flash_attn_func, q, k, v, causal=causal, num_splits=num_splits,
                    return_lse=True, expect_splits=num_splits)  # fmt: skip
    _check_fwd(out, lse, q, k, v, causal)


@pytest.mark.parametrize("d, dv", [(64, 64), (96, 96), (192, 128), (256, 256), (40, 40), (80, 80),
                                   (128, 64)])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_fwd_head_dims(d, dv, causal):
    """Every tile shape (d 64: 192 query rows, three consumers; d 192: 112 keys; d 256: 64;
    rounded head dims and (128, 64): the sm80 forward, its fp32 partials of dv columns)."""
    b, sq, sk, h = 2, 250, 1500, 4
    q, k, v = randn_cuda(b, sq, h, d), randn_cuda(b, sk, 2, d), randn_cuda(b, sk, 2, dv)
    out, lse = _run(cute_fa.flash_attn_func, q, k, v, causal=causal, num_splits=3,
                    return_lse=True, expect_splits=3)  # fmt: skip
    _check_fwd(out, lse, q, k, v, causal)


def test_split_fwd_more_splits_than_key_blocks():
    """300 keys are three blocks of 128: splits 3..15 see no key and write O = 0, LSE = -inf,
    which the combine must weigh 0; with causal and seqlen_q > seqlen_k some rows see nothing."""
    b, h, d = 2, 4, 128
    for sq, causal in ((1, False), (400, True)):
        q, k, v = randn_cuda(b, sq, h, d), randn_cuda(b, 300, 2, d), randn_cuda(b, 300, 2, d)
        poison_free_memory(_reserve(b, sq, h, d, 16))
        out, lse = _run(cute_fa.flash_attn_func, q, k, v, causal=causal, num_splits=16,
                        return_lse=True, expect_splits=16)  # fmt: skip
        _check_fwd(out, lse, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_fwd_varlen(num_splits, causal):
    """Packed queries and keys (decode-like and longer sequences, an empty one) with seqused_k;
    rows past seqused_q must come back 0 / -inf."""
    lens_q, lens_k = [1, 130, 0, 7, 1], [900, 300, 50, 1111, 2]
    used_q, used_k = [1, 100, 0, 7, 1], [900, 257, 50, 1000, 2]
    h, h_kv, d = 4, 2, 128
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn_cuda(sum(lens_q), h, d)
    k, v = randn_cuda(sum(lens_k), h_kv, d), randn_cuda(sum(lens_k), h_kv, d)
    sq_used = torch.tensor(used_q, dtype=torch.int32, device="cuda")
    sk_used = torch.tensor(used_k, dtype=torch.int32, device="cuda")
    poison_free_memory(_reserve(1, sum(lens_q), h, d, num_splits))
    out, lse = _run(
        cute_fa.flash_attn_varlen_func, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max(lens_q), seqused_q=sq_used, seqused_k=sk_used, causal=causal,
        num_splits=num_splits, return_lse=True, expect_splits=num_splits,
    )  # fmt: skip
    assert out.shape == (sum(lens_q), h, d) and lse.shape == (h, sum(lens_q))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lens_q)):
        q0, k0 = starts_q[i], starts_k[i]
        rows = slice(q0, q0 + used_q[i])
        past = slice(q0 + used_q[i], q0 + lens_q[i])
        assert (out[past] == 0).all() and torch.isneginf(lse[:, past]).all()
        if used_q[i] == 0:
            continue
        qi = q[rows].unsqueeze(0)
        ki, vi = (t[k0 : k0 + used_k[i]].unsqueeze(0) for t in (k, v))
        _check_fwd(out[rows].unsqueeze(0), lse[:, rows].unsqueeze(0), qi, ki, vi, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 150])
def test_split_fwd_backward(seqlen_q, causal):
    """The backward of a split forward (the usual backward on the combined out and LSE)."""
    b, sk, h, h_kv, d = 2, 1500, 4, 2, 128
    q, k, v = randn_cuda(b, seqlen_q, h, d), randn_cuda(b, sk, h_kv, d), randn_cuda(b, sk, h_kv, d)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _run(cute_fa.flash_attn_func, *leaves, causal=causal, num_splits=3,
                    return_lse=True, expect_splits=3)  # fmt: skip
    _check_fwd(out.detach(), lse.detach(), q, k, v, causal)
    dout = randn_cuda(*out.shape)
    check_grads(torch.autograd.grad(out, leaves, dout), q, k, v, dout, causal)


@needs_sm90_forward
def test_split_heuristic_on_a_decode_shape():
    """num_splits=0 (and None) splits a decode step of few heads over a long key range (the
    tiles fill a fraction of the SMs) and not a prefill of many tiles."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = randn_cuda(1, 1, 4, 128), randn_cuda(1, 8192, 1, 128), randn_cuda(1, 8192, 1, 128)
    want = min(sms // 4, 64 // 4, 128)
    for value in (0, None):
        out, lse = _run(cute_fa.flash_attn_func, q, k, v, num_splits=value, return_lse=True,
                        expect_splits=want)  # fmt: skip
        _check_fwd(out, lse, q, k, v, False)
    q = randn_cuda(4, 2048, 16, 128)
    _run(cute_fa.flash_attn_func, q, k.expand(4, -1, -1, -1), v.expand(4, -1, -1, -1),
         num_splits=0, expect_splits=1)  # fmt: skip


def test_split_matches_the_unsplit_forward_closely():
    """Same attention: out within a few bf16 ulps of the unsplit kernel's, LSE within 1e-4
    (another summation order and P rounded against another max: not bitwise)."""
    q, k, v = randn_cuda(2, 64, 8, 128), randn_cuda(2, 3000, 8, 128), randn_cuda(2, 3000, 8, 128)
    out1, lse1 = cute_fa.flash_attn_func(q, k, v, return_lse=True)
    out7, lse7 = cute_fa.flash_attn_func(q, k, v, num_splits=7, return_lse=True)
    torch.testing.assert_close(lse7, lse1, rtol=0, atol=1e-4)
    ulp = 2.0**-7 * out1.float().abs().clamp_min(2.0**-6)
    assert ((out7.float() - out1.float()).abs() <= 4 * ulp).all()
