"""Every input check of flash_attn_func / flash_attn_varlen_func, on CPU tensors.

Checks run in a fixed order (cute_fa/checks.py): metadata, alignment, sequence values, and
the device last, so a CPU tensor with a shape or dtype error reports that error, and a CPU
tensor with none reports that cute_fa needs a CUDA device.
"""

from __future__ import annotations

import math

import pytest
import torch

from cute_fa import api, checks, flash_attn_func, flash_attn_varlen_func
from cute_fa.reference import attention_ref

NEEDS_CUDA = "runs on CUDA GPUs"


def qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64, dv=None, dtype=torch.bfloat16):
    dv = d if dv is None else dv
    return (
        torch.randn(b, sq, h, d).to(dtype),
        torch.randn(b, sk, hk, d).to(dtype),
        torch.randn(b, sk, hk, dv).to(dtype),
    )


def packed(lens_q=(3, 0, 5), lens_k=(4, 2, 6), h=4, hk=2, d=64):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, d).bfloat16()
    k = torch.randn(sum(lens_k), hk, d).bfloat16()
    v = torch.randn(sum(lens_k), hk, d).bfloat16()
    return q, k, v, cu_q, cu_k


def test_valid_cpu_inputs_reach_the_device_check_last():
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_func(*qkv())
    q, k, v, cu_q, cu_k = packed()
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# --------------------------------------------------------------------------------------------
# Types and dtypes


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attn_func([1.0], k, v)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        flash_attn_func(q, k, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_dtype_not_16_bit(dtype):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(TypeError, match="q.dtype must be torch.float16 or torch.bfloat16"):
        flash_attn_func(q, k, v)


def test_dtypes_differ():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k.dtype \(torch.float16\) differs from q.dtype"):
        flash_attn_func(q, k.half(), v)
    with pytest.raises(TypeError, match="v.dtype"):
        flash_attn_func(q, k, v.half())


# --------------------------------------------------------------------------------------------
# Ranks and extents


def test_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q must be 4-D"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match="k must be 4-D"):
        flash_attn_func(q, k[0], v)
    pq, pk, pv, cu_q, cu_k = packed()
    with pytest.raises(ValueError, match="q must be 3-D .* with cu_seqlens_q"):
        flash_attn_varlen_func(q, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="v must be 3-D"):
        flash_attn_varlen_func(pq, pk, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_head_dim_mismatch_q_k():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k.shape\[-1\] \(32\) must equal q.shape\[-1\] \(64\)"):
        flash_attn_func(q, k[..., :32].contiguous(), v)


@pytest.mark.parametrize("d", [60, 4, 264, 512])
def test_head_dim_not_multiple_of_8_or_too_big(d):
    with pytest.raises(ValueError, match=r"head_dim \(q.shape\[-1\]\) must be a positive multiple"):
        flash_attn_func(*qkv(d=d))


def test_head_dim_v_invalid():
    with pytest.raises(ValueError, match=r"head_dim_v \(v.shape\[-1\]\)"):
        flash_attn_func(*qkv(d=64, dv=12))


@pytest.mark.parametrize("d,dv", [(64, 128), (40, 64), (128, 96), (256, 128)])
def test_head_dims_supported_by_no_kernel(d, dv):
    """Pairs of head dims no kernel takes raise NotImplementedError naming both (every
    multiple of 8 up to 256 alone is taken: Note [rounded head dims])."""
    with pytest.raises(NotImplementedError, match=f"head_dim={d}, head_dim_v={dv}"):
        flash_attn_func(*qkv(d=d, dv=dv))


@pytest.mark.parametrize("d,dv", [(8, 8), (40, 40), (80, 80), (160, 160), (248, 248), (128, 64)])
def test_rounded_head_dims_pass_the_checks(d, dv):
    """Every multiple of 8 up to 256 (and the sm80 pairs) passes the checks and planning on any
    machine: CPU tensors fail only at the device check."""
    with pytest.raises(ValueError, match="cute_fa runs on CUDA GPUs"):
        flash_attn_func(*qkv(d=d, dv=dv))


def test_heads():
    q, k, v = qkv(h=6, hk=4)
    with pytest.raises(ValueError, match=r"nheads \(6, q.shape\[-2\]\) must be a multiple of"):
        flash_attn_func(q, k, v)
    q, k, v = qkv(h=4, hk=2)
    with pytest.raises(ValueError, match="v has 1 heads, k has 2"):
        flash_attn_func(q, k, v[:, :, :1].contiguous())


def test_batch_and_seqlen_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k and v must agree in \(batch, seqlen_k\)"):
        flash_attn_func(q, k, v[:, :20].contiguous())
    with pytest.raises(ValueError, match=r"k and v must agree"):
        flash_attn_func(q, k, v[:1].contiguous())
    with pytest.raises(ValueError, match=r"k.shape\[0\] \(1\) must equal the batch size"):
        flash_attn_func(q, k[:1].contiguous(), v[:1].contiguous())
    pq, pk, pv, cu_q, cu_k = packed()
    with pytest.raises(ValueError, match="k and v must agree in total_k"):
        flash_attn_varlen_func(pq, pk, pv[:-1], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# --------------------------------------------------------------------------------------------
# Layout


def test_last_dim_not_contiguous():
    q, k, v = qkv(d=128)
    with pytest.raises(ValueError, match=r"q must be contiguous in its last dim"):
        flash_attn_func(q[..., ::2], k[..., ::2].contiguous(), v[..., ::2].contiguous())


def test_stride_not_multiple_of_8():
    big = torch.randn(2, 16, 4 * 64 + 4).bfloat16()
    q = big[..., : 4 * 64].view(2, 16, 4, 64)  # stride(1) = 260
    _, k, v = qkv(h=4, hk=2)
    with pytest.raises(ValueError, match=r"q.stride\(1\) = 260 is not a multiple of 8"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_head_stride_not_multiple_of_8(name):
    """Heads padded to 68 elements: q's strides are (4352, 272, 68, 1). Batch and sequence
    strides are multiples of 8, so only the head stride's check rejects it."""
    tensors = dict(zip("qkv", qkv(h=4, hk=4), strict=True))
    seqlen = tensors[name].shape[1]
    tensors[name] = torch.zeros(2, seqlen, 4, 68, dtype=torch.bfloat16)[..., :64]
    assert tensors[name].stride() == (seqlen * 272, 272, 68, 1)
    with pytest.raises(ValueError, match=rf"{name}.stride\(2\) = 68 is not a multiple of 8"):
        flash_attn_func(tensors["q"], tensors["k"], tensors["v"])


def test_views_with_good_strides_pass_the_layout_checks():
    qkv_packed = torch.randn(2, 16, 3, 4, 64).bfloat16()
    q, k, v = qkv_packed.unbind(2)
    assert not q.is_contiguous()
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_func(q, k, v)


def test_data_ptr_not_16_byte_aligned():
    q, k, v = qkv()
    flat = torch.empty(q.numel() + 8, dtype=q.dtype)
    q_off = flat[4 : 4 + q.numel()].view(q.shape)  # 8 bytes past an aligned start
    q_off.copy_(q)
    with pytest.raises(ValueError, match=r"q.data_ptr\(\) must be 16-byte aligned"):
        flash_attn_func(q_off, k, v)


# --------------------------------------------------------------------------------------------
# Sequence metadata


def test_cu_seqlens_dtype_rank_length():
    q, k, v, cu_q, cu_k = packed()
    with pytest.raises(TypeError, match="cu_seqlens_q must be torch.int32"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q.long(), cu_seqlens_k=cu_k)
    with pytest.raises(TypeError, match="cu_seqlens_k must be torch.int32"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k.long())
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q[None], cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q[:0], cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must have the same length"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q[:-1], cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous"):
        flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=torch.stack([cu_q, cu_q], 1)[:, 0], cu_seqlens_k=cu_k
        )


def test_cu_seqlens_values():
    q, k, v, cu_q, cu_k = packed()  # cu_q = [0, 3, 3, 8], cu_k = [0, 4, 6, 12]
    bad_start = cu_q + 1
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] must be 0, got 1"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=bad_start, cu_seqlens_k=cu_k)
    decreasing = torch.tensor([0, 4, 2, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be non-decreasing; cu_seqlens_k\[2\]"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=decreasing)
    short = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] \(7\) must equal total_q"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=short, cu_seqlens_k=cu_k)
    long = torch.tensor([0, 4, 6, 13], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] \(13\) must equal total_k"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=long)


def test_seqused():
    q, k, v, cu_q, cu_k = packed()  # room q: [3, 0, 5], room k: [4, 2, 6]
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(TypeError, match="seqused_k must be torch.int32"):
        flash_attn_varlen_func(q, k, v, seqused_k=torch.tensor([1, 1, 1]), **kw)
    with pytest.raises(ValueError, match=r"seqused_k must have 3 entries \(batch\), got 2"):
        flash_attn_varlen_func(q, k, v, seqused_k=torch.tensor([1, 1], dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 3 is outside \[0, 2\]"):
        used = torch.tensor([4, 3, 0], dtype=torch.int32)
        flash_attn_varlen_func(q, k, v, seqused_k=used, **kw)
    with pytest.raises(ValueError, match=r"seqused_q\[0\] = -1 is outside \[0, 3\]"):
        used = torch.tensor([-1, 0, 0], dtype=torch.int32)
        flash_attn_varlen_func(q, k, v, seqused_q=used, **kw)
    used = torch.tensor([3, 0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_varlen_func(q, k, v, seqused_q=used, seqused_k=used, **kw)


def test_seqused_with_batched_tensors():
    q, k, v = qkv(b=2, sq=16, sk=24)
    used_k = torch.tensor([24, 25], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 25 is outside \[0, 24\] \(seqlen_k"):
        flash_attn_varlen_func(q, k, v, seqused_k=used_k)
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_varlen_func(q, k, v, seqused_k=torch.tensor([0, 24], dtype=torch.int32))


def test_varlen_q_with_batched_k():
    q, _, _, cu_q, _ = packed()
    _, k, v = qkv(b=3)
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q)
    with pytest.raises(ValueError, match=r"k.shape\[0\] \(2\) must equal the batch size"):
        flash_attn_varlen_func(q, k[:2], v[:2], cu_seqlens_q=cu_q)


def test_max_seqlen_q():
    q, k, v, cu_q, cu_k = packed()
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(4\) is smaller than the longest"):
        flash_attn_varlen_func(q, k, v, max_seqlen_q=4, **kw)
    with pytest.raises(ValueError, match="max_seqlen_q must be >= 0"):
        flash_attn_varlen_func(q, k, v, max_seqlen_q=-1, **kw)
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_varlen_func(q, k, v, max_seqlen_q=5, max_seqlen_k=6, **kw)


def test_value_checks_can_be_skipped(monkeypatch):
    q, k, v, cu_q, cu_k = packed()
    monkeypatch.setattr(checks, "SKIP_VALUE_CHECKS", True)
    short = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=short, cu_seqlens_k=cu_k)


# --------------------------------------------------------------------------------------------
# Scalars and window


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), 5, (1.5, None), (None, True), ("a", 1)])
def test_window_size_type(window):
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(*qkv(), window_size=window)


def test_softcap_and_scale_values():
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        flash_attn_func(*qkv(), softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_func(*qkv(), softcap=float("inf"))
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        flash_attn_func(*qkv(), softmax_scale=float("nan"))


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_negative_scale_runs_on_negated_q(monkeypatch, varlen):
    """Note [softmax_scale the kernels take]: the kernels get -q and |scale|; through autograd
    that is attention with the negative scale, gradients included (the kernels replaced here
    by attention_ref, so this runs on the CPU)."""
    seen = []

    def fake_forward(requires_grad, q, k, v, *args, **kwargs):
        scale, causal = args[5], args[6]
        seen.append(scale)
        if varlen:
            q, k, v = q[None], k[None], v[None]
        out, lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
        return (out[0], lse[0]) if varlen else (out, lse)

    monkeypatch.setattr(api, "_forward", fake_forward)
    q, k, v = (t.requires_grad_() for t in qkv(b=1, sq=9, sk=13, h=2, hk=2))
    scale = -0.3
    if varlen:
        cu_q = torch.tensor([0, 9], dtype=torch.int32)
        cu_k = torch.tensor([0, 13], dtype=torch.int32)
        out, _ = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        softmax_scale=scale, causal=True)  # fmt: skip
        out = out[None]
    else:
        out, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    assert seen == [0.3]
    ref, _ = attention_ref(q, k, v, softmax_scale=scale, causal=True)
    # -q is exact in bf16 and (-q) k^T * 0.3 == q k^T * -0.3 in fp32: equal, not just close.
    assert torch.equal(out, ref)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.float().sum(), (q, k, v))
    for g, g_ref in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, g_ref)


def test_zero_scale_reaches_the_kernels_as_a_tiny_one(monkeypatch):
    """Note [softmax_scale the kernels take]: masked scores are -inf times the scale in the
    kernels, so 0 would make NaN; SCALE_FOR_ZERO gives the same weights (all 1) instead."""
    seen = []

    def fake_forward(requires_grad, q, k, v, *args, **kwargs):
        seen.append((q, args[5]))
        return attention_ref(q, k, v, softmax_scale=args[5], causal=args[6])

    monkeypatch.setattr(api, "_forward", fake_forward)
    q, k, v = qkv(b=1, sq=9, sk=13, h=2, hk=2)
    out, _ = flash_attn_func(q, k, v, softmax_scale=0.0, causal=True)
    assert seen[0][0] is q and seen[0][1] == checks.SCALE_FOR_ZERO
    ref, _ = attention_ref(q, k, v, softmax_scale=0.0, causal=True)
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------------------------
# flash_attn.cute arguments cute_fa does not implement yet

_SET = {
    "qv": torch.zeros(1),
    "gather_kv_indices": torch.zeros(1),
    "score_mod": lambda *a: a[0],
    "score_mod_bwd": lambda *a: a[0],
    "mask_mod": lambda *a: True,
    "aux_tensors": [torch.zeros(1)],
    "aux_scalars": (1.0,),
    "block_sparse_tensors": object(),
}


@pytest.mark.parametrize("name", [*_SET, "block_sparse_tensors_bwd"])
def test_unimplemented_arguments_flash_attn_func(name):
    value = _SET.get(name, object())
    with pytest.raises(NotImplementedError, match=f"{name} is not implemented yet"):
        flash_attn_func(*qkv(), **{name: value})


@pytest.mark.parametrize(
    "name", [*(n for n in _SET if n != "block_sparse_tensors"), "seqlen_k_per_split"],
)  # fmt: skip
def test_unimplemented_arguments_varlen(name):
    q, k, v, cu_q, cu_k = packed()
    value = _SET.get(name, {"seqlen_k_per_split": 128}.get(name, object()))
    with pytest.raises(NotImplementedError, match=f"{name} is not implemented yet"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **{name: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_splits=1),
        dict(num_splits=0),
        dict(num_splits=-1),
        dict(pack_gqa=False),
        dict(pack_gqa=None),
        dict(pack_gqa=True),
        dict(deterministic=True),
    ],
)
def test_off_values_of_unimplemented_arguments_are_accepted(kwargs):
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        flash_attn_func(*qkv(), **kwargs)


