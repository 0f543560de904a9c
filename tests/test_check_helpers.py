"""What the argument-normalising helpers and checks of cute_fa/checks.py return at their edges:
window and scale resolution, the Shapes of a call, max_seqlen_q without value checks, the one
device of a call, the edges of the stride, length and alignment checks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cute_fa import checks
from cute_fa.checks import WINDOW_INF

I32 = torch.int32


def test_window_args_without_a_window():
    for window in (None, (None, None)):
        assert checks.window_args(False, window) == (False, None, None)
        assert checks.window_args(True, window) == (True, None, 0)


def test_window_args_with_a_window():
    assert checks.window_args(False, (5, 5)) == (False, 5, 5)
    assert checks.window_args(True, (5, 5)) == (False, 5, 0)  # causal bounds the right side
    assert checks.window_args(False, [None, 0]) == (True, None, 0)  # a list is resolved too


def test_kernel_window():
    assert checks.kernel_window(False, 3, 4) == (0, 0)
    assert checks.kernel_window(True, 3, None) == (3, WINDOW_INF)
    assert checks.kernel_window(True, None, 4) == (WINDOW_INF, 4)
    big = 1 << 40
    assert checks.kernel_window(True, -big, big) == (-WINDOW_INF, WINDOW_INF)


def test_resolve_scale():
    assert checks.resolve_scale(None, 64) == 1 / 8
    assert checks.resolve_scale(None, 4) == 0.5
    assert checks.resolve_scale(None, 0) == 1.0  # no head dim: no scale (the checks reject it)
    assert checks.resolve_scale(-2.0, 64) == -2.0
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="softmax_scale must be finite"):
            checks.resolve_scale(bad, 64)


def test_resolve_softcap():
    assert checks.resolve_softcap(None) == 0.0
    assert checks.resolve_softcap(0.0) == 0.0
    assert checks.resolve_softcap(30.0) == 30.0
    for bad in (-1.0, math.inf):
        with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
            checks.resolve_softcap(bad)


def test_only_the_off_values_of_unimplemented_arguments_pass():
    checks.reject_unimplemented(num_splits=0, score_mod=None)
    checks.reject_unimplemented(num_splits=1)
    with pytest.raises(NotImplementedError, match="score_mod is not implemented"):
        checks.reject_unimplemented(score_mod=False)  # only None is "off"


# --------------------------------------------------------------------------------------------
# check_metadata's Shapes and request


def test_shapes_of_a_batched_call():
    q = torch.zeros(2, 16, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 24, 2, 64, dtype=torch.bfloat16)
    shapes = checks.check_metadata(q, k, k, None, None, None, None)
    assert shapes[:9] == (2, 16, 24, 4, 2, 64, 64, False, False)
    r = shapes.request
    assert (r.dtype, r.head_dim, r.head_dim_v) == ("bf16", 64, 64)
    assert (r.causal, r.local, r.has_softcap) == (False, False, False)
    assert (r.varlen_q, r.varlen_k, r.seqused_q, r.seqused_k) == (False, False, False, False)


def test_shapes_of_a_varlen_call():
    q = torch.zeros(8, 4, 64, dtype=torch.float16)
    k = torch.zeros(12, 2, 64, dtype=torch.float16)
    cu_q = torch.tensor([0, 3, 8], dtype=I32)
    cu_k = torch.tensor([0, 4, 12], dtype=I32)
    used = torch.tensor([1, 1], dtype=I32)
    shapes = checks.check_metadata(
        q, k, k, cu_q, cu_k, used, None, causal=True, local=False, softcap=0.5
    )
    assert shapes[:9] == (2, 8, 12, 4, 2, 64, 64, True, True)
    r = shapes.request
    assert (r.dtype, r.causal, r.local, r.has_softcap) == ("fp16", True, False, True)
    assert (r.varlen_q, r.varlen_k, r.seqused_q, r.seqused_k) == (True, True, True, False)
    kb = torch.zeros(2, 6, 2, 64, dtype=torch.float16)
    r = checks.check_metadata(q, kb, kb, cu_q, None, None, used, softcap=0.0).request
    assert (r.varlen_q, r.varlen_k, r.seqused_q, r.seqused_k, r.has_softcap) == (
        True, False, False, True, False,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_check_metadata_names_a_non_tensor(name):
    # (The API checks q, k, v first; check_metadata, which torch.compile's fake path runs
    # too, names them the same way.)
    args = dict(q=torch.zeros(1, 4, 2, 64), k=torch.zeros(1, 4, 2, 64), v=torch.zeros(1, 4, 2, 64))
    args[name] = (1.0,)
    with pytest.raises(TypeError) as info:
        checks.check_metadata(args["q"], args["k"], args["v"], None, None, None, None)
    assert str(info.value) == f"{name} must be a torch.Tensor, got tuple"


def test_a_varlen_call_of_no_sequences_passes_the_checks():
    q = torch.zeros(0, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(0, 2, 64, dtype=torch.bfloat16)
    cu = torch.zeros(1, dtype=I32)
    shapes = checks.check_metadata(q, k, k, cu, cu, None, None)
    assert (shapes.batch, shapes.seqlen_q, shapes.seqlen_k) == (0, 0, 0)
    assert checks.check_values_and_max_seqlen_q(shapes, cu, cu, None, None, None, True) == 0
    assert checks.check_values_and_max_seqlen_q(shapes, cu, cu, None, None, None, False) == 0


def test_strides_of_size_one_and_size_two_last_dims():
    one = torch.zeros(1, 4, 2, 16)[..., ::16]  # last dim of size 1: its stride does not matter
    checks.check_strides(one, "q")
    two = torch.zeros(1, 4, 2, 16)[..., ::8]
    with pytest.raises(ValueError, match="q must be contiguous in its last dim"):
        checks.check_strides(two, "q")
    # a single row or a single head does not excuse a strided head dim
    for shape in ((1, 1, 2, 128), (1, 16, 1, 128)):
        t = torch.zeros(shape)[..., ::2]
        with pytest.raises(ValueError, match="q must be contiguous in its last dim"):
            checks.check_strides(t, "q")


def test_int32_vector_contiguity_matters_from_two_entries():
    checks.check_int32_vector(torch.zeros(2, dtype=I32)[::2], "seqused_q", 1, "batch")
    with pytest.raises(ValueError, match="seqused_q must be contiguous, got stride 2"):
        checks.check_int32_vector(torch.zeros(4, dtype=I32)[::2], "seqused_q", 2, "batch")


def test_alignment_checks_only_tensors_with_elements():
    flat = torch.empty(16, dtype=torch.bfloat16)
    good = flat[:8]
    checks.check_alignment(flat[1:1], good, good)  # empty: no data to misread
    with pytest.raises(ValueError, match="q.data_ptr"):
        checks.check_alignment(flat[1:2], good, good)  # one element, 2 bytes off


# --------------------------------------------------------------------------------------------
# max_seqlen_q without the value checks (CUTE_FA_SKIP_CHECKS=1)


def _shapes(batch, seqlen_q, varlen_q):
    return SimpleNamespace(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_q, varlen_q=varlen_q)


@pytest.mark.parametrize("cu, longest", [([0, 3, 8], 5), ([0, 7], 7), ([0, 2, 2, 6, 7], 4)])
def test_max_seqlen_q_without_value_checks(cu, longest):
    cu = torch.tensor(cu, dtype=I32)
    shapes = _shapes(len(cu) - 1, int(cu[-1]), True)
    f = checks.check_values_and_max_seqlen_q
    assert f(shapes, cu, None, None, None, None, False) == longest
    assert f(shapes, cu, None, None, None, 99, False) == 99
    assert f(_shapes(2, 16, False), None, None, None, None, None, False) == 16


def test_max_seqlen_q_with_value_checks_and_batched_seqused_q():
    shapes = _shapes(2, 16, False)
    used = torch.tensor([3, 16], dtype=I32)
    f = checks.check_values_and_max_seqlen_q
    assert f(shapes, None, None, used, None, None, True) == 16


# --------------------------------------------------------------------------------------------
# device_of, with stand-ins for CUDA tensors (only .device is read)


def on(device: str):
    return SimpleNamespace(device=torch.device(device))


def test_device_of_returns_the_one_cuda_device():
    q, k = on("cuda:1"), on("cuda:1")
    assert checks.device_of((q, "q"), (None, "cu_seqlens_q"), (k, "k")) == torch.device("cuda:1")
    assert checks.device_of((None, "seqused_q"), (q, "q")) == torch.device("cuda:1")
    assert checks.device_of() is None


def test_device_of_names_a_tensor_on_another_device():
    args = ((on("cuda:0"), "q"), (None, "cu_seqlens_q"), (on("cuda:1"), "k"))
    with pytest.raises(ValueError) as info:
        checks.device_of(*args)
    assert str(info.value) == "k is on cuda:1 but q is on cuda:0: use one device"
    with pytest.raises(ValueError, match="runs on CUDA GPUs: v is on meta"):
        checks.device_of((on("cuda:0"), "q"), (on("meta"), "v"))
