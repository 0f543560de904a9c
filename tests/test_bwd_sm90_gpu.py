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


def sm90_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False, tuning=None):
    """(dq, dk, dv) through preprocess (sm80), the sm90 main kernel and postprocess (sm80);
    ``deterministic``: dQ added in key-block order through zeroed semaphores; ``tuning``: fields
    of ``Sm90BwdTuning`` over the built-in ones (the kernel of exactly those fields runs)."""
    from cute_fa.compile import bwd_post_cache, bwd_pre_cache
    from cute_fa.planning import bwd_config, post_config, pre_config

    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    # The sm90 kernel's compile key with its built-in tuning (no tuned table) and ``tuning``.
    with cute_fa.tuning(sm90_bwd=tuning or {}):
        config = bwd_config(
            "sm_90a", dtype, d, d, causal=causal, deterministic=deterministic, arch=90
        )
    for field, value in (tuning or {}).items():
        assert getattr(config.tuning, field) == value, config.name
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


# The step-order tuning fields (hopper/flash_bwd.py docstring): dQ split over the consumers by
# rows (d 64, 128 query rows a step) and dQ issued before dK (d <= 128), alone, together and
# neither. Both are on by default at d 64 without softcap (``bwd_default_step_order``), so its
# cases name both fields.
BASE_ORDER = {"dq_by_rows": False, "dq_before_dk": False}  # dV, dK, then dQ over d / 2 columns
STEP_ORDER = [
    pytest.param(64, BASE_ORDER, id="d64-base"),
    pytest.param(64, {"dq_by_rows": True, "dq_before_dk": False}, id="d64-rows"),
    pytest.param(64, {"dq_by_rows": False, "dq_before_dk": True}, id="d64-first"),
    pytest.param(64, {"dq_by_rows": True, "dq_before_dk": True}, id="d64-rows-first"),
    pytest.param(96, {"dq_before_dk": True}, id="d96-first"),
    pytest.param(128, {"dq_before_dk": True}, id="d128-first"),
]


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,fields", STEP_ORDER)
def test_sm90_bwd_step_order(d, fields, dtype, causal, h_kv, seqlen_q, seqlen_k):
    q, k, v, out, lse, dout = forward_inputs(d, dtype, causal, 4, h_kv, seqlen_q, seqlen_k)
    grads = sm90_backward(dout, q, k, v, out, lse, d**-0.5, causal, tuning=fields)
    torch.cuda.synchronize()
    check_grads(grads, q, k, v, dout, causal=causal)


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", DETERMINISTIC_SEQLENS, ids=[f"{a}x{b}" for a, b in DETERMINISTIC_SEQLENS]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,fields", STEP_ORDER)
def test_sm90_bwd_step_order_deterministic(d, fields, causal, seqlen_q, seqlen_k):
    """deterministic=True with a step-order field: correct, the same bytes on every run, and
    the same math as the base order (``BASE_ORDER``): dK and dV are the same WGMMAs (bitwise
    equal), and so is dQ where only the order changed (dq_before_dk); dQ by rows runs other
    WGMMA shapes."""
    q, k, v, out, lse, dout = forward_inputs(d, torch.bfloat16, causal, 4, 2, seqlen_q, seqlen_k)
    scale = d**-0.5
    grads = sm90_backward(dout, q, k, v, out, lse, scale, causal, True, tuning=fields)
    check_grads(grads, q, k, v, dout, causal=causal)
    again = sm90_backward(dout, q, k, v, out, lse, scale, causal, True, tuning=fields)
    default = sm90_backward(dout, q, k, v, out, lse, scale, causal, True, tuning=BASE_ORDER)
    same_as_default = ("dk", "dv") if fields.get("dq_by_rows") else ("dq", "dk", "dv")
    for g, g2, g0, name in zip(grads, again, default, ("dq", "dk", "dv"), strict=True):
        assert torch.equal(g.view(torch.int16), g2.view(torch.int16)), f"{name} differs"
        if name in same_as_default:
            assert torch.equal(g.view(torch.int16), g0.view(torch.int16)), f"{name} != default"


