"""attention_ref and check_close against a naive per-element loop (CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_fa.reference import (
    attention_ref,
    attention_varlen_ref,
    check_close,
    merge_splits,
    visible_mask,
)


def naive_attention(q, k, v, scale=None, causal=False, window=(None, None), softcap=0.0, sink=None):
    """One query row at a time in float64, straight from the definition."""
    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window
    if causal:
        right = 0
    out = torch.zeros(b, sq, h, dv, dtype=torch.float64)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hk)
            for i in range(sq):
                diag = i + sk - sq
                keys = [
                    j
                    for j in range(sk)
                    if (left is None or j >= diag - left) and (right is None or j <= diag + right)
                ]
                logits = []
                for j in keys:
                    s = float((q[bi, i, hi] * k[bi, j, kh]).sum()) * scale
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    logits.append(s)
                extra = [] if sink is None else [float(sink[hi])]
                if not logits and not extra:
                    continue
                m = max(logits + extra)
                weights = [math.exp(s - m) for s in logits]
                total = sum(weights) + sum(math.exp(s - m) for s in extra)
                lse[bi, hi, i] = math.log(total) + m
                for w, j in zip(weights, keys, strict=True):
                    out[bi, i, hi] += w / total * v[bi, j, kh]
    return out, lse


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


WINDOWS = [
    (False, (None, None)),
    (True, (None, None)),
    (False, (None, 0)),
    (False, (1, 1)),
    (False, (0, 0)),
    (False, (2, None)),
    (False, (None, 2)),
    (False, (-1, 2)),
    (False, (3, -2)),
    (False, (None, -2)),
    (False, (-3, None)),
    (False, (-2, -2)),  # left + right < 0: no row sees a key (taken literally)
    (True, (1, None)),  # causal with a left bound: local (1, 0)
    (True, (None, 5)),  # causal overrides the right bound
]


@pytest.mark.parametrize("causal,window", WINDOWS, ids=[f"{c}-{w}" for c, w in WINDOWS])
@pytest.mark.parametrize("sq,sk", [(1, 1), (3, 5), (5, 3), (4, 4)])
def test_matches_naive_loop(sq, sk, causal, window):
    q, k, v = rand(2, sq, 4, 8, seed=1), rand(2, sk, 2, 8, seed=2), rand(2, sk, 2, 16, seed=3)
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window)
    out_n, lse_n = naive_attention(q, k, v, causal=causal, window=window)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == (2, sq, 4, 16) and lse.shape == (2, 4, sq)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_n))
    finite = torch.isfinite(lse_n)
    torch.testing.assert_close(lse.double()[finite], lse_n[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [2.0, 0.5])
def test_softcap_scale_and_sink(softcap):
    q, k, v = rand(1, 4, 2, 8, seed=4) * 3, rand(1, 6, 2, 8, seed=5), rand(1, 6, 2, 8, seed=6)
    sink = torch.tensor([0.5, -1.0])
    kw = dict(softmax_scale=0.7, causal=True, softcap=softcap)
    out, lse = attention_ref(q, k, v, learnable_sink=sink, **kw)
    out_n, lse_n = naive_attention(q, k, v, scale=0.7, causal=True, softcap=softcap, sink=sink)
    torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_n, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_are_zero_with_neg_inf_lse():
    # causal with sq > sk: the first sq - sk rows see nothing.
    q, k, v = rand(1, 6, 2, 8, dtype=torch.bfloat16), rand(1, 2, 2, 8), rand(1, 2, 2, 8)
    k, v = k.bfloat16(), v.bfloat16()
    for upcast in (True, False):
        out, lse = attention_ref(q, k, v, causal=True, upcast=upcast)
        assert out.dtype == (torch.float32 if upcast else torch.bfloat16)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert (out[:, :4] == 0).all() and torch.isneginf(lse[:, :, :4]).all()
        assert torch.isfinite(lse[:, :, 4:]).all()


@pytest.mark.parametrize("sq,sk", [(0, 5), (5, 0), (0, 0)])
def test_zero_length(sq, sk):
    q, k, v = rand(2, sq, 2, 8), rand(2, sk, 1, 8), rand(2, sk, 1, 8)
    out, lse = attention_ref(q, k, v, causal=True)
    assert out.shape == (2, sq, 2, 8) and lse.shape == (2, 2, sq)
    if sq:
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_same_dtype_baseline_is_close_but_not_exact():
    q, k, v = (rand(1, 64, 2, 64, seed=s).bfloat16() for s in (7, 8, 9))
    out_ref, lse_ref = attention_ref(q, k, v)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False)
    out_pt2, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True)
    assert not torch.equal(out_pt, out_pt2)  # reorder_ops is off unless asked for
    assert out_pt.dtype == torch.bfloat16 and lse_pt.dtype == torch.float32
    err = (out_pt.float() - out_ref).abs().max()
    assert 0 < err < 0.05
    assert (out_pt2.float() - out_ref).abs().max() < 0.05
    check_close(out_pt, out_ref, out_pt2)


def test_defaults_are_no_mask_and_the_inverse_square_root_scale():
    q, k, v = rand(1, 5, 2, 8, seed=1), rand(1, 3, 2, 8, seed=2), rand(1, 3, 2, 8, seed=3)
    out, lse = attention_ref(q, k, v)
    out_n, lse_n = naive_attention(q, k, v)
    torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_n, atol=1e-5, rtol=1e-5)


def test_attention_ref_messages():
    q = rand(1, 2, 4, 8)
    for i in range(3):  # each of q, k, v with three dims
        args = [q, q, q]
        args[i] = q[0]
        with pytest.raises(ValueError) as info:
            attention_ref(*args)
        assert str(info.value) == "attention_ref takes (batch, seqlen, heads, head_dim) tensors"
    with pytest.raises(ValueError) as info:
        attention_ref(q, q[:, :, :3], q[:, :, :3])
    assert str(info.value) == "nheads 4 is not a multiple of nheads_kv 3"


def test_gqa_gradients_are_rounded_per_query_head_in_the_baseline_only():
    q, k, v = (rand(1, 8, n, 16, seed=s).bfloat16() for s, n in ((1, 4), (2, 2), (3, 2)))
    dout = rand(1, 8, 4, 16, seed=4)

    def grads(q, k, v, upcast):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, upcast=upcast)
        out.backward(dout.to(out.dtype))
        return [t.grad for t in leaves[1:]]

    def group_sum(grad):  # (b, s, 4, d) -> (b, s, 2, d): the two query heads of a kv head
        return grad.float().unflatten(2, (2, 2)).sum(3).bfloat16()

    # the baseline: each query head's dK and dV in bf16 (as the kernels write them), then summed
    dk, dv = grads(q, k, v, upcast=False)
    dk_heads, dv_heads = grads(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), False)
    assert torch.equal(dk, group_sum(dk_heads)) and torch.equal(dv, group_sum(dv_heads))
    # the ground truth: fp32 throughout, rounded once where the bf16 leaf takes its gradient
    dk, dv = grads(q, k, v, upcast=True)
    dk32, dv32 = grads(q.float(), k.float(), v.float(), upcast=True)
    assert torch.equal(dk, dk32.bfloat16()) and torch.equal(dv, dv32.bfloat16())


def test_visible_mask_bottom_right_aligned():
    m = visible_mask(2, 4, None, 0)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    m = visible_mask(3, 3, 1, -1)  # only the key just before the diagonal
    assert m.tolist() == [[False, False, False], [True, False, False], [False, True, False]]


def test_references_stay_on_the_inputs_device():
    """The GPU tests build references on the GPU; "meta" stands in for it on the CPU (a tensor
    made on the default device, the CPU, does not mix with it)."""
    assert visible_mask(3, 5, 1, 0, device="meta").device.type == "meta"
    q = torch.empty(1, 4, 2, 16, dtype=torch.bfloat16, device="meta")
    out, lse = attention_ref(q, q, q, causal=True)
    assert (out.device.type, lse.device.type) == ("meta", "meta")
    assert (out.shape, lse.shape) == ((1, 4, 2, 16), (1, 2, 4))
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    out, lse = attention_varlen_ref(q[0], q[0], q[0], cu, cu, causal=True)
    assert (out.device.type, lse.device.type) == ("meta", "meta")
    assert (out.shape, lse.shape) == ((4, 2, 16), (2, 4))


@pytest.mark.parametrize("causal,window", WINDOWS, ids=[f"{c}-{w}" for c, w in WINDOWS])
@pytest.mark.parametrize("sq,sk", [(1, 1), (3, 5), (5, 3), (4, 4), (0, 3), (3, 0)])
def test_gpu_support_mask_bookkeeping_matches_visible_mask(sq, sk, causal, window):
    """The GPU tests' independent counts of rows that see no key and keys no row sees."""
    from gpu_support import empty_rows, unseen_keys

    visible = visible_mask(sq, sk, window[0], 0 if causal else window[1])
    assert torch.equal(empty_rows(sq, sk, causal, window), ~visible.any(dim=1))
    assert torch.equal(unseen_keys(sq, sk, causal, window), ~visible.any(dim=0))


