"""Paged K/V (``page_table``) on a GPU against the fp32 reference (marker ``gpu``).

The cache is a pool of pages (num_pages, page_size, nheads_kv, d) in shuffled order with pages
no sequence uses; each sequence's row of the page table lists its pages, entries past the pages
it uses are -1 (never read), the rows of its last page past its length and every unused page
are NaN (not inputs: NaN must not reach any output). The reference gathers each sequence's
pages on the host. Cases: page sizes 1, 4, 8, 12, 16, 48, 64, 128, 256 (one, several and
fractions of a key block; on an sm90 GPU the sizes its TMA boxes do not take run the sm80
forward's row gather), cache lengths off every tile and page, empty caches, 1-8 query rows and
prefills, dense and packed queries, causal / window / softcap, GQA with and without pack_gqa,
split-KV, tables without seqused_k (every listed page full), and the errors: pages out of
range, a backward. Run the file again under CUTE_FA_FWD_ARCH=80 for the sm80 forward alone.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import (  # noqa: F401
    cu_seqlens,
    paged_cache,
    randn_cuda,
    run_planned,
    seed,
    sm90_forward_here,
)

import cute_fa
from cute_fa.reference import attention_ref, check_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LSE_ATOL = 1e-4  # as tests/test_fwd_gpu.py


def _run(fn, *args, expect_splits: int = 1, **kwargs):
    """Call ``fn`` (no grad) with a fresh plan table; check the plan's split count."""
    with torch.no_grad():
        result, plan = run_planned(fn, *args, **kwargs)
    assert plan.num_splits == expect_splits
    return result


