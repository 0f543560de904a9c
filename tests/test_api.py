"""Public API: flash_attn.cute compatibility, window semantics, return convention, autograd.

CPU tests run the custom op on meta tensors (its fake implementation: shapes only); GPU tests
(marker ``gpu``) launch the kernel.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import cute_fa
from cute_fa import flash_attn_func, flash_attn_varlen_func, ops, settings
from cute_fa.checks import WINDOW_INF, resolve_window
from cute_fa.checks import kernel_window as _kernel_window

# flash_attn.cute's signatures (Dao-AILab/flash-attention, flash_attn/cute/interface.py), in
# order: the positional order matters for a drop-in.
FA_CUTE_FUNC = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty),
    ("v", inspect.Parameter.empty), ("qv", None), ("gather_kv_indices", None),
    ("softmax_scale", None), ("causal", False), ("window_size", (None, None)),
    ("learnable_sink", None), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None),
    ("deterministic", False), ("score_mod", None), ("score_mod_bwd", None), ("mask_mod", None),
    ("aux_tensors", None), ("aux_scalars", None), ("block_sparse_tensors", None),
    ("block_sparse_tensors_bwd", None), ("return_lse", False),
]  # fmt: skip
FA_CUTE_VARLEN = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty),
    ("v", inspect.Parameter.empty), ("qv", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
    ("max_seqlen_q", None), ("max_seqlen_k", None), ("min_seqlen_k", None), ("seqused_q", None),
    ("seqused_k", None), ("gather_kv_indices", None), ("page_table", None),
    ("softmax_scale", None), ("causal", False), ("window_size", (None, None)),
    ("learnable_sink", None), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None),
    ("deterministic", False), ("score_mod", None), ("score_mod_bwd", None), ("mask_mod", None),
    ("block_sparse_tensors", None), ("aux_tensors", None), ("aux_scalars", None),
    ("return_lse", False), ("scheduler_metadata", None), ("seqlen_k_per_split", None),
    ("disable_scheduler_metadata", False),
]  # fmt: skip


def meta(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=requires_grad)


def meta_qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64, requires_grad=False):
    return (
        meta(b, sq, h, d, requires_grad=requires_grad),
        meta(b, sk, hk, d, requires_grad=requires_grad),
        meta(b, sk, hk, d, requires_grad=requires_grad),
    )


@pytest.mark.parametrize(
    "fn,expected", [(flash_attn_func, FA_CUTE_FUNC), (flash_attn_varlen_func, FA_CUTE_VARLEN)]
)
def test_signature_matches_flash_attn_cute(fn, expected):
    params = inspect.signature(fn).parameters
    assert [(p.name, p.default) for p in params.values()] == expected


def test_package_exports():
    assert cute_fa.flash_attn_func is flash_attn_func
    assert cute_fa.flash_attn_varlen_func is flash_attn_varlen_func
    assert isinstance(cute_fa.__version__, str)


# --------------------------------------------------------------------------------------------
# Window semantics


@pytest.mark.parametrize(
    "causal,window,expected",
    [
        (False, (None, None), (False, False, None, None)),
        (True, (None, None), (True, False, None, 0)),
        (False, (None, 0), (True, False, None, 0)),  # (None, 0) is causal
        (True, (None, 7), (True, False, None, 0)),  # causal sets right = 0
        (True, (5, None), (False, True, 5, 0)),  # causal with a left bound: local
        (False, (5, None), (False, True, 5, None)),
        (False, (None, 3), (False, True, None, 3)),
        (False, (0, 0), (False, True, 0, 0)),
        (False, (-3, 5), (False, True, -3, 5)),  # negative ints are taken literally
        (False, (-1, -1), (False, True, -1, -1)),  # even when no key is left
        (False, None, (False, False, None, None)),
        (False, [4, 4], (False, True, 4, 4)),
    ],
)
def test_resolve_window(causal, window, expected):
    assert resolve_window(causal, window) == expected


def test_kernel_window_sentinels():
    assert _kernel_window(False, None, 0) == (0, 0)
    assert _kernel_window(True, None, 3) == (WINDOW_INF, 3)
    assert _kernel_window(True, 10**12, -(10**12)) == (WINDOW_INF, -WINDOW_INF)


@pytest.mark.compile
def test_window_sentinel_matches_the_kernels():
    from cute_fa.dsl.mask import WINDOW_INF as kernel_inf

    assert WINDOW_INF == kernel_inf


# --------------------------------------------------------------------------------------------
# Shapes and the return convention (fake implementation on meta tensors)


def test_shapes_and_lse_convention():
    q, k, v = meta_qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (2, 16, 4, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    out, lse = flash_attn_func(q, k, v)
    assert out.shape == (2, 16, 4, 64) and lse is None  # as flash_attn.cute


def test_lse_returned_when_an_input_requires_grad():
    q, k, v = meta_qkv(requires_grad=True)
    out, lse = flash_attn_func(q, k, v)
    assert lse is not None and out.requires_grad
    with torch.no_grad():
        out, lse = flash_attn_func(q, k, v)
    assert lse is None and not out.requires_grad


def test_varlen_shapes():
    q, k, v = meta(37, 4, 128), meta(50, 1, 128), meta(50, 1, 128)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=20, return_lse=True
    )
    assert out.shape == (37, 4, 128) and lse.shape == (4, 37)
    # packed q over batched k (cu_seqlens_k absent): k is (batch, seqlen_k, heads, d)
    kb, vb = meta(3, 9, 1, 128), meta(3, 9, 1, 128)
    out, lse = flash_attn_varlen_func(
        q, kb, vb, cu_seqlens_q=cu, max_seqlen_q=20, causal=True, return_lse=True
    )
    assert out.shape == (37, 4, 128) and lse.shape == (4, 37)
    # batched q with seqused_q/k (no cu_seqlens at all)
    qb = meta(3, 7, 4, 128)
    used = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = flash_attn_varlen_func(qb, kb, vb, seqused_q=used, seqused_k=used, return_lse=True)
    assert out.shape == (3, 7, 4, 128) and lse.shape == (3, 4, 7)


def test_checks_also_run_on_fake_tensors():
    q, k, v = meta_qkv()
    with pytest.raises(ValueError, match="nheads_kv|must agree"):
        flash_attn_func(q, k[:, :3], v)
    with pytest.raises(TypeError, match="differs from q.dtype"):
        flash_attn_func(q, k.half(), v)


def test_backward_on_meta_tensors_gives_gradient_shapes():
    q, k, v = meta_qkv(requires_grad=True)
    out, lse = flash_attn_func(q, k, v, causal=True)
    (out.sum() + lse.sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype


def test_backward_deterministic_runs_through_the_op():
    q, k, v = meta_qkv(requires_grad=True)
    out, _ = flash_attn_func(q, k, v, causal=True, deterministic=True)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_op_schema():
    schema = str(torch.ops.cute_fa.fwd.default._schema)
    for arg in (
        "Tensor? cu_seqlens_q",
        "Tensor? seqused_k",
        "int? window_left",
        "int? max_seqlen_q",
    ):
        assert arg in schema


# --------------------------------------------------------------------------------------------
# The launch path on CPU, with a stand-in for the device, its capability and the kernel


class FakeKernel:
    """Records each launch; writes 1 to out and 2 to lse unless ``write`` is False."""

    def __init__(self, write: bool = True):
        self.write = write
        self.launches = []
        self.configs = []

    def __call__(self, q, k, v, out, lse, scale, softcap, wl, wr, max_seqlen_q, *metadata):
        self.launches.append(
            dict(
                shapes=[tuple(t.shape) for t in (q, k, v, out, lse)],
                scalars=(scale, softcap, wl, wr, max_seqlen_q),
                metadata=metadata,
            )
        )
        if self.write:
            out.fill_(1.0)
            lse.fill_(2.0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors pass the device check, the device is an sm90, the kernel is a FakeKernel."""
    kernel = FakeKernel()

    def compiled_kernel(config):
        kernel.configs.append(config)
        return kernel

    monkeypatch.setattr(ops, "_plans", {})
    monkeypatch.setattr(ops, "device_of", lambda *named: named[0][0].device)
    monkeypatch.setattr(ops, "capability", lambda device: (9, 0))
    monkeypatch.setattr(ops, "sm_count", lambda device: 132)
    monkeypatch.setattr(ops, "tuned_table", lambda device: None)
    monkeypatch.setattr(ops, "_compiled_kernel", compiled_kernel)
    return kernel


