"""The whole text of each input check's error: it names the argument, what was expected and what
was given, so the caller can fix the call from the message alone (cute_fa/checks.py).

test_checks.py covers which check fires in which order; these compare whole messages.
"""

from __future__ import annotations

import pytest
import torch

from cute_fa import checks, flash_attn_func, flash_attn_varlen_func

I32 = torch.int32


def qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64, dv=None):
    dv = d if dv is None else dv
    return (
        torch.randn(b, sq, h, d).bfloat16(),
        torch.randn(b, sk, hk, d).bfloat16(),
        torch.randn(b, sk, hk, dv).bfloat16(),
    )


def packed(lens_q=(3, 0, 5), lens_k=(4, 2, 6), h=4, hk=2, d=64):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=I32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=I32)
    q = torch.randn(sum(lens_q), h, d).bfloat16()
    k = torch.randn(sum(lens_k), hk, d).bfloat16()
    v = torch.randn(sum(lens_k), hk, d).bfloat16()
    return q, k, v, cu_q, cu_k


def message(exc_type, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# Types, ranks, head dims, heads


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_a_tensor_names_the_argument_and_the_type(name):
    args = dict(zip("qkv", qkv(), strict=True))
    args[name] = [1.0]
    assert message(TypeError, flash_attn_func, **args) == f"{name} must be a torch.Tensor, got list"


def test_rank_messages_name_the_layout_and_the_varlen_argument():
    q, k, v = qkv()
    assert message(ValueError, flash_attn_func, q, k[0], v) == (
        "k must be 4-D (batch, seqlen, nheads, head_dim) without cu_seqlens_k, "
        "got shape (24, 2, 64)"
    )
    assert message(ValueError, flash_attn_func, q, k, v[0]) == (
        "v must be 4-D (batch, seqlen, nheads, head_dim) without cu_seqlens_k, "
        "got shape (24, 2, 64)"
    )
    pq, pk, pv, cu_q, cu_k = packed()
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert message(ValueError, flash_attn_varlen_func, pq[None], pk, pv, **kw) == (
        "q must be 3-D (total, nheads, head_dim) with cu_seqlens_q, got shape (1, 8, 4, 64)"
    )
    assert message(ValueError, flash_attn_varlen_func, pq, pk, pv[None], **kw) == (
        "v must be 3-D (total, nheads, head_dim) with cu_seqlens_k, got shape (1, 12, 2, 64)"
    )


def test_head_dim_messages():
    q, k, _ = qkv()
    _, _, v = qkv(dv=12)
    assert message(ValueError, flash_attn_func, q, k, v) == (
        "head_dim_v (v.shape[-1]) must be a positive multiple of 8 and at most 256, got 12"
    )
    q0, k0, v0 = qkv(d=0)
    assert message(ValueError, flash_attn_func, q0, k0, v0) == (
        "head_dim (q.shape[-1]) must be a positive multiple of 8 and at most 256, got 0"
    )


def test_the_largest_head_dim_passes_the_metadata_checks():
    with pytest.raises(ValueError, match="runs on CUDA GPUs"):
        flash_attn_func(*qkv(d=checks.MAX_HEAD_DIM))


def test_head_count_messages():
    pq, pk, pv, cu_q, cu_k = packed()
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert message(ValueError, flash_attn_varlen_func, pq, pk, pv[:, :1], **kw) == (
        "v has 1 heads, k has 2; they must match"
    )
    q, k, v = qkv(h=0)
    assert message(ValueError, flash_attn_func, q, k, v) == (
        "need at least one head, got nheads=0, nheads_kv=2"
    )


# --------------------------------------------------------------------------------------------
# Sequence metadata


def test_cu_seqlens_messages():
    pq, pk, pv, cu_q, cu_k = packed()
    # (The torch op's schema turns away a non-tensor before the checks; check_metadata names it.)
    meta = checks.check_metadata
    assert message(TypeError, meta, pq, pk, pv, [0, 3], cu_k, None, None) == (
        "cu_seqlens_q must be a torch.Tensor, got list"
    )
    assert message(TypeError, meta, pq, pk, pv, cu_q, (0, 3), None, None) == (
        "cu_seqlens_k must be a torch.Tensor, got tuple"
    )
    assert message(
        ValueError, flash_attn_varlen_func, pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k[:3]
    ) == ("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got 4 and 3")
    q, _, _ = qkv(b=3)
    assert message(ValueError, flash_attn_varlen_func, q, pk, pv, cu_seqlens_k=cu_k[:, None]) == (
        "cu_seqlens_k must be 1-D (batch + 1), got shape (4, 1)"
    )
    assert message(ValueError, flash_attn_varlen_func, q, pk, pv, cu_seqlens_k=cu_k[:3]) == (
        "cu_seqlens_k must have 4 entries (batch + 1), got 3"
    )


def test_batch_size_message_names_its_source():
    q, k, v = qkv(b=2)
    _, k3, v3 = qkv(b=3)
    assert message(ValueError, flash_attn_func, q, k3, v3) == (
        "k.shape[0] (3) must equal the batch size (q.shape[0] = 2)"
    )
    pq, _, _, cu_q, _ = packed()
    assert message(ValueError, flash_attn_varlen_func, pq, k, v, cu_seqlens_q=cu_q) == (
        "k.shape[0] (2) must equal the batch size (len(cu_seqlens_q) - 1 = 3)"
    )


def test_seqused_shape_messages():
    q, k, v = qkv(b=2)
    assert message(TypeError, checks.check_metadata, q, k, v, None, None, [1, 1], None) == (
        "seqused_q must be a torch.Tensor, got list"
    )
    used = torch.ones(2, 1, dtype=I32)
    assert message(ValueError, flash_attn_varlen_func, q, k, v, seqused_q=used) == (
        "seqused_q must be 1-D (batch), got shape (2, 1)"
    )
    assert message(ValueError, flash_attn_varlen_func, q, k, v, seqused_q=used[:1, 0]) == (
        "seqused_q must have 2 entries (batch), got 1"
    )
    strided = torch.ones(4, dtype=I32)[::2]
    assert message(ValueError, flash_attn_varlen_func, q, k, v, seqused_q=strided) == (
        "seqused_q must be contiguous, got stride 2"
    )


def test_seqused_value_messages_name_the_room():
    q, k, v = qkv(b=2, sq=16, sk=24)
    used = torch.tensor([16, 20], dtype=I32)
    assert message(ValueError, flash_attn_varlen_func, q, k, v, seqused_q=used) == (
        "seqused_q[1] = 20 is outside [0, 16] (seqlen_q, q.shape[1] of sequence 1)"
    )
    pq, pk, pv, cu_q, cu_k = packed()  # room q: [3, 0, 5], room k: [4, 2, 6]
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    used = torch.tensor([0, 1, 0], dtype=I32)
    assert message(ValueError, flash_attn_varlen_func, pq, pk, pv, seqused_q=used, **kw) == (
        "seqused_q[1] = 1 is outside [0, 0] (its cu_seqlens_q extent of sequence 1)"
    )
    used = torch.tensor([0, 3, 0], dtype=I32)
    assert message(ValueError, flash_attn_varlen_func, pq, pk, pv, seqused_k=used, **kw) == (
        "seqused_k[1] = 3 is outside [0, 2] (its cu_seqlens_k extent of sequence 1)"
    )


def test_cu_seqlens_decreasing_message_quotes_both_entries():
    pq, pk, pv, _, cu_k = packed()
    cu_q = torch.tensor([0, 5, 3, 8], dtype=I32)
    assert message(
        ValueError, flash_attn_varlen_func, pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
    ) == ("cu_seqlens_q must be non-decreasing; cu_seqlens_q[2] = 3 < cu_seqlens_q[1] = 5")


# --------------------------------------------------------------------------------------------
# Window, alignment, device, unimplemented arguments, learnable_sink


@pytest.mark.parametrize(
    "window, text",
    [
        ((1.5, None), "window_size[0] must be an int or None, got 1.5"),
        ((None, True), "window_size[1] must be an int or None, got True"),
    ],
)
def test_window_side_messages(window, text):
    assert message(TypeError, flash_attn_func, *qkv(), window_size=window) == text


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_alignment_message_names_the_tensor(name):
    args = dict(zip("qkv", qkv(), strict=True))
    t = args[name]
    flat = torch.empty(t.numel() + 8, dtype=t.dtype)
    args[name] = flat[4 : 4 + t.numel()].view(t.shape)  # 8 bytes off
    text = message(ValueError, checks.check_alignment, args["q"], args["k"], args["v"])
    assert text.startswith(f"{name}.data_ptr() must be 16-byte aligned, got 0x")
    assert text.endswith(f"(a view at an odd offset?); pass {name}.clone()")


def test_device_messages(monkeypatch):
    q = torch.zeros(1)
    assert message(ValueError, checks.device_of, (q, "q")) == (
        "cute_fa runs on CUDA GPUs: q is on cpu; move the inputs to a CUDA device"
        + ("" if torch.cuda.is_available() else " (this torch build or machine has no CUDA)")
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert message(ValueError, checks.device_of, (q, "q")) == (
        "cute_fa runs on CUDA GPUs: q is on cpu; move the inputs to a CUDA device"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert message(ValueError, checks.device_of, (q, "k")) == (
        "cute_fa runs on CUDA GPUs: k is on cpu; move the inputs to a CUDA device"
        " (this torch build or machine has no CUDA)"
    )


def test_unimplemented_argument_message_quotes_the_value():
    long = "x" * 200
    assert message(NotImplementedError, checks.reject_unimplemented, score_mod=long) == (
        f"cute_fa: score_mod is not implemented yet (got {repr(long)[:80]}); the argument is "
        "accepted for flash_attn.cute compatibility, pass None"
    )
    text = message(NotImplementedError, checks.reject_unimplemented, aux_tensors=torch.zeros(2, 3))
    assert "(got a tensor of shape (2, 3))" in text


def test_learnable_sink_type_message():
    q, k, v = qkv()
    assert message(TypeError, flash_attn_func, q, k, v, learnable_sink=[0.0] * 4) == (
        "learnable_sink must be a torch.Tensor, got list"
    )
