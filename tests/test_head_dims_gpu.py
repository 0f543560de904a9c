"""Rounded head dims and (d, dv) pairs of the sm80 kernels on a GPU against the fp32 reference
(marker ``gpu``; skipped without CUDA).

Every multiple of 8 up to 256 runs the sm80 forward and backward on the tiles of the next tile
head dim (Note [rounded head dims] in cute_fa/config.py): loads predicated off past the
tensor's columns, the padded shared-memory columns zeroed, stores of the tensor's own columns,
the dQ accumulator as wide as the tile. No other kernel family takes these head dims, so on any
GPU (the H200 too) dispatch picks the sm80 kernels by itself; each test checks that the kernel
that ran is the sm80 one of the call's head dims (the forward's launch plan, the backward's
kept kernels). The pairs (128, 64) and (192, 128) run the sm80 kernels here under
CUTE_FA_FWD_ARCH=80 / CUTE_FA_BWD_ARCH=80 (an sm90 GPU runs its own kernels for them by
default, tests/test_fwd_gpu.py and tests/test_bwd_gpu.py).

Tolerance as everywhere (DESIGN.md): twice the error of the same math in the input dtype plus
a few ulps (``check_close``); rows that see no key exactly 0 / -inf; the free memory of the
caching allocator is NaN-poisoned before each call, so an output element no kernel writes
fails (a store past the tensor's columns would write into the next head's row, and the
comparison of that head fails).

    python -m pytest -m gpu -q tests/test_head_dims_gpu.py

Cases: head dims 32, 40, 72, 80, 112, 160, 224 (tiles of 64, 64, 96, 96, 128, 192, 256) x
no mask / causal x seqlens 1, 113 / 300, 300 / 113, 1000 x MHA / GQA, forward and backward;
a window with softcap, fp16, packed sequences with an empty one (and seqused), deterministic;
the pairs with masks and lengths. Inputs are fresh random tensors every run (the seed is
printed; ``CUTE_FA_TEST_SEED`` replays one).
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import check_fwd as gpu_check_fwd
from gpu_support import (  # noqa: F401
    cu_seqlens,
    empty_rows,
    fwd_plan_configs,
    poison_free_memory,
    seed,
)

import cute_fa
from cute_fa import settings
from cute_fa.reference import attention_ref, check_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEAD_DIMS = (32, 40, 72, 80, 112, 160, 224)
PAIRS = ((128, 64), (192, 128))
NHEADS = 6
LSE_ATOL = 1e-4
SEQLENS = [(1, 1), (113, 300), (300, 113), (1000, 1000)]
BWD_SEQLENS = [(1, 1), (113, 300), (1000, 1000)]
MASKS = [pytest.param(False, id="full"), pytest.param(True, id="causal")]
GROUPS = [pytest.param(6, id="mha"), pytest.param(2, id="gqa3")]


def _randn(*shape, dtype=torch.bfloat16, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


def _reserve(*tensors: torch.Tensor) -> int:
    """Bytes to poison before a call: four times its inputs in fp32, plus slack."""
    return 4 * sum(t.numel() * 4 for t in tensors) + (16 << 20)


def _qkv(b, sq, sk, h_kv, d, dv, dtype, softcap=0.0):
    q = _randn(b, sq, NHEADS, d, dtype=dtype, scale=softcap / 4 if softcap else 1.0)
    return q, _randn(b, sk, h_kv, d, dtype=dtype), _randn(b, sk, h_kv, dv, dtype=dtype)


@pytest.fixture
def ran(monkeypatch):
    """The compile keys of the kernels the test's calls ran: (forward keys, backward main-kernel
    keys). The forward's launch plans and the backward's kept kernels start empty."""
    from cute_fa import backward, ops

    monkeypatch.setattr(ops, "_plans", {})
    kept = {}
    monkeypatch.setattr(backward, "_launch_kernels", kept)
    return lambda: (fwd_plan_configs(), [found[0] for found in kept.values()])


def force_sm80(monkeypatch) -> None:
    """CUTE_FA_FWD_ARCH=80 and CUTE_FA_BWD_ARCH=80 for one test (launch plans emptied: they are
    made under the settings of their first call)."""
    monkeypatch.setenv(settings.FWD_ARCH, "80")
    monkeypatch.setenv(settings.BWD_ARCH, "80")
    monkeypatch.setattr(cute_fa.ops, "_plans", {})


def _assert_sm80(configs, d: int, dv: int) -> None:
    assert configs, "no kernel ran"
    for config in configs:
        assert (config.arch, config.head_dim, config.head_dim_v) == (80, d, dv), config.name


def check_fwd(out, lse, q, k, v, causal=False, window=(None, None), softcap=0.0) -> None:
    """out (b, sq, h, dv), lse (b, h, sq) against the reference (``gpu_support.check_fwd``:
    rows without keys 0 / -inf, nothing NaN) and the output's shape and dtype."""
    if causal:
        window = (window[0], 0)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    gpu_check_fwd(out, lse, q, k, v, window=window, softcap=softcap, lse_atol=LSE_ATOL)