def cpu_qkv(b=2, sq=16, sk=24, h=4, hk=2, d=64):
    return (
        torch.randn(b, sq, h, d).bfloat16(),
        torch.randn(b, sk, hk, d).bfloat16(),
        torch.randn(b, sk, hk, d).bfloat16(),
    )


def test_bench_variants_keep_their_own_plans(fake_gpu):
    """A tuning variant of the benchmark holds its override only while it runs and gets its own
    launch plans (plans are keyed by the tuning state), so the plain implementation never gets
    the variant's kernel or vice versa."""
    from cute_fa import tuned
    from cute_fa.tools import bench

    q, k, v = cpu_qkv(d=128)
    plain = bench.Impl("cute_fa")
    variant = bench.Impl("cute_fa:sm90_fwd.rescale_threshold=4")
    for impl in (plain, variant, plain, variant):
        with impl.context():
            impl.forward_fn(q, k, v, causal=False)()
        assert tuned.override_fields("sm90_fwd") == {}
    assert [c.tuning.rescale_threshold for c in fake_gpu.configs] == [0, 4]  # one plan each
    assert len(fake_gpu.launches) == 4 and len(ops._plans) == 2


def test_tuning_override_reaches_the_compile_key(fake_gpu):
    """``cute_fa.tuning`` sets fields of the call's tuning; outside the block the default
    returns; an unknown field is a TypeError, a value out of range a ValueError."""
    import cute_fa

    q, k, v = cpu_qkv(d=128)
    with cute_fa.tuning(sm90_fwd={"tile_n": 80, "pingpong": False}):
        flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    first, second = fake_gpu.configs
    assert (first.tile_n, first.tuning.pingpong) == (80, False)
    assert (second.tile_n, second.tuning.pingpong) == (128, True)
    with pytest.raises(TypeError, match="no field tile_x"):
        with cute_fa.tuning(sm90_fwd={"tile_x": 1}):
            pass
    with pytest.raises(ValueError, match="exp2_poly"):
        with cute_fa.tuning(sm90_fwd={"exp2_poly": 3}):
            flash_attn_func(q, k, v)


