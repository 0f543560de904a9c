"""Packed GQA (``pack_gqa``) on a GPU against the fp32 reference (marker ``gpu``).

Each call's launch plan must say whether it packed (``_Plan.pack_gqa``: the query heads per K/V
head of the packed kernel, 0 unpacked), and the kernel that ran must be the forward family of
this machine (``fwd_family_here``) with that packing in its compile key: the sm90 forward packs
where the heads per K/V head divide 64, the sm80 forward where they divide its tile_m (64 or
128); both take every group here but 3, 5, 6 and 7, which run unpacked with the same results.
Run the file on the H200 as is (the sm90 forward) and with ``CUTE_FA_FWD_ARCH=80`` (the sm80
forward); no test skips for either. Results are checked as tests/test_fwd_gpu.py checks the
unpacked forward (twice the baseline's error plus a few ulps, rows that see no key exactly 0 /
-inf, outputs in NaN-poisoned memory). Cases: group sizes 2, 4, 8, 16 and 64 (MQA), decode rows
(1-8) and prefill rows that are not multiples of the tile, causal / window / softcap, packed
sequences with seqused, split-KV on top, decode steps over dense and paged caches (pages of 16
and 1 keys) with seqused_k, split or not, the backward of a packed forward, and pack_gqa=None /
True / False agreeing.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import (  # noqa: F401
    check_fwd,
    check_grads,
    cu_seqlens,
    fwd_family_here,
    fwd_plan_configs,
    paged_cache,
    poison_free_memory,
    randn_cuda,
    run_planned,
    seed,
)

import cute_fa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# The sm100 forward packs too (compile-checked), but has no split-KV or paged K/V yet: these
# cases run the sm90 and sm80 forwards.
needs_sm80_or_sm90_forward = pytest.mark.skipif(
    torch.cuda.is_available() and fwd_family_here() not in (80, 90),
    reason="runs the sm90 or the sm80 forward (an sm100 GPU: CUTE_FA_FWD_ARCH=80)",
)


def _run(fn, *args, expect_pack: int, expect_splits: int = 1, **kwargs):
    """Call ``fn`` with a fresh plan table; check the plan's packing and split count."""
    result, plan = run_planned(fn, *args, **kwargs)
    assert plan.pack_gqa == expect_pack, f"packed {plan.pack_gqa}, want {expect_pack}"
    assert plan.num_splits == expect_splits
    (config,) = fwd_plan_configs()  # the kernel that ran: this machine's family, packed or not
    assert config.arch == fwd_family_here(), config.name
    assert config.pack_gqa == expect_pack and config.split_kv == (expect_splits > 1), config.name
    return result


def _check_fwd(out, lse, q, k, v, causal=False, window=(None, None), softcap=0.0) -> None:
    check_fwd(out, lse, q, k, v, (None, 0) if causal else window, softcap)


def _reserve(b, sq, h, dv) -> int:
    return 2 * b * sq * h * (dv + 1) * 4 + (16 << 20)


# (seqlen_q, seqlen_k): decode rows, a few rows, rows whose packed count is not a multiple of the
# tile, more query rows than keys (causal: rows that see nothing), key lengths off the tile.
SEQLENS = [(1, 4224), (1, 100), (4, 517), (8, 1000), (77, 77), (200, 1211), (300, 129), (1, 1)]
# (query heads, K/V heads): groups of 2, 4, 8, 16 and MQA with 64 heads a K/V head.
GROUPS = [(8, 4), (8, 2), (16, 2), (32, 2), (64, 1)]
MASKS = [(False, (None, None)), (True, (None, None)), (False, (64, 0)), (False, (100, 30))]
MASK_IDS = ["full", "causal", "win64_0", "win100_30"]


