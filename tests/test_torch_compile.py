"""torch.compile traces cute_fa without graph breaks (CPU: the op's fake implementation runs on
meta tensors, so no kernel is needed), and torch.library's own op checks pass."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_fa import flash_attn_func, flash_attn_varlen_func

FWD = torch.ops.cute_fa.fwd.default


def meta(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=requires_grad)


class Recorder:
    """A torch.compile backend that keeps the FX graphs and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def op_calls(self):
        return [n for g in self.graphs for n in g.graph.nodes if n.target is FWD]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "causal,window", [(False, (None, None)), (True, (None, None)), (False, (64, 0))]
)
def test_fullgraph_one_op(causal, window):
    backend = Recorder()
    f = torch.compile(flash_attn_func, backend=backend, fullgraph=True)
    q, k, v = meta(2, 128, 8, 64), meta(2, 256, 2, 64), meta(2, 256, 2, 64)
    out, lse = f(q, k, v, causal=causal, window_size=window, softcap=5.0, return_lse=True)
    assert out.shape == (2, 128, 8, 64) and lse.shape == (2, 8, 128)
    assert len(backend.graphs) == 1 and len(backend.op_calls()) == 1


def test_new_sequence_length_does_not_recompile():
    backend = Recorder()
    f = torch.compile(flash_attn_func, backend=backend, fullgraph=True, dynamic=True)
    # (batch and seqlen 0 or 1 are specialised by torch itself, and a seqlen equal to the head
    # dim shares its symbol: the test avoids both)
    for b, s in [(2, 100), (3, 1000), (5, 37)]:
        q = meta(b, s, 4, 128)
        out, _ = f(q, q.clone(), q.clone(), causal=True)
        assert out.shape == (b, s, 4, 128)
    assert len(backend.graphs) == 1


def test_varlen_fullgraph():
    backend = Recorder()
    f = torch.compile(flash_attn_varlen_func, backend=backend, fullgraph=True)
    q, k = meta(100, 4, 128), meta(120, 2, 128)
    cu_q = torch.empty(5, dtype=torch.int32, device="meta")
    cu_k = torch.empty(5, dtype=torch.int32, device="meta")
    out, lse = f(q, k, k.clone(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40,
                 causal=True, return_lse=True)  # fmt: skip
    assert out.shape == (100, 4, 128) and lse.shape == (4, 100)
    assert len(backend.graphs) == 1 and len(backend.op_calls()) == 1


def test_aot_eager_with_grad_traces_forward_and_backward():
    """With inputs that require grad the whole forward and backward trace in one graph each;
    the backward is the cute_fa::bwd op (its fake implementation runs on meta tensors)."""
    f = torch.compile(flash_attn_func, backend="aot_eager", fullgraph=True)
    q, k, v = (meta(2, 64, 4, 64, requires_grad=True) for _ in range(3))
    out, lse = f(q, k, v, causal=True)
    assert out.requires_grad and lse is not None
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape


def test_compile_under_no_grad_returns_no_lse():
    f = torch.compile(flash_attn_func, backend="aot_eager", fullgraph=True)
    q = meta(2, 64, 4, 64, requires_grad=True)
    with torch.no_grad():
        out, lse = f(q, q.detach().clone(), q.detach().clone())
    assert lse is None and not out.requires_grad


def test_checks_fire_while_tracing():
    """The op's ValueError surfaces while dynamo runs the fake implementation (dynamo wraps it
    in its TorchRuntimeError and names it in the message)."""
    from torch._dynamo.exc import TorchRuntimeError

    f = torch.compile(flash_attn_func, backend="aot_eager", fullgraph=True)
    q, k = meta(2, 64, 6, 64), meta(2, 64, 4, 64)
    wanted = r"ValueError\('nheads \(6, q\.shape\[-2\]\) must be a multiple of nheads_kv \(4"
    with pytest.raises(TorchRuntimeError, match=wanted):
        f(q, k, k.clone())


def test_fake_cuda_tensors():
    """FakeTensorMode with CUDA fakes works on a machine without CUDA."""
    with FakeTensorMode():
        q = torch.empty(2, 128, 8, 128, dtype=torch.float16, device="cuda")
        k = torch.empty(2, 300, 8, 128, dtype=torch.float16, device="cuda")
        out, lse = flash_attn_func(q, k, k, causal=True, return_lse=True)
    assert out.shape == (2, 128, 8, 128) and out.device.type == "cuda"
    assert lse.shape == (2, 8, 128) and lse.dtype == torch.float32


def test_opcheck():
    q, k = meta(2, 32, 4, 64), meta(2, 48, 2, 64)
    args = (q, k, k.clone(), None, None, None, None, None, 0.125, True, None, 0, 0.0)
    torch.library.opcheck(FWD, args)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    qp, kp = meta(40, 4, 64), meta(50, 2, 64)
    args = (qp, kp, kp.clone(), cu, cu.clone(), None, None, 30, 0.125, False, 16, 16, 3.0)
    torch.library.opcheck(FWD, args)


def test_learnable_sink_traces_with_forward_and_backward():
    """The sink's torch ops (Note [learnable sink]) trace in the same graphs, and the sink gets
    a gradient beside q, k and v."""
    f = torch.compile(flash_attn_func, backend="aot_eager", fullgraph=True)
    q, k, v = (meta(2, 64, 4, 64, requires_grad=True) for _ in range(3))
    sink = torch.zeros(4, device="meta", requires_grad=True)
    out, lse = f(q, k, v, causal=True, learnable_sink=sink)
    assert out.shape == (2, 64, 4, 64) and lse.shape == (2, 4, 64)
    (out.float().sum() + lse.sum()).backward()
    for t in (q, k, v, sink):
        assert t.grad is not None and t.grad.shape == t.shape