# Through the public API (planning, autograd) with the fields as a ``cute_fa.tuning`` override:
# windows, softcap (d 64 with softcap steps 64 rows: no dq_by_rows), varlen with NaN past
# seqused, deterministic varlen.
STEP_ORDER_FEATURES = [
    pytest.param(64, BASE_ORDER, "window", id="d64-base-window"),
    pytest.param(64, {"dq_by_rows": True, "dq_before_dk": False}, "window", id="d64-rows-window"),
    pytest.param(64, {"dq_by_rows": True, "dq_before_dk": True}, "window",
                 id="d64-rows-first-window"),
    pytest.param(128, {"dq_before_dk": True}, "window", id="d128-first-window"),
    pytest.param(64, {"dq_before_dk": True}, "softcap", id="d64-first-softcap"),
    pytest.param(128, {"dq_before_dk": True}, "softcap", id="d128-first-softcap"),
    pytest.param(64, BASE_ORDER, "seqused", id="d64-base-seqused"),
    pytest.param(64, {"dq_by_rows": True, "dq_before_dk": False}, "seqused",
                 id="d64-rows-seqused"),
    pytest.param(64, {"dq_by_rows": True, "dq_before_dk": True}, "seqused",
                 id="d64-rows-first-seqused"),
    pytest.param(96, {"dq_before_dk": True}, "seqused", id="d96-first-seqused"),
    pytest.param(128, {"dq_before_dk": True}, "seqused", id="d128-first-seqused"),
    pytest.param(64, BASE_ORDER, "varlen-det", id="d64-base-varlen-det"),
    pytest.param(64, {"dq_by_rows": True, "dq_before_dk": False}, "varlen-det",
                 id="d64-rows-varlen-det"),
    pytest.param(128, {"dq_before_dk": True}, "varlen-det", id="d128-first-varlen-det"),
]  # fmt: skip


def _run_feature(monkeypatch, fields: dict, d: int, feature: str, causal: bool) -> list:
    """One feature call through the public API (planning, autograd) with ``fields`` as a
    ``cute_fa.tuning(sm90_bwd=...)`` override: "window", "softcap", "varlen", "seqused" (NaN
    past seqused) or "varlen-det", with GQA; returns the configs of the backwards that ran,
    after checking that the sm90 backward ran with every asked field."""
    from test_bwd_gpu import (
        LENS_K,
        LENS_Q,
        NHEADS,
        on_this_thread,
        run_bwd_and_check,
        run_varlen_bwd_and_check,
        track_bwd_kernels,
    )

    if cute_fa.settings.forced_bwd_arch() == 80:
        pytest.skip("CUTE_FA_BWD_ARCH=80 runs the sm80 backward")
    ran = track_bwd_kernels(monkeypatch)
    with cute_fa.tuning(sm90_bwd=fields), on_this_thread():
        if feature == "window":
            window = (64, 0) if causal else (32, 32)
            run_bwd_and_check(2, 1000, 700, NHEADS, 2, d, window=window)
            if fields.get("tile_m") == 80:  # query blocks of 80 rows over 2049
                run_bwd_and_check(1, 2049, 2049, NHEADS, 2, d, window=(100, 37))
        elif feature == "softcap":
            run_bwd_and_check(2, 203, 1000, NHEADS, 2, d, causal=causal, softcap=15.0)
        elif feature == "varlen":
            run_varlen_bwd_and_check(LENS_Q, LENS_K, d, causal=causal)
        elif feature == "seqused":
            used_q = [min(a, u) for a, u in zip(LENS_Q, [10, 0, 250, 1, 100, 150, 0, 63],
                                                strict=True)]  # fmt: skip
            used_k = [min(a, u) for a, u in zip(LENS_K, [290, 5, 64, 1, 0, 17, 0, 100],
                                                strict=True)]  # fmt: skip
            run_varlen_bwd_and_check(LENS_Q, LENS_K, d, causal=causal, used_q=used_q,
                                     used_k=used_k, nan_unused=True)  # fmt: skip
        else:
            run_varlen_bwd_and_check(LENS_Q, LENS_K, d, causal=causal, deterministic=True)
    configs = ran()
    assert configs, "no backward ran"
    for config in configs:
        assert config.arch == 90, config.name
        for field, value in fields.items():
            assert getattr(config.tuning, field) == value, config.name
    return configs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,fields,feature", STEP_ORDER_FEATURES)
