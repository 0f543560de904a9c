"""``get_scheduler_metadata`` on a GPU (marker ``gpu``; Note [scheduler metadata] in
cute_fa/scheduler.py): a varlen decode step (one query row a sequence, a cache with seqused_k,
num_splits=0) gives bitwise the same out and LSE with and without the metadata, dense or paged
cache, eager and replayed from a CUDA graph captured with the metadata. On an sm90 GPU the
calls split (the heuristic's count) and pack their query heads; elsewhere they run one split,
unpacked, and the results must match all the same. tests/test_scheduler_metadata.py checks
the planning on the CPU."""

from __future__ import annotations

import os

import pytest
import torch
from gpu_support import cu_seqlens, graph_capture, seed  # noqa: F401

import cute_fa
from cute_fa import ops, settings
from cute_fa.reference import attention_ref, check_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, H, HK, D = 6, 16, 2, 128
SK = 8192  # the cache's room: 64 key blocks


def _sm90() -> bool:
    """Whether dispatch reaches the sm90 forward (split-KV, pack_gqa, paged K/V)."""
    forced = os.environ.get(settings.FWD_ARCH)
    return torch.cuda.get_device_capability() == (9, 0) and forced in (None, "", "90")


needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or not _sm90(),
    reason="paged K/V runs on the sm90 forward (an sm90 GPU without CUTE_FA_FWD_ARCH=80)",
)


def _randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


def _decode(paged: bool, page_size: int = 64):
    """(q, k, v, cu_seqlens_q, seqused_k, page_table): one query row a sequence, cache lengths
    from 1 to SK (the first full), a dense (B, SK, HK, D) cache or pages of ``page_size`` keys
    in shuffled order."""
    q = _randn(B, H, D)
    cu_q = cu_seqlens([1] * B)
    lens = torch.randint(1, SK + 1, (B,)).tolist()
    lens[0] = SK
    used_k = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if not paged:
        k, v = _randn(B, SK, HK, D), _randn(B, SK, HK, D)
        return q, k, v, cu_q, used_k, None
    pages = SK // page_size
    k, v = _randn(B * pages, page_size, HK, D), _randn(B * pages, page_size, HK, D)
    table = torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)
    return q, k, v, cu_q, used_k, table


def _metadata(cu_q, used_k, max_seqlen_k=SK, **kwargs):
    return cute_fa.get_scheduler_metadata(
        1, max_seqlen_k, H, HK, D, num_splits=0, cu_seqlens_q=cu_q, seqused_k=used_k, **kwargs
    )


def _call(q, k, v, cu_q, used_k, table, **kwargs):
    return cute_fa.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, page_table=table, return_lse=True,
        **{"num_splits": 0, **kwargs},
    )  # fmt: skip


def _plan():
    (plan,) = ops._plans.values()
    return plan


def _check_against_reference(out, lse, q, k, v, used_k, table) -> None:
    """Sequence b's row against the reference over its first used_k[b] keys."""
    for b, n in enumerate(used_k.tolist()):
        if table is None:
            kb, vb = k[b, :n], v[b, :n]
        else:
            rows = table[b].long()
            kb, vb = (t[rows].flatten(0, 1)[:n] for t in (k, v))
        qb = q[b : b + 1].unsqueeze(0)
        out_ref, lse_ref = attention_ref(qb, kb[None], vb[None], upcast=True)
        out_pt, lse_pt = attention_ref(qb, kb[None], vb[None], upcast=False, reorder_ops=True)
        check_close(out[b : b + 1][None], out_ref, out_pt, name=f"out[{b}]")
        check_close(lse[:, b : b + 1][None], lse_ref, lse_pt, atol=1e-4, name=f"lse[{b}]")


@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=needs_sm90)],
                         ids=["dense", "paged"])  # fmt: skip
def test_bitwise_equal_with_and_without_metadata(paged):
    q, k, v, cu_q, used_k, table = _decode(paged)
    ops.clear_plans()
    out, lse = _call(q, k, v, cu_q, used_k, table, max_seqlen_q=1)
    without = _plan()
    md = _metadata(cu_q, used_k)
    ops.clear_plans()
    for _ in range(2):  # the call that plans, then one that reuses the plan
        out_md, lse_md = _call(q, k, v, cu_q, used_k, table, scheduler_metadata=md)
        assert torch.equal(out_md, out) and torch.equal(lse_md, lse)
    with_md = _plan()
    assert with_md.kernel is without.kernel
    assert with_md.num_splits == without.num_splits == md.num_splits
    assert with_md.pack_gqa == without.pack_gqa == (H // HK if md.pack_gqa else 0)
    if _sm90():  # the heuristic splits a decode step of 12 packed tiles over 64 key blocks
        assert md.num_splits > 1 and md.pack_gqa
    _check_against_reference(out_md, lse_md, q, k, v, used_k, table)


def test_a_shorter_max_seqlen_k_matches_its_explicit_split_count():
    """max_seqlen_k below the cache's room: md's split count (from max_seqlen_k) and packing,
    given explicitly, give bitwise the same results."""
    q, k, v, cu_q, used_k, _ = _decode(False)
    used_k.clamp_(max=1000)
    md = _metadata(cu_q, used_k, max_seqlen_k=1000)
    out_md, lse_md = _call(q, k, v, cu_q, used_k, None, scheduler_metadata=md)
    out, lse = _call(q, k, v, cu_q, used_k, None, max_seqlen_q=1, num_splits=md.num_splits,
                     pack_gqa=md.pack_gqa)  # fmt: skip
    assert torch.equal(out_md, out) and torch.equal(lse_md, lse)
    _check_against_reference(out_md, lse_md, q, k, v, used_k, None)


@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=needs_sm90)],
                         ids=["dense", "paged"])  # fmt: skip
def test_cuda_graph_capture_with_metadata(paged):
    """A decode step captured with the metadata and max_seqlen_q (no host read, no value
    checks during capture); replays with new queries, caches and cache lengths equal the eager
    calls with and without the metadata bitwise."""
    q, k, v, cu_q, used_k, table = _decode(paged)
    md = _metadata(cu_q, used_k)

    def step():
        return _call(q, k, v, cu_q, used_k, table, max_seqlen_q=1, scheduler_metadata=md)

    graph, (out_g, lse_g) = graph_capture(step)
    for _ in range(3):
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
            used_k.copy_(torch.randint(1, SK + 1, (B,), device="cuda", dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        out_md, lse_md = _call(q, k, v, cu_q, used_k, table, scheduler_metadata=md)
        out, lse = _call(q, k, v, cu_q, used_k, table, max_seqlen_q=1)
        for a, name in ((out_g, "out"), (lse_g, "lse")):
            want = out_md if name == "out" else lse_md
            assert torch.equal(a, want), f"{name}: graph replay differs from the eager call"
        assert torch.equal(out, out_md) and torch.equal(lse, lse_md)
    _check_against_reference(out_g, lse_g, q, k, v, used_k, table)