def test_the_baseline_rounds_a_value_or_a_gradient_to_the_kernel_dtype():
    from cute_fa.reference import _RoundGrad, _RoundValue

    fine = 1.0 + 2.0**-12  # not a bf16 value: rounds to 1.0
    x = torch.tensor([fine, 3.0], requires_grad=True)
    grad = torch.tensor([fine, -5.0])
    y = _RoundGrad.apply(x, torch.bfloat16)  # the value as is, its gradient rounded
    assert y.dtype == torch.float32 and torch.equal(y, x)
    y.backward(grad)
    assert torch.equal(x.grad, torch.tensor([1.0, -5.0]))
    x.grad = None
    y = _RoundValue.apply(x, torch.bfloat16)  # the value rounded, its gradient as is
    assert y.dtype == torch.float32 and torch.equal(y, torch.tensor([1.0, 3.0]))
    y.backward(grad)
    assert torch.equal(x.grad, grad)


@pytest.mark.parametrize("upcast,reorder_ops", [(True, False), (False, False), (False, True)])
def test_the_baseline_rounds_what_the_kernels_hold_in_16_bits(monkeypatch, upcast, reorder_ops):
    # Note [the kernel-precision baseline]: the baseline (upcast=False) rounds the gradients of
    # each query head's K and V (GQA) and of the scores to the input dtype, softcap's tanh to
    # fp16's 11 bits and P to the input dtype; the ground truth (upcast=True) rounds nothing
    from cute_fa import reference

    rounded = []
    for name in ("_RoundGrad", "_RoundValue"):
        fn = getattr(reference, name)

        def record(x, dtype, name=name, apply=fn.apply):
            rounded.append((name, tuple(x.shape), dtype))
            return apply(x, dtype)

        monkeypatch.setattr(fn, "apply", record)
    q, k, v = (rand(1, 3, n, 8, seed=s).bfloat16() for s, n in ((1, 4), (2, 2), (3, 2)))
    attention_ref(q, k, v, softcap=1.5, upcast=upcast, reorder_ops=reorder_ops)
    bf16 = torch.bfloat16
    expected = [
        ("_RoundGrad", (1, 3, 4, 8), bf16),  # K and V repeated to the 4 query heads
        ("_RoundGrad", (1, 3, 4, 8), bf16),
        ("_RoundGrad", (1, 4, 3, 3), bf16),  # the scores (dS)
        ("_RoundValue", (1, 4, 3, 3), torch.float16),  # tanh
        ("_RoundValue", (1, 4, 3, 3), bf16),  # P
    ]
    assert rounded == ([] if upcast else expected)