def test_sm90_bwd_step_order_features(monkeypatch, d, fields, feature, causal):
    _run_feature(monkeypatch, fields, d, feature, causal)


# 80 query rows a step at d 128 with dQ computed transposed (``Sm90BwdTuning(tile_m=80)``, a
# tuning choice; hopper/flash_bwd.py docstring): select with ``-k m80``. Lengths around the
# 80-row blocks (1, 113, 300 = 3.75 blocks, 1000, 2049 = 25.6 blocks) and across the 128-key
# CTAs, causal or not, MHA / GQA, bf16 / fp16.
M80 = {"tile_m": 80}
M80_SEQLENS = [(1, 1), (113, 113), (300, 300), (1000, 1000), (2049, 2049), (113, 300),
               (300, 113), (1000, 17), (17, 1000), (2049, 300)]  # fmt: skip


@pytest.mark.parametrize("seqlen_q,seqlen_k", M80_SEQLENS, ids=[f"{a}x{b}" for a, b in M80_SEQLENS])
@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa2"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_bwd_m80(dtype, causal, h_kv, seqlen_q, seqlen_k):
    q, k, v, out, lse, dout = forward_inputs(128, dtype, causal, 4, h_kv, seqlen_q, seqlen_k)
    grads = sm90_backward(dout, q, k, v, out, lse, 128**-0.5, causal, tuning=M80)
    torch.cuda.synchronize()
    check_grads(grads, q, k, v, dout, causal=causal)


M80_DETERMINISTIC_SEQLENS = DETERMINISTIC_SEQLENS + [(2049, 2049)]


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k",
    M80_DETERMINISTIC_SEQLENS,
    ids=[f"{a}x{b}" for a, b in M80_DETERMINISTIC_SEQLENS],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_bwd_m80_deterministic(causal, seqlen_q, seqlen_k):
    """deterministic=True with 80-row steps (one semaphore per 80-row query block): correct,
    and the same bytes on every run."""
    q, k, v, out, lse, dout = forward_inputs(128, torch.bfloat16, causal, 4, 2, seqlen_q, seqlen_k)
    scale = 128**-0.5
    grads = sm90_backward(dout, q, k, v, out, lse, scale, causal, True, tuning=M80)
    check_grads(grads, q, k, v, dout, causal=causal)
    for _ in range(2):
        again = sm90_backward(dout, q, k, v, out, lse, scale, causal, True, tuning=M80)
        for g, g2, name in zip(grads, again, ("dq", "dk", "dv"), strict=True):
            assert torch.equal(g.view(torch.int16), g2.view(torch.int16)), f"{name} differs"


# Through the public API (planning, autograd) with tile_m 80 as a ``cute_fa.tuning`` override:
# windows, packed varlen (empty sequences included), varlen with NaN past seqused,
# deterministic varlen, all with GQA (6 query heads on 2 K/V heads).
M80_FEATURES = ["window", "varlen", "seqused", "varlen-det"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("feature", M80_FEATURES)
def test_sm90_bwd_m80_features(monkeypatch, feature, causal):
    for config in _run_feature(monkeypatch, M80, 128, feature, causal):
        assert config.tile_m == 80, config.name
