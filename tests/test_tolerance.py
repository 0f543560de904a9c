"""check_close's rule against the errors it exists to catch (CPU).

The rule (cute_fa/reference.py, Note [check_close's atol], Note [the RMS rule]): a result passes
when ``max|out - out_ref| <= 2 * max|out_pt - out_ref| + atol`` and the same holds of the root
mean square of the errors, atol a few ulps of the input dtype at that tensor's own magnitude.
``out_ref`` is attention_ref in fp32, ``out_pt`` the baseline at the kernels' precision
(Note [the kernel-precision baseline]: fp32 scores and accumulators, P, dS and the outputs in
the input dtype) with ``reorder_ops=True``, as the GPU tests build them; gradients are those of
autograd through the same two computations.

A "kernel-like" result here is the baseline's math in the other rounding order
(``reorder_ops=False``), or a backward written out as a kernel computes it (``_manual_bwd``).
Computed correctly it must pass at every shape below; with a planted bug (the near-misses a
looser rule let through) it must fail: a 1 % softmax-scale error (bf16 and fp16, with and
without softcap), the last key dropped, a GQA group on the wrong kv head, a backward without
delta. What no rule can see is pinned too: under a saturating softcap the output barely
depends on the scale.
"""

from __future__ import annotations

import pytest
import torch

from cute_fa.reference import (
    BASELINE_FACTOR,
    MAGNITUDE_FLOOR,
    ULPS,
    attention_ref,
    check_close,
    ulp_atol,
)

NAMES = ("out", "dq", "dk", "dv")