@needs_sm80_or_sm90_forward
@pytest.mark.parametrize("seqlen_q, seqlen_k", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("h, h_kv", GROUPS, ids=[f"g{h // hk}" for h, hk in GROUPS])
@pytest.mark.parametrize("causal, window", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_pack_fwd(d, causal, window, h, h_kv, seqlen_q, seqlen_k):
    b = 2
    q = randn_cuda(b, seqlen_q, h, d)
    k, v = randn_cuda(b, seqlen_k, h_kv, d), randn_cuda(b, seqlen_k, h_kv, d)
    poison_free_memory(_reserve(b, seqlen_q, h, d))
    out, lse = _run(cute_fa.flash_attn_func, q, k, v, causal=causal, window_size=window,
                    pack_gqa=True, return_lse=True, expect_pack=h // h_kv)  # fmt: skip
    _check_fwd(out, lse, q, k, v, causal, window)


@needs_sm80_or_sm90_forward
@pytest.mark.parametrize("d, dv", [(96, 96), (192, 128), (192, 192), (256, 256)])
@pytest.mark.parametrize("softcap", [0.0, 15.0], ids=["nocap", "cap15"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_pack_fwd_head_dims(d, dv, softcap, causal):
    """Every other tile shape (d 192: 112 keys; d 256: 64) and softcap."""
    b, h, h_kv = 2, 8, 2
    for sq, sk in ((1, 1500), (70, 333)):
        q, k, v = randn_cuda(b, sq, h, d), randn_cuda(b, sk, h_kv, d), randn_cuda(b, sk, h_kv, dv)
        out, lse = _run(cute_fa.flash_attn_func, q, k, v, causal=causal, softcap=softcap,
                        pack_gqa=True, return_lse=True, expect_pack=4)  # fmt: skip
        _check_fwd(out, lse, q, k, v, causal, softcap=softcap)


@needs_sm80_or_sm90_forward
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_pack_fwd_varlen_seqused(num_splits, causal):
    """Packed queries (decode rows and a prefill, an empty one) over keys with seqused_k (NaN
    past it: not inputs), with and without split-KV; rows past seqused_q come back 0 / -inf."""
    lens_q, lens_k = [1, 130, 0, 7, 1, 4], [900, 300, 50, 1111, 2, 64]
    used_q, used_k = [1, 100, 0, 7, 1, 4], [900, 257, 50, 1000, 2, 0]
    h, h_kv, d = 8, 2, 128
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn_cuda(sum(lens_q), h, d)
    k, v = randn_cuda(sum(lens_k), h_kv, d), randn_cuda(sum(lens_k), h_kv, d)
    starts_k = cu_k.tolist()
    for i, n in enumerate(used_k):  # keys past seqused_k are not inputs
        for t in (k, v):
            t[starts_k[i] + n : starts_k[i + 1]] = float("nan")
    sq_used = torch.tensor(used_q, dtype=torch.int32, device="cuda")
    sk_used = torch.tensor(used_k, dtype=torch.int32, device="cuda")
    poison_free_memory(_reserve(1, sum(lens_q), h, d) * (num_splits + 1))
    out, lse = _run(
        cute_fa.flash_attn_varlen_func, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max(lens_q), seqused_q=sq_used, seqused_k=sk_used, causal=causal,
        num_splits=num_splits, pack_gqa=True, return_lse=True, expect_pack=4,
        expect_splits=num_splits,
    )  # fmt: skip
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    starts_q = cu_q.tolist()
    for i in range(len(lens_q)):
        q0, k0 = starts_q[i], starts_k[i]
        rows = slice(q0, q0 + used_q[i])
        past = slice(q0 + used_q[i], q0 + lens_q[i])
        assert (out[past] == 0).all() and torch.isneginf(lse[:, past]).all()
        if used_q[i] == 0:
            continue
        if used_k[i] == 0:  # no key: every row 0 / -inf
            assert (out[rows] == 0).all() and torch.isneginf(lse[:, rows]).all()
            continue
        qi = q[rows].unsqueeze(0)
        ki, vi = (t[k0 : k0 + used_k[i]].unsqueeze(0) for t in (k, v))
        _check_fwd(out[rows].unsqueeze(0), lse[:, rows].unsqueeze(0), qi, ki, vi, causal)


@needs_sm80_or_sm90_forward
@pytest.mark.parametrize("num_splits", [3, 16])
def test_pack_fwd_split_decode(num_splits):
    """A decode step (batch 3, one query row, 8 heads over 2 K/V heads) split over the keys."""
    b, sk, h, h_kv, d = 3, 5000, 8, 2, 128
    q, k, v = randn_cuda(b, 1, h, d), randn_cuda(b, sk, h_kv, d), randn_cuda(b, sk, h_kv, d)
    out, lse = _run(cute_fa.flash_attn_func, q, k, v, causal=True, num_splits=num_splits,
                    return_lse=True, expect_pack=4, expect_splits=num_splits)  # fmt: skip
    _check_fwd(out, lse, q, k, v, True)


@needs_sm80_or_sm90_forward
def test_pack_gqa_none_true_false_agree():
    """None packs a decode step (the heuristic) and not a long prefill; True packs both; False
    neither; the outputs agree within the tolerance (a different tile order of the same sums:
    bitwise equal here, every row sees its keys in the same blocks)."""
    h, h_kv, d = 16, 4, 128
    for sq, sk, auto in ((1, 3000, 4), (2048, 2048, 0)):
        q, k, v = randn_cuda(2, sq, h, d), randn_cuda(2, sk, h_kv, d), randn_cuda(2, sk, h_kv, d)
        results = {}
        for value, want in ((None, auto), (True, 4), (False, 0)):
            results[value] = _run(cute_fa.flash_attn_func, q, k, v, causal=True,
                                  pack_gqa=value, return_lse=True, expect_pack=want)  # fmt: skip
        for value in (None, True):
            torch.testing.assert_close(results[value][0], results[False][0], atol=0, rtol=0)
            torch.testing.assert_close(results[value][1], results[False][1], atol=0, rtol=0)
        _check_fwd(*results[True], q, k, v, True)


@needs_sm80_or_sm90_forward
@pytest.mark.parametrize("h, h_kv", [(6, 2), (10, 2), (12, 2), (7, 1)])
def test_pack_gqa_true_with_a_group_the_tile_does_not_take(h, h_kv):
    """Groups of 3, 5, 6 and 7 heads divide neither the sm90 forward's 64-row TMA boxes nor the
    sm80 forward's tiles: pack_gqa=True runs unpacked (Note [packed GQA plans]), with correct
    results."""
    q, k, v = randn_cuda(2, 3, h, 128), randn_cuda(2, 700, h_kv, 128), randn_cuda(2, 700, h_kv, 128)
    out, lse = _run(cute_fa.flash_attn_func, q, k, v, causal=True, pack_gqa=True,
                    return_lse=True, expect_pack=0)  # fmt: skip
    _check_fwd(out, lse, q, k, v, True)


@needs_sm80_or_sm90_forward
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 150])
def test_pack_fwd_backward(seqlen_q, causal):
    """The backward of a packed forward (the usual backward on its out and LSE)."""
    b, sk, h, h_kv, d = 2, 1500, 8, 2, 128
    q, k, v = randn_cuda(b, seqlen_q, h, d), randn_cuda(b, sk, h_kv, d), randn_cuda(b, sk, h_kv, d)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _run(cute_fa.flash_attn_func, *leaves, causal=causal, pack_gqa=True,
                    return_lse=True, expect_pack=4)  # fmt: skip
    _check_fwd(out.detach(), lse.detach(), q, k, v, causal)
    dout = randn_cuda(*out.shape)
    check_grads(torch.autograd.grad(out, leaves, dout), q, k, v, dout, causal)


# (query heads, K/V heads) of the decode cases: groups of 4 and 8, MQA with 16 heads.
DECODE_GROUPS = [(32, 8), (32, 4), (16, 1)]
# Cache lengths (seqused_k) of the decode batch: long, one key, empty, off the tile and page.
DECODE_LENS_K = [1000, 1, 0, 333, 4096]


@needs_sm80_or_sm90_forward
@pytest.mark.parametrize("page_size", [0, 16, 1], ids=["dense", "page16", "page1"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("mask", ["causal", "win32_0_cap15"])
@pytest.mark.parametrize("h, h_kv", DECODE_GROUPS, ids=["g4", "g8", "mqa16"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_pack_decode(seqlen_q, h, h_kv, mask, num_splits, page_size):
    """A decode step: 1 or 4 query rows of each of 5 sequences over a KV cache with seqused_k
    (keys past it NaN: not inputs), dense or paged (pages of 16 keys, of 1 key), split over
    the keys or not, causal or a window with softcap; the plan packs every group."""
    d, b = 128, len(DECODE_LENS_K)
    causal = mask == "causal"
    window, softcap = ((None, None), 0.0) if causal else ((32, 0), 15.0)
    used = torch.tensor(DECODE_LENS_K, dtype=torch.int32, device="cuda")
    if page_size:
        k, v, table, ks, vs = paged_cache(DECODE_LENS_K, page_size, h_kv, d, d)
    else:
        table, sk = None, max(DECODE_LENS_K)
        k = torch.full((b, sk, h_kv, d), float("nan"), device="cuda").bfloat16()
        v = torch.full((b, sk, h_kv, d), float("nan"), device="cuda").bfloat16()
        ks, vs = [], []
        for i, n in enumerate(DECODE_LENS_K):
            k[i, :n], v[i, :n] = randn_cuda(n, h_kv, d), randn_cuda(n, h_kv, d)
            ks.append(k[i, :n])
            vs.append(v[i, :n])
    q = randn_cuda(b, seqlen_q, h, d)
    poison_free_memory(_reserve(b, seqlen_q, h, d) * (num_splits + 1))
    with torch.no_grad():
        out, lse = _run(
            cute_fa.flash_attn_varlen_func, q, k, v, seqused_k=used, page_table=table,
            causal=causal, window_size=window, softcap=softcap, num_splits=num_splits,
            pack_gqa=True, return_lse=True, expect_pack=h // h_kv, expect_splits=num_splits,
        )  # fmt: skip
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for i, n in enumerate(DECODE_LENS_K):
        if n == 0:  # no key: every row 0 / -inf
            assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()
            continue
        _check_fwd(out[i : i + 1], lse[i : i + 1], q[i : i + 1], ks[i][None], vs[i][None],
                   causal, window, softcap)  # fmt: skip