def test_launch_follows_the_kernel_protocol(fake_gpu):
    q, k, v = cpu_qkv()
    out, lse = flash_attn_func(q, k, v, causal=True, softcap=3.0, return_lse=True)
    assert (out == 1).all() and (lse == 2).all()
    (launch,) = fake_gpu.launches
    assert launch["shapes"] == [(2, 16, 4, 64), (2, 24, 2, 64), (2, 24, 2, 64), (2, 16, 4, 64),
                                (2, 4, 16)]  # fmt: skip
    assert launch["scalars"] == (pytest.approx(64**-0.5), 3.0, 0, 0, 16)
    # cu_seqlens q / k, seqused q / k, page_table
    assert launch["metadata"] == (None, None, None, None, None)
    (config,) = fake_gpu.configs
    # As many arguments as the protocol's fake arguments, less the stream (TVM-FFI's own).
    from cute_fa.dsl.fake import fwd_fake_args

    assert 10 + len(launch["metadata"]) == len(fwd_fake_args(config)) - 1
    assert config.target == "sm_90a" and config.head_dim == 64
    assert config.causal and config.has_softcap and not config.local

    flash_attn_func(q, k, v, window_size=(None, 5), softmax_scale=0.5)
    assert fake_gpu.launches[-1]["scalars"] == (0.5, 0.0, WINDOW_INF, 5, 16)
    assert fake_gpu.configs[-1].local


def test_varlen_launch(fake_gpu):
    lens = [3, 0, 5]
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    q, k = torch.randn(8, 4, 64).bfloat16(), torch.randn(8, 2, 64).bfloat16()
    out, lse = flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
    assert out.shape == (8, 4, 64) and lse.shape == (4, 8)
    assert (out == 1).all() and (lse == 2).all()  # the kernel wrote through the 4-D views
    launch = fake_gpu.launches[-1]
    assert launch["shapes"][0] == (1, 8, 4, 64) and launch["shapes"][4] == (1, 4, 8)
    assert launch["scalars"][-1] == max(lens)  # max_seqlen_q from cu_seqlens_q
    assert launch["metadata"][0] is cu and launch["metadata"][1] is cu
    flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7)
    assert fake_gpu.launches[-1]["scalars"][-1] == 7