def _inputs(sq, sk, h, h_kv, d, dtype, seed, q_scale=1.0):
    """q, k, v, dout from one seeded generator (the near-miss margins below are for these)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    q = randn(1, sq, h, d, scale=q_scale)
    k, v = randn(1, sk, h_kv, d), randn(1, sk, h_kv, d)
    return q, k, v, randn(1, sq, h, d)


def _fwd_bwd(q, k, v, dout, *, upcast, reorder_ops=False, **kwargs):
    """(out, dq, dk, dv) of attention_ref: fp32 leaves and math with ``upcast``, else the input
    dtype throughout."""
    dtype = torch.float32 if upcast else q.dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, upcast=upcast, reorder_ops=reorder_ops, **kwargs)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout.to(out.dtype)))


def _truth(q, k, v, dout, **kwargs):
    """(reference, baseline) as the GPU tests build them."""
    ref = _fwd_bwd(q, k, v, dout, upcast=True, **kwargs)
    pt = _fwd_bwd(q, k, v, dout, upcast=False, reorder_ops=True, **kwargs)
    return ref, pt


def _rejected(results, ref, pt, names=NAMES) -> list[str]:
    """Names of the results check_close rejects."""
    failed = []
    for x, x_ref, x_pt, name in zip(results, ref, pt, names, strict=True):
        try:
            check_close(x, x_ref, x_pt, name=name)
        except AssertionError:
            failed.append(name)
    return failed


def _manual_bwd(q, k, v, dout, *, softmax_scale, causal=False, softcap=0.0, with_delta=True):
    """(out, dq, dk, dv) written out as a backward kernel computes them: fp32 scores and
    accumulators, P and dS in the input dtype for their GEMMs, per-head dK / dV in the input
    dtype: dS = P * (dP - delta), delta = rowsum(dO * O). ``with_delta=False`` plants the bug
    dS = P * dP."""
    dtype, group = q.dtype, q.shape[2] // k.shape[2]
    kx, vx = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kx.float()) * softmax_scale
    if softcap:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    if causal:
        sq, sk = scores.shape[-2:]
        future = torch.arange(sk)[None] > torch.arange(sq)[:, None] + (sk - sq)
        scores = scores.masked_fill(future, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p16 = p.to(dtype).float()  # P as the kernels hold it for the P V and dV GEMMs
    out = torch.einsum("bhts,bshd->bthd", p16, vx.float()).to(dtype)
    dv = torch.einsum("bhts,bthd->bshd", p16, dout.float()).to(dtype)
    dp = torch.einsum("bthd,bshd->bhts", dout.float(), vx.float())
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).unsqueeze(-1)
    ds = p * (dp - delta) if with_delta else p * dp
    if softcap:
        ds = ds * (1 - tanh * tanh)
    ds = ds.to(dtype).float()  # the dS tile the kernels keep in the input dtype
    dq = torch.einsum("bhts,bshd->bthd", ds, kx.float()) * softmax_scale
    dk = (torch.einsum("bhts,bthd->bshd", ds, q.float()) * softmax_scale).to(dtype)
    b, sk, h, _ = dk.shape

    def fold(t):  # sum the query heads of each kv head in fp32, as the GQA sums do
        return t.float().view(b, sk, h // group, group, t.shape[-1]).sum(3).to(dtype)

    return out, dq.to(dtype), fold(dk), fold(dv)


# --------------------------------------------------------------------------------------------
# The rule's constants and atol


def test_rule_factors_are_pinned():
    """2 x the baseline's error + 2 ulps-of-eps at the tensor's magnitude: an error just under
    the allowance passes, just over fails (a change of either factor moves one of them)."""
    assert (BASELINE_FACTOR, ULPS, MAGNITUDE_FLOOR) == (2.0, 2.0, 2.0**-6)
    ref = torch.linspace(-0.3, 0.3, 101)
    pt = (ref + 0.001).bfloat16()
    base = float((pt.float() - ref).abs().max())
    atol = 2 * torch.finfo(torch.bfloat16).eps * 0.3
    allowed = 2 * base + atol
    out = ref.clone()
    out[7] += allowed * 0.99
    check_close(out, ref, pt)
    out[7] = ref[7] + allowed * 1.01
    with pytest.raises(AssertionError, match=r"allowed .*= 2 \* baseline"):
        check_close(out, ref, pt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_atol_is_ulps_at_the_tensors_own_magnitude(dtype):
    """No floor of 1.0: a reference of magnitude 0.3 gets 2 eps * 0.3, one of 40 gets 2 eps * 40;
    infinities (an LSE's -inf) do not count."""
    eps = torch.finfo(dtype).eps
    assert ulp_atol(torch.tensor([0.1, -0.3, 0.2]), dtype) == pytest.approx(2 * eps * 0.3)
    assert ulp_atol(torch.tensor([float("-inf"), 40.0]), dtype) == pytest.approx(2 * eps * 40)
    # A bf16 output of magnitude 0.3 no longer admits 0.0156 (the old floor's atol).
    ref = torch.full((8,), 0.3)
    with pytest.raises(AssertionError):
        check_close(ref + 0.0156, ref, ref.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zero_reference_atol_is_a_few_ulps_at_the_floor(dtype):
    """An all-zero reference (every row sees no key; softmax_scale=0's dq and dk; dq and dk with
    one key) or one of only infinities: atol = 2 eps * 2**-6 > 0. Exact zeros, 1e-30 (the
    kernels run softmax_scale=0 with a scale of 1e-30) and 2e-6 (fp32 cancellation noise)
    pass; 1e-3 does not, and neither does 2 eps * 2**-6 plus a little."""
    eps = torch.finfo(dtype).eps
    zeros = torch.zeros(4, 3)
    atol = ulp_atol(zeros, dtype)
    assert atol == 2 * eps * 2.0**-6 > 0
    assert ulp_atol(torch.full((3,), float("-inf")), dtype) == atol
    assert ulp_atol(torch.full((3,), 2.0**-7), dtype) == atol  # below the floor
    for noise in (0.0, 1e-30, 2e-6):
        check_close(torch.full((4, 3), noise).to(dtype), zeros, zeros.to(dtype))
    for noise in (1e-3, 1.1 * atol):
        with pytest.raises(AssertionError):
            check_close(torch.full((4, 3), noise), zeros, zeros.to(dtype))


# --------------------------------------------------------------------------------------------
# Not too tight: a correct low-precision computation passes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize(
    "sq,sk", [(1, 1), (17, 17), (17, 1000), (1000, 17), (1000, 1000)], ids=lambda x: str(x)
)
def test_correct_low_precision_result_passes(sq, sk, d, causal, dtype):
    q, k, v, dout = _inputs(sq, sk, 2, 1, d, dtype, seed=sq + sk + d)
    ref, pt = _truth(q, k, v, dout, causal=causal)
    ours = _fwd_bwd(q, k, v, dout, upcast=False, causal=causal)
    assert _rejected(ours, ref, pt) == []


@pytest.mark.parametrize(
    "dtype,softcap,q_scale",
    [(torch.bfloat16, 30.0, 7.5), (torch.float16, 30.0, 7.5), (torch.float16, 2.0, 1.0)],
    ids=["bf16-cap30", "fp16-cap30", "fp16-cap2"],
)
def test_correct_low_precision_result_passes_with_softcap(dtype, softcap, q_scale):
    q, k, v, dout = _inputs(256, 300, 2, 2, 64, dtype, seed=3, q_scale=q_scale)
    ref, pt = _truth(q, k, v, dout, causal=True, softcap=softcap)
    ours = _fwd_bwd(q, k, v, dout, upcast=False, causal=True, softcap=softcap)
    assert _rejected(ours, ref, pt) == []
    manual = _manual_bwd(q, k, v, dout, softmax_scale=64**-0.5, causal=True, softcap=softcap)
    assert _rejected(manual, ref, pt) == []


# --------------------------------------------------------------------------------------------
# Near-misses the rule must reject


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "sq,sk,d,softcap",
    [(1000, 1000, 128, 0.0), (256, 256, 64, 0.0), (17, 1000, 128, 0.0), (1000, 1000, 128, 30.0),
     (256, 256, 64, 30.0)],
    ids=["1000-d128", "256-d64", "17x1000-d128", "1000-d128-cap30", "256-d64-cap30"],
)  # fmt: skip
def test_softmax_scale_one_percent_off_is_rejected(sq, sk, d, softcap, dtype):
    """A 1 % error in the softmax scale, bf16 and fp16, with and without softcap: out, dq, dk
    and dv all fail (in bf16 by the RMS rule: it moves the output by about one rounding in the
    worst element, by 3-6x twice the baseline's RMS error over the tensor)."""
    q, k, v, dout = _inputs(sq, sk, 2, 2, d, dtype, seed=1)
    ref, pt = _truth(q, k, v, dout, softcap=softcap)
    bad = _fwd_bwd(q, k, v, dout, upcast=False, softcap=softcap, softmax_scale=1.01 * d**-0.5)
    assert _rejected(bad, ref, pt) == list(NAMES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_softmax_scale_off_under_a_saturating_softcap(dtype):
    """A cap of 2 on unit-variance scores saturates tanh, which makes the output nearly
    independent of the scale: 1 % moves out and dv by less than rounding in bf16 (what is
    there to see, dq and dk, fails), 3 % fails everywhere."""
    q, k, v, dout = _inputs(256, 256, 2, 2, 64, dtype, seed=1)
    ref, pt = _truth(q, k, v, dout, softcap=2.0)
    one = _fwd_bwd(q, k, v, dout, upcast=False, softcap=2.0, softmax_scale=1.01 * 64**-0.5)
    seen = ["dq", "dk"] if dtype == torch.bfloat16 else list(NAMES)
    assert _rejected(one, ref, pt) == seen
    three = _fwd_bwd(q, k, v, dout, upcast=False, softcap=2.0, softmax_scale=1.03 * 64**-0.5)
    assert _rejected(three, ref, pt) == list(NAMES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_last_key_dropped_is_rejected(dtype):
    """17 queries over 1000 keys, the kernel-like result never reads the last key (its dk and
    dv stay 0): the missing 1/1000 of the softmax shows in out and every gradient."""
    q, k, v, dout = _inputs(17, 1000, 2, 2, 64, dtype, seed=2)
    ref, pt = _truth(q, k, v, dout)
    out, dq, dk, dv = _fwd_bwd(q, k[:, :-1], v[:, :-1], dout, upcast=False)
    dk = torch.cat([dk, torch.zeros_like(k[:, -1:])], dim=1)
    dv = torch.cat([dv, torch.zeros_like(v[:, -1:])], dim=1)
    assert _rejected((out, dq, dk, dv), ref, pt) == list(NAMES)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_group_on_the_wrong_kv_head_is_rejected(causal):
    """4 query heads on 2 kv heads; the kernel-like result runs the first group on kv head 1."""
    q, k, v, dout = _inputs(256, 256, 4, 2, 64, torch.bfloat16, seed=4)
    ref, pt = _truth(q, k, v, dout, causal=causal)
    k_wrong, v_wrong = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    k_wrong[:, :, :2], v_wrong[:, :, :2] = k[:, :, 1:2], v[:, :, 1:2]
    out, dq, dk, dv = _fwd_bwd(q, k_wrong, v_wrong, dout, upcast=False, causal=causal)
    dk, dv = (g.float().view(1, 256, 2, 2, 64).sum(3).bfloat16() for g in (dk, dv))
    assert _rejected((out, dq, dk, dv), ref, pt) == list(NAMES)


@pytest.mark.parametrize(
    "sq,sk,causal,dtype",
    [
        (17, 1000, False, torch.bfloat16),
        (1000, 1000, False, torch.bfloat16),
        (256, 256, True, torch.bfloat16),
        (256, 256, False, torch.float16),
    ],
    ids=["17x1000-bf16", "1000-bf16", "256-causal-bf16", "256-fp16"],
)
def test_backward_without_delta_is_rejected(sq, sk, causal, dtype):
    """dS = P * dP instead of P * (dP - delta): dq and dk fail; out and dv do not depend on
    delta and pass (and the same code with delta passes everywhere)."""
    q, k, v, dout = _inputs(sq, sk, 4, 2, 128, dtype, seed=5)
    ref, pt = _truth(q, k, v, dout, causal=causal)
    kw = dict(softmax_scale=128**-0.5, causal=causal)
    assert _rejected(_manual_bwd(q, k, v, dout, **kw), ref, pt) == []
    bad = _manual_bwd(q, k, v, dout, with_delta=False, **kw)
    assert _rejected(bad, ref, pt) == ["dq", "dk"]


def test_baseline_takes_delta_from_the_rounded_output():
    """A backward that forms delta from the output in the input dtype, as every FlashAttention
    preprocess does, passes on calls where dQ cancels (2 queries over 2 keys, causal: dS =
    P (dP - delta) with dP close to delta); a baseline whose delta came from the unrounded
    output failed 38 of these 40 seeds (the sweep's 2-13x dQ misses on few-key calls). A
    delta from the unrounded output is still within the rule, and omitting delta is not."""
    kw = dict(softmax_scale=128**-0.5, causal=True)
    for seed in range(40):
        q, k, v, dout = _inputs(2, 2, 1, 1, 128, torch.bfloat16, seed=seed)
        ref, pt = _truth(q, k, v, dout, causal=True)
        assert _rejected(_manual_bwd(q, k, v, dout, **kw), ref, pt) == [], seed
    q, k, v, dout = _inputs(2, 2, 1, 1, 128, torch.bfloat16, seed=0)
    ref, pt = _truth(q, k, v, dout, causal=True)
    assert "dq" in _rejected(_manual_bwd(q, k, v, dout, with_delta=False, **kw), ref, pt)