def check_grads(grads, q, k, v, dout, **kwargs) -> None:
    """(dq, dk, dv) of one batched problem against the gradients of the reference (fp32, and
    the baseline in the input dtype); shapes and dtypes of the leaves, nothing NaN."""
    for g, t, name in zip(grads, (q, k, v), ("dq", "dk", "dv"), strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype, (name, g.shape, g.dtype)
        assert not torch.isnan(g).any(), f"NaN in {name} (an element no kernel wrote?)"
    refs = []
    for upcast in (True, False):
        dtype = torch.float32 if upcast else q.dtype
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, upcast=upcast, reorder_ops=not upcast, **kwargs)
        refs.append(torch.autograd.grad(out, leaves, dout.to(out.dtype)))
    for g, g_ref, g_pt, name in zip(grads, *refs, ("dq", "dk", "dv"), strict=True):
        check_close(g, g_ref, g_pt, name=name)


def run_fwd(b, sq, sk, h_kv, d, dv=None, *, dtype=torch.bfloat16, causal=False,
            window=(None, None), softcap=0.0):  # fmt: skip
    dv = dv or d
    q, k, v = _qkv(b, sq, sk, h_kv, d, dv, dtype, softcap)
    poison_free_memory(_reserve(q, k, v))
    out, lse = cute_fa.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                       softcap=softcap, return_lse=True)  # fmt: skip
    check_fwd(out, lse, q, k, v, causal, window, softcap)


def run_bwd(b, sq, sk, h_kv, d, dv=None, *, dtype=torch.bfloat16, causal=False,
            window=(None, None), softcap=0.0, deterministic=False):  # fmt: skip
    dv = dv or d
    q, k, v = _qkv(b, sq, sk, h_kv, d, dv, dtype, softcap)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kwargs = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = cute_fa.flash_attn_func(*leaves, return_lse=True, deterministic=deterministic,
                                       **kwargs)  # fmt: skip
    check_fwd(out.detach(), lse.detach(), q, k, v, causal, window, softcap)
    dout = _randn(*out.shape, dtype=dtype)
    poison_free_memory(_reserve(q, k, v, dout))
    grads = torch.autograd.grad(out, leaves, dout)
    check_grads(grads, q, k, v, dout, **kwargs)
    return grads


# --------------------------------------------------------------------------------------------
# Rounded head dims