def test_merge_splits_of_key_ranges_is_attention_over_all_keys():
    # split-KV: attention over keys 0-2, 3-6 and 7-9, merged, is attention over the ten keys
    # (causal: the first row sees keys 0-6, none of the last split)
    q, k, v = rand(2, 4, 3, 8, seed=1), rand(2, 10, 3, 8, seed=2), rand(2, 10, 3, 16, seed=3)
    out, lse = attention_ref(q, k, v, causal=True)
    mask = visible_mask(4, 10, None, 0)
    parts = []
    for lo, hi in ((0, 3), (3, 7), (7, 10)):
        scores = torch.einsum("bthd,bshd->bhts", q, k[:, lo:hi]) / math.sqrt(8)
        scores = scores.masked_fill(~mask[:, lo:hi], float("-inf"))
        part_lse = torch.logsumexp(scores, dim=-1)  # -inf where a row sees none of them
        probs = torch.exp(scores - part_lse[..., None]).nan_to_num(nan=0.0)
        parts.append((torch.einsum("bhts,bshd->bthd", probs, v[:, lo:hi]), part_lse))
    out_partial = torch.stack([o.transpose(1, 2) for o, _ in parts])  # (split, b, h, t, d)
    lse_partial = torch.stack([lse_ for _, lse_ in parts])
    assert torch.isneginf(lse_partial[2, :, :, 0]).all()
    assert lse_partial[:, :, :, 1:].isfinite().all()
    merged, merged_lse = merge_splits(out_partial, lse_partial)
    assert merged.dtype == torch.float32 and merged.shape == (2, 3, 4, 16)
    torch.testing.assert_close(merged.transpose(1, 2), out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(merged_lse, lse, atol=1e-6, rtol=1e-5)


def test_merge_splits_weighs_by_lse_and_skips_empty_splits():
    # two rows, three splits of out 1, 2, 4 (bf16 in, fp32 out); row 0: LSEs log 1, log 3 and
    # -inf (a split that saw no key; its out is not read), row 1: every split -inf
    out_partial = torch.tensor([1.0, 2.0, 4.0]).view(3, 1, 1).expand(3, 2, 1).bfloat16()
    inf = float("inf")
    lse_partial = torch.tensor([[0.0, -inf], [math.log(3.0), -inf], [-inf, -inf]])
    out, lse = merge_splits(out_partial, lse_partial)
    assert out.dtype == torch.float32 and out.shape == (2, 1)
    torch.testing.assert_close(out, torch.tensor([[(1.0 + 3.0 * 2.0) / 4.0], [0.0]]))
    torch.testing.assert_close(lse, torch.tensor([math.log(4.0), -inf]))


def test_varlen_ref_matches_per_sequence():
    lens_q, lens_k = [3, 0, 5], [4, 2, 5]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q, k, v = rand(sum(lens_q), 2, 8, seed=1), rand(sum(lens_k), 1, 8, seed=2), rand(11, 1, 8)
    used_q = torch.tensor([2, 0, 5], dtype=torch.int32)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, seqused_q=used_q, causal=True)
    assert out.shape == (8, 2, 8) and lse.shape == (2, 8)
    o0, l0 = attention_ref(q[None, 0:2], k[None, 0:4], v[None, 0:4], causal=True)
    torch.testing.assert_close(out[0:2], o0[0])
    torch.testing.assert_close(lse[:, 0:2], l0[0])
    assert (out[2] == 0).all() and torch.isneginf(lse[:, 2]).all()  # past seqused_q
    o2, l2 = attention_ref(q[None, 3:8], k[None, 6:11], v[None, 6:11], causal=True)
    torch.testing.assert_close(out[3:8], o2[0])