def test_plans_are_reused_and_values_still_checked(fake_gpu):
    q, k, v = cpu_qkv()
    for _ in range(3):
        flash_attn_func(q, k, v, causal=True)
    assert len(fake_gpu.configs) == 1 and len(ops._plans) == 1
    assert len(fake_gpu.launches) == 3
    flash_attn_func(*cpu_qkv(sq=33), causal=True)  # a new signature: a new plan, same request
    assert len(ops._plans) == 2 and fake_gpu.configs[0] == fake_gpu.configs[1]

    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    qp, kp = torch.randn(8, 4, 64).bfloat16(), torch.randn(8, 2, 64).bfloat16()
    flash_attn_varlen_func(qp, kp, kp, cu_seqlens_q=cu, cu_seqlens_k=cu)
    bad = torch.tensor([0, 5, 3, 8], dtype=torch.int32)  # same signature, bad values
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        flash_attn_varlen_func(qp, kp, kp, cu_seqlens_q=bad, cu_seqlens_k=cu)
    flat = torch.empty(q.numel() + 8, dtype=q.dtype)
    q_off = flat[4 : 4 + q.numel()].view(q.shape)  # same signature, misaligned pointer
    with pytest.raises(ValueError, match="16-byte aligned"):
        flash_attn_func(q_off, k, v, causal=True)


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_plans_are_per_window(fake_gpu, varlen):
    """Two local windows of one signature and one compile key (local, causal off) get their own
    plans: each launch passes its own window."""
    if varlen:
        cu = torch.tensor([0, 16, 40], dtype=torch.int32)
        q, k = torch.randn(40, 4, 64).bfloat16(), torch.randn(40, 2, 64).bfloat16()

        def call(window):
            flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, window_size=window)
    else:
        q, k, v = cpu_qkv()

        def call(window):
            flash_attn_func(q, k, v, window_size=window)

    for window in [(64, 0), (32, 32), (64, 0)]:
        call(window)
    assert [launch["scalars"][2:4] for launch in fake_gpu.launches] == [(64, 0), (32, 32), (64, 0)]
    assert len(ops._plans) == 2 and fake_gpu.configs[0] == fake_gpu.configs[1]


def test_learnable_sink_on_another_device_fails_before_any_work(fake_gpu):
    """With the device check passing for q, k, v (fake_gpu), a sink on another device is the
    one error, raised before a launch."""
    q, k, v = cpu_qkv()
    sink = torch.zeros(q.shape[2], device="meta")
    with pytest.raises(ValueError, match="learnable_sink is on meta, q on cpu"):
        flash_attn_func(q, k, v, learnable_sink=sink)
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match="learnable_sink is on meta, q on cpu"):
        flash_attn_varlen_func(
            q.flatten(0, 1), k[:, :16].flatten(0, 1), v[:, :16].flatten(0, 1),
            cu_seqlens_q=cu, cu_seqlens_k=cu, learnable_sink=sink,
        )  # fmt: skip
    assert fake_gpu.launches == []


def test_rows_past_seqused_q_are_zero(fake_gpu):
    fake_gpu.write = False
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 4, 64).bfloat16()
    used = torch.tensor([1, 5], dtype=torch.int32)
    out, lse = flash_attn_varlen_func(
        q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=used, return_lse=True
    )
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert fake_gpu.launches[-1]["scalars"][-1] == 5  # the longest used query sequence


def test_nothing_to_launch(fake_gpu):
    q, k, v = cpu_qkv(sk=0)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    q, k, v = cpu_qkv(sq=0)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    assert fake_gpu.launches == [] and fake_gpu.configs == []


def test_unsupported_device_fails_before_any_work(fake_gpu, monkeypatch):
    monkeypatch.setattr(ops, "capability", lambda device: (7, 5))
    for sk in (24, 0):
        with pytest.raises(NotImplementedError, match="compute capability 8.0"):
            flash_attn_func(*cpu_qkv(sk=sk))
    assert fake_gpu.launches == [] and ops._plans == {}


# --------------------------------------------------------------------------------------------
# GPU