@pytest.mark.parametrize("h_kv", GROUPS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("causal", MASKS)
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_fwd_rounded(ran, d, causal, seqlen_q, seqlen_k, h_kv):
    run_fwd(2, seqlen_q, seqlen_k, h_kv, d, causal=causal)
    _assert_sm80(ran()[0], d, d)


@pytest.mark.parametrize("h_kv", GROUPS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", BWD_SEQLENS,
                         ids=[f"{a}x{b}" for a, b in BWD_SEQLENS])  # fmt: skip
@pytest.mark.parametrize("causal", MASKS)
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_bwd_rounded(ran, d, causal, seqlen_q, seqlen_k, h_kv):
    run_bwd(2, seqlen_q, seqlen_k, h_kv, d, causal=causal)
    fwd, bwd = ran()
    _assert_sm80(fwd, d, d)
    _assert_sm80(bwd, d, d)


@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_rounded_window_softcap(ran, d):
    """A window (both edges) with softcap, forward and backward; an odd length."""
    run_bwd(2, 300, 517, 2, d, window=(77, 13), softcap=15.0)
    fwd, bwd = ran()
    _assert_sm80(fwd, d, d)
    _assert_sm80(bwd, d, d)


@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_rounded_fp16(ran, d):
    run_bwd(2, 113, 300, 2, d, dtype=torch.float16, causal=True)
    _assert_sm80(ran()[1], d, d)


@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_rounded_varlen_with_an_empty_sequence(ran, d):
    """Packed sequences, one of them empty and one of a single row, seqused_k on the last:
    forward and backward, each sequence against its own reference; keys past seqused_k get
    zero gradients."""
    lens_q, lens_k = [0, 113, 1, 300], [70, 0, 129, 513]
    used_k = [70, 0, 129, 200]
    h_kv = 2
    q = _randn(sum(lens_q), NHEADS, d)
    k, v = _randn(sum(lens_k), h_kv, d), _randn(sum(lens_k), h_kv, d)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = cute_fa.flash_attn_varlen_func(
        *leaves, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
        max_seqlen_k=max(lens_k), seqused_k=torch.tensor(used_k, dtype=torch.int32,
                                                         device="cuda"),
        causal=True, return_lse=True,
    )  # fmt: skip
    dout = _randn(*out.shape)
    poison_free_memory(_reserve(q, k, v, dout))
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        q0, k0, uk = int(cu_q[i]), int(cu_k[i]), used_k[i]
        rows, keys = slice(q0, q0 + lq), slice(k0, k0 + uk)
        assert (dk[k0 + uk : k0 + lk] == 0).all() and (dv[k0 + uk : k0 + lk] == 0).all()
        if lq == 0:
            continue
        if uk == 0:
            assert (out[rows] == 0).all() and torch.isneginf(lse[:, rows]).all()
            assert (dq[rows] == 0).all()
            continue
        one = (q[rows][None], k[keys][None], v[keys][None])
        check_fwd(out[rows][None].detach(), lse[:, rows][None].detach(), *one, causal=True)
        check_grads((dq[rows][None], dk[keys][None], dv[keys][None]), *one, dout[rows][None],
                    causal=True)  # fmt: skip
    fwd, bwd = ran()
    _assert_sm80(fwd, d, d)
    _assert_sm80(bwd, d, d)


@pytest.mark.parametrize("d", [40, 160], ids=["d40", "d160"])
def test_rounded_deterministic(ran, d):
    """deterministic=True: right, and the gradients of two calls on the same inputs are
    bitwise equal."""
    q, k, v = _qkv(2, 300, 700, 2, d, d, torch.bfloat16)
    dout = _randn(2, 300, NHEADS, d)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = cute_fa.flash_attn_func(*leaves, causal=True, deterministic=True)
        poison_free_memory(_reserve(q, k, v, dout))
        grads.append(torch.autograd.grad(out, leaves, dout))
    check_grads(grads[0], q, k, v, dout, causal=True)
    for a, b, name in zip(*grads, ("dq", "dk", "dv"), strict=True):
        assert torch.equal(a, b), name
    _assert_sm80(ran()[1], d, d)


# --------------------------------------------------------------------------------------------
# (d, dv) pairs of the sm80 kernels


@pytest.mark.parametrize("seqlen_q,seqlen_k", BWD_SEQLENS, ids=[f"{a}x{b}" for a, b in BWD_SEQLENS])
@pytest.mark.parametrize("causal", MASKS)
@pytest.mark.parametrize("d,dv", PAIRS, ids=[f"d{d}x{dv}" for d, dv in PAIRS])
def test_pairs(monkeypatch, ran, d, dv, causal, seqlen_q, seqlen_k):
    force_sm80(monkeypatch)
    run_bwd(2, seqlen_q, seqlen_k, 2, d, dv, causal=causal)
    fwd, bwd = ran()
    _assert_sm80(fwd, d, dv)
    _assert_sm80(bwd, d, dv)


@pytest.mark.parametrize("d,dv", PAIRS, ids=[f"d{d}x{dv}" for d, dv in PAIRS])
def test_pairs_window_softcap_fp16(monkeypatch, ran, d, dv):
    force_sm80(monkeypatch)
    run_bwd(2, 300, 517, 6, d, dv, window=(77, 13), softcap=15.0)
    run_bwd(1, 113, 300, 2, d, dv, dtype=torch.float16, causal=True)
    run_fwd(2, 1, 4224, 2, d, dv)  # a decode row over many key blocks
    fwd, bwd = ran()
    _assert_sm80(fwd, d, dv)
    _assert_sm80(bwd, d, dv)


def test_pair_128_64_default_dispatch(ran):
    """(128, 64) by default: the sm90 kernels on an sm90 GPU, the sm80 ones elsewhere."""
    run_bwd(2, 257, 129, 2, 128, 64, causal=True)
    fwd, bwd = ran()
    hopper = torch.cuda.get_device_capability()[0] == 9
    for configs, forced in ((fwd, settings.forced_fwd_arch()), (bwd, settings.forced_bwd_arch())):
        arch = forced or (90 if hopper else 80)
        assert configs and all(c.arch == arch for c in configs), [c.name for c in configs]


def test_unsupported_pair_names_the_argument():
    q, k, v = _qkv(1, 16, 16, 2, 64, 128, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="head_dim=64, head_dim_v=128"):
        cute_fa.flash_attn_func(q, k, v)
