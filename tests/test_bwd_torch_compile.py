"""The backward under torch.compile on the CPU: forward and backward trace into one graph each,
with exactly one ``cute_fa::fwd`` and one ``cute_fa::bwd`` and no graph break; the op's fake
implementation gives the gradients' shapes on meta/fake tensors (no kernel, no GPU)."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_fa import flash_attn_func, flash_attn_varlen_func

FWD = torch.ops.cute_fa.fwd.default
BWD = torch.ops.cute_fa.bwd.default


def meta(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=requires_grad)


class JointRecorder:
    """A torch.compile backend (AOTAutograd) that keeps the forward and backward FX graphs."""

    def __init__(self):
        self.fw, self.bw = [], []

        def keep(graphs):
            def compiler(gm, example_inputs):
                graphs.append(gm)
                return make_boxed_func(gm.forward)

            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.fw), bw_compiler=keep(self.bw))

    @staticmethod
    def calls(graphs, op):
        return [n for g in graphs for n in g.graph.nodes if n.target is op]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("use_lse", [False, True], ids=["out_only", "out_and_lse"])
@pytest.mark.parametrize(
    "causal,window", [(False, (None, None)), (True, (None, None)), (False, (64, 0))]
)
def test_fullgraph_forward_and_backward(causal, window, use_lse):
    rec = JointRecorder()

    def loss_fn(q, k, v):
        out, lse = flash_attn_func(
            q, k, v, causal=causal, window_size=window, softcap=3.0, return_lse=True
        )
        loss = out.float().square().sum()
        return loss + lse.sum() if use_lse else loss

    f = torch.compile(loss_fn, backend=rec.backend, fullgraph=True)
    q = meta(2, 128, 6, 64, requires_grad=True)
    k = meta(2, 256, 2, 64, requires_grad=True)
    v = meta(2, 256, 2, 64, requires_grad=True)
    f(q, k, v).backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
    assert len(rec.fw) == 1 and len(rec.bw) == 1
    assert len(rec.calls(rec.fw, FWD)) == 1 and len(rec.calls(rec.fw, BWD)) == 0
    (bwd,) = rec.calls(rec.bw, BWD)
    dlse = bwd.args[6]
    if use_lse:
        assert dlse is not None, "a used lse must send its gradient to the backward op"
    # An unused lse may reach the op as None or as zeros; either gives the same gradients.


def test_fullgraph_varlen_backward():
    rec = JointRecorder()

    def loss_fn(q, k, v, cu_q, cu_k):
        out, _ = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40, max_seqlen_k=50,
            causal=True,
        )  # fmt: skip
        return out.float().sum()

    f = torch.compile(loss_fn, backend=rec.backend, fullgraph=True)
    q = meta(100, 4, 128, requires_grad=True)
    k = meta(120, 2, 128, requires_grad=True)
    v = meta(120, 2, 128, requires_grad=True)
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    f(q, k, v, cu, cu.clone()).backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape
    (bwd,) = rec.calls(rec.bw, BWD)
    assert bwd.args[12] == 50, "max_seqlen_k must reach the backward op"


def test_compiled_module_forward_and_backward():
    """A small GQA attention module on meta tensors, compiled fullgraph: every parameter gets
    a gradient of its shape."""

    class Attn(torch.nn.Module):
        def __init__(self, dim=256, heads=4, kv_heads=2):
            super().__init__()
            self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
            self.q = torch.nn.Linear(dim, dim, bias=False)
            self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
            self.o = torch.nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q(x).view(b, s, self.heads, self.hd)
            k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
            out, _ = flash_attn_func(q, k, v, causal=True)
            return self.o(out.reshape(b, s, -1))

    model = Attn().to(device="meta", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled(meta(2, 96, 256)).float().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name


def test_fake_tensor_mode_backward():
    """Under FakeTensorMode (what torch.compile traces with) the backward op's fake gives the
    gradients' shapes and dtypes. (CPU fakes: the autograd engine needs a real CUDA runtime for
    CUDA ones.)"""
    with FakeTensorMode():
        q = torch.empty(2, 128, 8, 128, dtype=torch.float16, requires_grad=True)
        k = torch.empty(2, 300, 2, 128, dtype=torch.float16, requires_grad=True)
        out, lse = flash_attn_func(q, k, k, causal=True, return_lse=True)
        grads = torch.autograd.grad((out.sum(), lse.sum()), (q, k))
    assert grads[0].shape == q.shape and grads[0].dtype == torch.float16
    assert grads[1].shape == k.shape


def test_deterministic_traces():
    """deterministic=True goes through the same ops (a flag of cute_fa::bwd) and traces."""
    f = torch.compile(flash_attn_func, backend="aot_eager", fullgraph=True)
    q = meta(2, 64, 4, 64, requires_grad=True)
    out, _ = f(q, q.detach().clone(), q.detach().clone(), deterministic=True)
    (grad,) = torch.autograd.grad(out.sum(), (q,))
    assert grad.shape == q.shape


def test_noncontiguous_dout_shapes():
    q, k, v = (meta(2, 33, 4, 64, requires_grad=True) for _ in range(3))
    out, _ = flash_attn_func(q, k, v)
    dout = meta(2, 4, 33, 64).transpose(1, 2)  # a transposed gradient
    q_grad, k_grad, v_grad = torch.autograd.grad(out, (q, k, v), dout)
    assert q_grad.shape == q.shape and k_grad.shape == k.shape and v_grad.shape == v.shape


def test_bwd_fake_checks_shapes():
    q, k = meta(2, 32, 4, 64), meta(2, 48, 2, 64)
    out, lse = meta(2, 32, 4, 64), meta(2, 4, 32, dtype=torch.float32)
    base = (None, None, None, None, None, None, 0.125, True, None, 0, 0.0, False)
    with pytest.raises(ValueError, match="dout has shape"):
        BWD(meta(2, 31, 4, 64), q, k, k.clone(), out, lse, None, *base)
    with pytest.raises(ValueError, match="dlse has shape"):
        BWD(out.clone(), q, k, k.clone(), out, lse, meta(2, 4, 31, dtype=torch.float32), *base)


def test_opcheck_bwd():
    q, k = meta(2, 32, 4, 64), meta(2, 48, 2, 64)
    out, lse = meta(2, 32, 4, 64), meta(2, 4, 32, dtype=torch.float32)
    args = (out.clone(), q, k, k.clone(), out, lse, None, None, None, None, None, None, None,
            0.125, True, None, 0, 0.0, False)  # fmt: skip
    torch.library.opcheck(BWD, args)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    qp, kp = meta(40, 4, 64), meta(50, 2, 64)
    outp, lsep = meta(40, 4, 64), meta(4, 40, dtype=torch.float32)
    args = (outp.clone(), qp, kp, kp.clone(), outp, lsep, lsep.clone(), cu, cu.clone(), None,
            None, 30, 40, 0.125, False, 16, 16, 3.0, False)  # fmt: skip
    torch.library.opcheck(BWD, args)


def test_bwd_op_schema():
    schema = str(BWD._schema)
    for arg in ("Tensor? dlse", "int? max_seqlen_k", "bool deterministic", "float softcap"):
        assert arg in schema, arg