# --------------------------------------------------------------------------------------------
# GPU-only: the device check itself


@pytest.mark.gpu
def test_metadata_on_another_device():
    q, k, v, cu_q, cu_k = packed()
    q, k, v, cu_k = q.cuda(), k.cuda(), v.cuda(), cu_k.cuda()
    with pytest.raises(ValueError, match="cu_seqlens_q is on cpu"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.gpu
def test_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k is on cpu"):
        flash_attn_func(q.cuda(), k, v.cuda())


# --------------------------------------------------------------------------------------------
# learnable_sink (Note [learnable sink] in cute_fa/api.py)


def test_learnable_sink_checks():
    q, k, v = qkv()
    nheads = q.shape[-2]
    with pytest.raises(ValueError, match="shape"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(nheads + 1, device=q.device))
    with pytest.raises(TypeError, match="floating-point"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(nheads, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        flash_attn_func(q, k, v, learnable_sink=[0.0] * nheads)


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_learnable_sink_composition_matches_the_reference(packed):
    """The sink applied to (out, lse) of attention without it gives attention_ref's (out, lse)
    with it, and autograd through the composition gives its gradients of q, k, v and the
    sink (on the CPU, attention_ref standing in for the kernels)."""
    from cute_fa.api import _apply_learnable_sink

    g = torch.Generator().manual_seed(0)
    b, sq, sk, h, h_kv, d = 2, 7, 9, 4, 2, 16
    q, k, v = (torch.randn(b, s, n, d, generator=g, dtype=torch.float64)
               for s, n in ((sq, h), (sk, h_kv), (sk, h_kv)))  # fmt: skip
    sink = torch.randn(h, generator=g, dtype=torch.float64)
    sink[0] = -math.inf  # a head without a sink: unchanged rows
    dout = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    dlse = torch.randn(b, h, sq, generator=g, dtype=torch.float64)
    kw = dict(causal=True, upcast=False)  # causal with sq < sk; fp64 throughout

    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = attention_ref(*leaves[:3], **kw)
    if packed:  # the varlen layouts: out (total, h, d), lse (h, total)
        out_p, lse_p = _apply_learnable_sink(
            out.reshape(b * sq, h, d), lse.permute(1, 0, 2).reshape(h, b * sq), leaves[3]
        )
        out_s = out_p.reshape(b, sq, h, d)
        lse_s = lse_p.reshape(h, b, sq).permute(1, 0, 2)
    else:
        out_s, lse_s = _apply_learnable_sink(out, lse, leaves[3])
    grads = torch.autograd.grad((out_s, lse_s), leaves, (dout, dlse))

    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out_r, lse_r = attention_ref(*ref_leaves[:3], learnable_sink=ref_leaves[3], **kw)
    ref = torch.autograd.grad((out_r, lse_r), ref_leaves, (dout, dlse))
    # attention_ref applies the sink in fp32: fp32-level agreement (a wrong formula is off by O(1)).
    torch.testing.assert_close(out_s, out_r.to(out_s.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_s, lse_r.to(lse_s.dtype), rtol=1e-5, atol=1e-6)
    for got, want, name in zip(grads, ref, ("dq", "dk", "dv", "dsink"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_learnable_sink_rows_that_see_nothing():
    """A row that sees no key: out 0 and lse = sink (-inf lse and -inf sink: 0 and -inf)."""
    from cute_fa.api import _apply_learnable_sink

    out = torch.zeros(1, 2, 2, 4)
    lse = torch.full((1, 2, 2), -math.inf)
    sink = torch.tensor([0.25, -math.inf])
    out_s, lse_s = _apply_learnable_sink(out, lse, sink)
    assert (out_s == 0).all() and not torch.isnan(out_s).any()
    assert (lse_s[0, 0] == 0.25).all() and torch.isneginf(lse_s[0, 1]).all()