def _check_rows(out, lse, q, k, v, causal, window, softcap) -> None:
    """out (sq, h, dv), lse (h, sq) of one sequence against the reference over its keys."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if k.shape[0] == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()
        return
    if causal:
        window = (None, 0)
    kw = dict(window_size=window, softcap=softcap)
    qb, kb, vb = q[None], k[None], v[None]
    out_ref, lse_ref = attention_ref(qb, kb, vb, upcast=True, **kw)
    out_pt, lse_pt = attention_ref(qb, kb, vb, upcast=False, reorder_ops=True, **kw)
    check_close(out[None], out_ref, out_pt, name="out")
    check_close(lse[None], lse_ref, lse_pt, atol=LSE_ATOL, name="lse")


LENS_K = [300, 1, 0, 1000, 128, 257]
MASKS = [(False, (None, None)), (True, (None, None)), (False, (100, 30))]


@pytest.mark.parametrize("page_size", [1, 4, 8, 12, 16, 48, 64, 128, 256])
@pytest.mark.parametrize("causal, window", MASKS, ids=["full", "causal", "win100_30"])
@pytest.mark.parametrize("seqlen_q", [1, 4, 77])
def test_paged_fwd(seqlen_q, causal, window, page_size):
    """Dense queries over a paged cache with seqused_k as the cache lengths."""
    h, h_kv, d = 8, 2, 128
    b = len(LENS_K)
    k_pages, v_pages, table, ks, vs = paged_cache(LENS_K, page_size, h_kv, d, d)
    q = randn_cuda(b, seqlen_q, h, d)
    used = torch.tensor(LENS_K, dtype=torch.int32, device="cuda")
    out, lse = _run(cute_fa.flash_attn_varlen_func, q, k_pages, v_pages, seqused_k=used,
                    page_table=table, causal=causal, window_size=window,
                    return_lse=True)  # fmt: skip
    for i in range(b):
        _check_rows(out[i], lse[i], q[i], ks[i], vs[i], causal, window, 0.0)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_fwd_varlen_q_softcap_split(page_size, pack_gqa, num_splits):
    """Packed queries (decode rows and a prefill) with softcap, GQA packed or not, split."""
    lens_q, lens_k = [1, 8, 0, 130, 4, 1], [2000, 33, 100, 500, 0, 4096]
    h, h_kv, d = 16, 4, 128
    k_pages, v_pages, table, ks, vs = paged_cache(lens_k, page_size, h_kv, d, d)
    cu_q = cu_seqlens(lens_q)
    q = randn_cuda(sum(lens_q), h, d)
    used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    out, lse = _run(
        cute_fa.flash_attn_varlen_func, q, k_pages, v_pages, cu_seqlens_q=cu_q,
        max_seqlen_q=max(lens_q), seqused_k=used, page_table=table, causal=True, softcap=15.0,
        num_splits=num_splits, pack_gqa=pack_gqa, return_lse=True,
        expect_splits=num_splits,
    )  # fmt: skip
    starts = cu_q.tolist()
    for i, n in enumerate(lens_q):
        rows = slice(starts[i], starts[i] + n)
        if n:
            _check_rows(out[rows], lse[:, rows], q[rows], ks[i], vs[i], True, (None, None), 15.0)


@pytest.mark.parametrize("d, dv", [(64, 64), (96, 96), (192, 128), (256, 256), (40, 40),
                                   (128, 64)])  # fmt: skip
def test_paged_fwd_head_dims(d, dv):
    """Every tile shape (sm90: d 192: 112 keys a block, boxes of gcd(page, 112); d 256: 64;
    d 96 and (192, 128) with pages of 8: the sm80 forward's row gather; a rounded head dim and
    (128, 64): the sm80 forward)."""
    lens_k = [700, 65, 1]
    for page_size in (8, 16, 64):
        k_pages, v_pages, table, ks, vs = paged_cache(lens_k, page_size, 2, d, dv)
        q = randn_cuda(3, 5, 4, d)
        used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
        out, lse = _run(cute_fa.flash_attn_varlen_func, q, k_pages, v_pages, seqused_k=used,
                        page_table=table, causal=True, return_lse=True)  # fmt: skip
        for i in range(3):
            _check_rows(out[i], lse[i], q[i], ks[i], vs[i], True, (None, None), 0.0)


def test_paged_fwd_without_seqused_k():
    """No seqused_k: every page listed in a row holds keys (all rows full)."""
    page_size, pages, h_kv, d = 64, 5, 2, 128
    lens_k = [page_size * pages] * 2
    k_pages, v_pages, table, ks, vs = paged_cache(lens_k, page_size, h_kv, d, d)
    q = randn_cuda(2, 3, 8, d)
    out, lse = _run(cute_fa.flash_attn_varlen_func, q, k_pages, v_pages, page_table=table,
                    return_lse=True)  # fmt: skip
    for i in range(2):
        _check_rows(out[i], lse[i], q[i], ks[i], vs[i], False, (None, None), 0.0)


def test_paged_matches_the_contiguous_cache():
    """The same keys paged (page 128 = the key block) and contiguous: the same result."""
    b, sk, h, h_kv, d = 3, 1000, 8, 2, 128
    q, k, v = randn_cuda(b, 2, h, d), randn_cuda(b, sk, h_kv, d), randn_cuda(b, sk, h_kv, d)
    pages = -(-sk // 128)
    table = torch.randperm(b * pages, device="cuda").to(torch.int32).reshape(b, pages)
    pad = pages * 128 - sk
    kp, vp = (torch.cat([x, torch.zeros(b, pad, h_kv, d, dtype=x.dtype, device="cuda")], 1)
              for x in (k, v))  # fmt: skip
    k_pages = torch.empty(b * pages, 128, h_kv, d, dtype=k.dtype, device="cuda")
    v_pages = torch.empty_like(k_pages)
    k_pages[table.reshape(-1).long()] = kp.reshape(-1, 128, h_kv, d)
    v_pages[table.reshape(-1).long()] = vp.reshape(-1, 128, h_kv, d)
    used = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    paged = _run(cute_fa.flash_attn_varlen_func, q, k_pages, v_pages, seqused_k=used,
                 page_table=table, causal=True, return_lse=True)  # fmt: skip
    contiguous = _run(cute_fa.flash_attn_varlen_func, q, k, v, seqused_k=used, causal=True,
                      return_lse=True)  # fmt: skip
    torch.testing.assert_close(paged[0], contiguous[0], atol=0, rtol=0)
    torch.testing.assert_close(paged[1], contiguous[1], atol=0, rtol=0)


def test_pages_out_of_range_are_an_error():
    k_pages, v_pages, table, _, _ = paged_cache([40, 90], 16, 2, 128, 128)
    q = randn_cuda(2, 1, 8, 128)
    used = torch.tensor([40, 90], dtype=torch.int32, device="cuda")
    bad = table.clone()
    bad[1, 2] = k_pages.shape[0]
    with pytest.raises(ValueError, match=r"page_table has 1 used entries outside"):
        cute_fa.flash_attn_varlen_func(q, k_pages, v_pages, seqused_k=used, page_table=bad)
    bad = table.clone()
    bad[0, 3] = 10**6  # past sequence 0's 3 pages (40 keys): never read, not checked
    bad[0, 4:] = -7
    cute_fa.flash_attn_varlen_func(q, k_pages, v_pages, seqused_k=used, page_table=bad)


def test_paged_kv_has_no_backward():
    k_pages, v_pages, table, _, _ = paged_cache([40, 9], 16, 2, 128, 128)
    q = randn_cuda(2, 1, 8, 128).requires_grad_()
    with pytest.raises(NotImplementedError, match="forward-only"):
        cute_fa.flash_attn_varlen_func(q, k_pages, v_pages, page_table=table)
