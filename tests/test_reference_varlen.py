"""attention_varlen_ref against attention_ref, one sequence at a time: the rows and keys each
sequence uses (seqused_q / seqused_k), the output dtype (upcast) and the rows it leaves unused."""

from __future__ import annotations

import pytest
import torch

from cute_fa.reference import attention_ref, attention_varlen_ref

I32 = torch.int32


def packed(lens_q, lens_k, h=2, hk=1, d=16):
    torch.manual_seed(0)
    q = torch.randn(sum(lens_q), h, d).bfloat16()
    k = torch.randn(sum(lens_k), hk, d).bfloat16()
    v = torch.randn(sum(lens_k), hk, d).bfloat16()
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("upcast", [True, False])
def test_varlen_ref_uses_the_used_rows_and_keys_of_each_sequence(upcast):
    lens_q, lens_k = (3, 5, 4), (6, 2, 7)
    used_q, used_k = [2, 5, 1], [4, 2, 3]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    out, lse = attention_varlen_ref(
        q, k, v, cu_q, cu_k,
        seqused_q=torch.tensor(used_q, dtype=I32), seqused_k=torch.tensor(used_k, dtype=I32),
        upcast=upcast,
    )  # fmt: skip
    assert out.dtype == (torch.float32 if upcast else torch.bfloat16)
    assert lse.dtype == torch.float32 and lse.shape == (2, sum(lens_q))
    assert out.shape == (sum(lens_q), 2, 16)
    for b in range(3):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        o, l_ = attention_ref(
            q[None, q0 : q0 + used_q[b]], k[None, k0 : k0 + used_k[b]],
            v[None, k0 : k0 + used_k[b]], upcast=upcast,
        )  # fmt: skip
        torch.testing.assert_close(out[q0 : q0 + used_q[b]], o[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, q0 : q0 + used_q[b]], l_[0], rtol=0, atol=0)
        rest = slice(q0 + used_q[b], q0 + lens_q[b])
        assert (out[rest] == 0).all() and (lse[:, rest] == float("-inf")).all()


def test_varlen_ref_without_seqused_uses_every_row_and_key():
    lens_q, lens_k = (3, 5, 4), (6, 2, 7)  # a middle sequence: its rows end before the last's
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    assert out.dtype == torch.float32
    for b in range(3):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        o, l_ = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True)
        torch.testing.assert_close(out[q0:q1], o[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, q0:q1], l_[0], rtol=0, atol=0)


def test_varlen_ref_lse_is_fp32_whatever_the_default_dtype():
    q, k, v, cu_q, cu_k = packed((3, 2), (4, 0))  # the second sequence's rows keep their -inf
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k)
    finally:
        torch.set_default_dtype(default)
    assert lse.dtype == torch.float32 and out.dtype == torch.float32
    assert (lse[:, 3:] == float("-inf")).all()