def _cuda_qkv(b=2, s=300, h=4, hk=2, d=128):
    return (
        torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16),
        torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16),
        torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16),
    )


@pytest.mark.gpu
def test_gpu_runs_on_the_current_stream():
    from cute_fa.reference import attention_ref, check_close

    q, k, v = _cuda_qkv()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        out_copy = out.clone()  # ordered after the kernel only if it ran on `side`
    torch.cuda.current_stream().wait_stream(side)
    out_ref, _ = attention_ref(q, k, v, causal=True)
    out_pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    check_close(out_copy, out_ref, out_pt)


@pytest.mark.gpu
def test_gpu_seqused_q_rows_are_zero():
    """Sequences of 5 and 9 queries (and keys), 2 and 9 of the queries used: rows 2-4 are 0 with
    LSE -inf, the used rows match attention_varlen_ref."""
    from cute_fa.reference import attention_varlen_ref, check_close

    cu = torch.tensor([0, 5, 14], dtype=torch.int32, device="cuda")
    q = torch.randn(14, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(14, 4, 64, device="cuda", dtype=torch.bfloat16)
    used_q = torch.tensor([2, 9], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(
        q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=used_q, return_lse=True
    )
    assert (out[2:5] == 0).all() and torch.isneginf(lse[:, 2:5]).all()
    out_ref, lse_ref = attention_varlen_ref(q, k, k, cu, cu, seqused_q=used_q)
    out_pt, lse_pt = attention_varlen_ref(
        q, k, k, cu, cu, seqused_q=used_q, upcast=False, reorder_ops=True
    )
    check_close(out, out_ref, out_pt)
    check_close(lse, lse_ref, lse_pt, atol=1e-4, name="lse")


def test_backward_kernels_are_looked_up_once_per_request(monkeypatch):
    """run_backward keeps (config, kernels) per request; CUTE_FA_BWD_ARCH still takes effect."""
    from cute_fa import backward
    from cute_fa.config import BwdConfig

    built = []

    class Cache:
        def get(self, key):
            built.append(key)
            return lambda *args: None

    for name in ("bwd_cache", "bwd_pre_cache", "bwd_post_cache"):
        monkeypatch.setattr(backward, name, lambda: Cache())
    monkeypatch.setattr(backward, "_launch_kernels", {})
    monkeypatch.setattr(backward, "capability", lambda device: (9, 0))
    monkeypatch.setattr(backward, "tuned_table", lambda device: None)
    monkeypatch.delenv(settings.BWD_ARCH, raising=False)
    q, k, v = cpu_qkv()
    out, lse = torch.zeros_like(q), torch.zeros(2, 4, 16)
    args = (q, k, v, out, lse, None, None, None, None, None, None, 0.125, True, None, None, 0.0)

    def run(deterministic=False):
        backward.run_backward(torch.ones_like(out), *args, deterministic)
        return [key for key in built if isinstance(key, BwdConfig)]  # main-kernel configs

    assert [c.arch for c in run()] == [90]
    assert len(run()) == 1 and len(built) == 3  # the second call looked nothing up
    assert [c.deterministic for c in run(deterministic=True)] == [False, True]
    monkeypatch.setenv(settings.BWD_ARCH, "80")
    assert [c.arch for c in run()] == [90, 90, 80]


def test_backward_runs_under_the_forwards_tuning(monkeypatch):
    """The autograd backward re-enters the ``cute_fa.tuning`` overrides active at the forward
    (autograd may run it on a worker thread that does not see the caller's context); here it
    runs after the block has closed."""
    import cute_fa
    from cute_fa import api, tuned

    seen = []

    def fake_fwd(q, k, v, *args):
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def fake_bwd(dout, q, k, v, *args):
        seen.append(tuned.override_fields("sm90_bwd"))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(api, "fwd_op", fake_fwd)
    monkeypatch.setattr(api, "bwd_op", fake_bwd)
    monkeypatch.setattr(api, "bwd_impl", fake_bwd)
    q, k, v = (t.requires_grad_() for t in cpu_qkv())
    with cute_fa.tuning(sm90_bwd={"q_stages": 3}):
        out, _ = flash_attn_func(q, k, v)
    out.sum().backward()
    assert seen == [{"q_stages": 3}] and tuned.override_fields("sm90_bwd") == {}