@settings(max_examples=25, deadline=None)
@given(
    sq=st.integers(0, 5),
    sk=st.integers(0, 5),
    left=st.one_of(st.none(), st.integers(-4, 4)),
    right=st.one_of(st.none(), st.integers(-4, 4)),
    causal=st.booleans(),
    softcap=st.sampled_from([0.0, 1.5]),
)
def test_property_matches_naive(sq, sk, left, right, causal, softcap):
    q, k, v = rand(1, sq, 2, 8, seed=11), rand(1, sk, 1, 8, seed=12), rand(1, sk, 1, 8, seed=13)
    out, lse = attention_ref(q, k, v, causal=causal, window_size=(left, right), softcap=softcap)
    out_n, lse_n = naive_attention(q, k, v, causal=causal, window=(left, right), softcap=softcap)
    torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_n))
    finite = torch.isfinite(lse_n)
    torch.testing.assert_close(lse.double()[finite], lse_n[finite], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# check_close


def test_check_close_passes_within_twice_the_baseline():
    ref = torch.linspace(-1, 1, 100)
    pt = ref + 0.01
    check_close(ref + 0.019, ref, pt)
    with pytest.raises(AssertionError, match=r"max \|out - ref\|"):
        check_close(ref + 0.05, ref, pt)


def test_check_close_default_atol_is_a_few_ulps():
    ref = torch.ones(100)
    eps = torch.finfo(torch.bfloat16).eps
    one_off = ref.clone()
    one_off[3] += eps
    check_close(one_off.bfloat16(), ref, ref.bfloat16())  # exact baseline, 1 ulp off once: ok
    with pytest.raises(AssertionError, match="max"):
        check_close(ref + 10 * eps, ref, ref.bfloat16())
    # 1 ulp off in every element, where the baseline is exact: a bias, not rounding (RMS rule).
    with pytest.raises(AssertionError, match="rms"):
        check_close((ref + eps).bfloat16(), ref, ref.bfloat16())


def test_check_close_infinities_and_nan():
    ref = torch.tensor([float("-inf"), 1.0, 2.0])
    check_close(ref.clone(), ref, ref.clone(), name="lse")
    with pytest.raises(AssertionError, match="infinities differ"):
        check_close(torch.tensor([0.0, 1.0, 2.0]), ref, ref)
    with pytest.raises(AssertionError, match="infinities differ"):
        check_close(torch.tensor([float("-inf")] * 3), ref, ref)
    with pytest.raises(AssertionError, match="NaN"):
        check_close(torch.tensor([float("-inf"), float("nan"), 2.0]), ref, ref)


def test_check_close_shape_mismatch():
    with pytest.raises(AssertionError, match="shape"):
        check_close(torch.zeros(3), torch.zeros(4), torch.zeros(4))


def test_check_close_explicit_atol_bounds_the_rms_rule_too():
    """An fp32 tensor whose baseline is exact (an LSE: the kernel-precision baseline computes
    it in fp32) passes within the caller's atol by both rules; past it, it fails."""
    ref = torch.linspace(1.0, 9.0, 1000)
    noisy = ref + 1e-6 * torch.randn(1000)
    check_close(noisy, ref, ref.clone(), atol=1e-4, name="lse")
    with pytest.raises(AssertionError, match="lse: max"):
        check_close(ref + 2e-4, ref, ref.clone(), atol=1e-4, name="lse")
