"""First GPU check of the sm90 backward main kernel (marker ``gpu``; needs an sm90 device).

This module launches the three backward kernels itself, as ``run_backward`` does, so that the sm90
main kernel is what runs whatever the dispatch (tests/test_bwd_gpu.py goes through ``run_backward``,
which picks it on sm_90a where it applies): the sm80 preprocess (delta, dQaccum zeroing), the sm90
main kernel and the sm80 postprocess (dQ = dQaccum * softmax_scale in the input dtype), then sums
dK/dV over
GQA groups. The forward is ``cute_fa.flash_attn_func`` (out, LSE). The gradients are compared
with ``attention_ref``'s as tests/test_bwd_gpu.py does (``check_grads``: fp32 reference, the
input-dtype baseline, 2x its error + 2-4 ulps at each gradient's magnitude; NaN fails). dK and
dV start as NaN, so a key row the kernel does not write fails; dQaccum must start at zero (the
preprocess zeroes it) for the atomics. ``deterministic=True`` passes zeroed semaphores and must
give the same bytes on every run.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import seed  # noqa: F401
from test_bwd_gpu import check_grads

import cute_fa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="needs an sm90 GPU",
    ),
]

_MAIN = {}


def _main_kernel(config):
    """The compiled sm90 main kernel of ``config`` (TVM-FFI, torch's current stream)."""
    if config not in _MAIN:
        from cute_fa.hopper.flash_bwd import FlashAttentionBackwardSm90

        from cute_fa.cache import export_tvm_ffi, load_tvm_ffi
        from cute_fa.compile import compile_tvm_ffi
        from cute_fa.dsl.fake import bwd_fake_args

        compiled = compile_tvm_ffi(
            FlashAttentionBackwardSm90(config), bwd_fake_args(config), config.target
        )
        symbol = "cute_fa_sm90_bwd"
        _MAIN[config] = load_tvm_ffi(export_tvm_ffi(compiled, symbol), symbol)
    return _MAIN[config]


def sm90_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False):
    """(dq, dk, dv) through preprocess (sm80), the sm90 main kernel and postprocess (sm80);
    ``deterministic``: dQ added in key-block order through zeroed semaphores."""
    from cute_fa.compile import bwd_post_cache, bwd_pre_cache
    from cute_fa.planning import bwd_config, post_config, pre_config

    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    # The sm90 kernel's compile key with its built-in tuning (no tuned table).
    config = bwd_config("sm_90a", dtype, d, d, causal=causal, deterministic=deterministic, arch=90)
    tile_m = config.tile_m
    pre = bwd_pre_cache().get(pre_config(config, False))  # the sm80 pre/postprocess kernels
    post = bwd_post_cache().get(post_config(config))  # (row-major dQaccum for sm90)
    delta = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    dq_accum = torch.empty((b, h, sq, d), dtype=torch.float32, device=q.device)
    pre(out, dout, None, delta, dq_accum)
    dk = torch.full((b, sk, h, d), float("nan"), dtype=q.dtype, device=q.device)
    dv = torch.full((b, sk, h, d), float("nan"), dtype=q.dtype, device=q.device)
    semaphores = None
    if deterministic:  # one per (batch, head, query block), zeroed
        blocks = -(-sq // tile_m)
        semaphores = torch.zeros((b, h, blocks), dtype=torch.int32, device=q.device)
    _main_kernel(config)(
        q, k, v, dout, lse, delta, dq_accum, dk, dv, softmax_scale, 0.0, 0, 0, sk,
        None, None, None, None, semaphores,
    )  # fmt: skip
    dq = torch.empty_like(q)
    post(dq_accum, dq, softmax_scale, None, 0)
    if h != h_kv:
        dk = dk.unflatten(2, (h_kv, h // h_kv)).sum(3, dtype=torch.float32).to(q.dtype)
        dv = dv.unflatten(2, (h_kv, h // h_kv)).sum(3, dtype=torch.float32).to(q.dtype)
    return dq, dk, dv


def forward_inputs(d, dtype, causal, h, h_kv, seqlen_q, seqlen_k, b=2):
    """Random q, k, v (batch b, h query heads, h_kv key/value heads), the forward's out and LSE
    through cute_fa, and a random dout."""
    q, k, v = (
        torch.randn(b, s, hh, d, device="cuda", dtype=dtype)
        for s, hh in ((seqlen_q, h), (seqlen_k, h_kv), (seqlen_k, h_kv))
    )
    out, lse = cute_fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    return q, k, v, out, lse, torch.randn_like(out)


SEQLENS = [(128, 128), (64, 64), (1, 1), (17, 17), (113, 203), (203, 113), (1000, 1000),
           (1000, 17), (17, 1000)]  # fmt: skip


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_sm90_bwd(d, dtype, causal, h_kv, seqlen_q, seqlen_k):
    q, k, v, out, lse, dout = forward_inputs(d, dtype, causal, 4, h_kv, seqlen_q, seqlen_k)
    scale = d**-0.5
    grads = sm90_backward(dout, q, k, v, out, lse, scale, causal)
    torch.cuda.synchronize()
    check_grads(grads, q, k, v, dout, causal=causal)


DETERMINISTIC_SEQLENS = [(1000, 1000), (113, 203), (203, 113), (1000, 17), (17, 1000)]


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", DETERMINISTIC_SEQLENS, ids=[f"{a}x{b}" for a, b in DETERMINISTIC_SEQLENS]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_sm90_bwd_deterministic(d, causal, seqlen_q, seqlen_k):
    """deterministic=True: correct, and the same bytes on every run (dQ is the one that could
    differ; dK and dV are per CTA)."""
    q, k, v, out, lse, dout = forward_inputs(d, torch.bfloat16, causal, 4, 2, seqlen_q, seqlen_k)
    scale = d**-0.5
    grads = sm90_backward(dout, q, k, v, out, lse, scale, causal, deterministic=True)
    check_grads(grads, q, k, v, dout, causal=causal)
    for _ in range(3):
        again = sm90_backward(dout, q, k, v, out, lse, scale, causal, deterministic=True)
        for g, g2, name in zip(grads, again, ("dq", "dk", "dv"), strict=True):
            assert torch.equal(g.view(torch.int16), g2.view(torch.int16)), f"{name} differs"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_bwd_deterministic_more_ctas_than_fit(causal):
    """More CTAs than the GPU holds at once (2 x 8 heads x 32 key blocks at d 128, one CTA an SM):
    CTAs wait only for CTAs of lower key block, which started earlier, so this must finish; the
    bytes are the same on every run and through flash_attn_func's own planning."""
    d = 128
    q, k, v, out, lse, dout = forward_inputs(d, torch.bfloat16, causal, 8, 8, 4096, 4096)
    grads = sm90_backward(dout, q, k, v, out, lse, d**-0.5, causal, deterministic=True)
    again = sm90_backward(dout, q, k, v, out, lse, d**-0.5, causal, deterministic=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out2, _ = cute_fa.flash_attn_func(*leaves, causal=causal, deterministic=True)
    dispatched = torch.autograd.grad(out2, leaves, dout)
    for g, g2, g3, name in zip(grads, again, dispatched, ("dq", "dk", "dv"), strict=True):
        assert torch.equal(g.view(torch.int16), g2.view(torch.int16)), f"{name} differs"
        assert torch.equal(g.view(torch.int16), g3.view(torch.int16)), f"{name} (dispatch)"


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (203, 113)], ids=["1000", "203x113"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["", "det"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_bwd_three_q_stages(monkeypatch, causal, deterministic, seqlen_q, seqlen_k):
    """``cute_fa.tuning(sm90_bwd={"q_stages": 3})`` at d128 (226.5 KiB of shared memory):
    gradients through the public API against the reference, with the three-stage kernel the
    one that ran (autograd's backward on this thread, where the override holds)."""
    from test_bwd_gpu import on_this_thread, track_bwd_kernels

    if cute_fa.settings.forced_bwd_arch() == 80:
        pytest.skip("CUTE_FA_BWD_ARCH=80 runs the sm80 backward")
    ran = track_bwd_kernels(monkeypatch)
    q, k, v = (
        torch.randn(2, s, 4, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for s in (seqlen_q, seqlen_k, seqlen_k)
    )
    with cute_fa.tuning(sm90_bwd={"q_stages": 3}), on_this_thread():
        out, _ = cute_fa.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    check_grads(grads, q, k, v, dout, causal=causal)
    (config,) = ran()
    assert config.arch == 90 and config.tuning.q_stages == 3, config.name
    assert config.causal == causal and config.deterministic == deterministic, config.name
