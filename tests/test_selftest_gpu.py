"""The first-use self-check end to end on a GPU (marker ``gpu``): forced on for run-verified
variants (``CUTE_FA_SELFTEST=force``: on the H200 the sm90 and sm80 kernels), it compiles,
launches the check's problems, compares with the reference on the GPU, records the pass and
lets the call through; a deliberately wrong kernel (the real one launched with another softmax
scale) fails it; ``python -m cute_fa selftest`` prints its table. On a Blackwell GPU the same
module checks the sm100 variants without forcing (docs/blackwell.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cute_fa import flash_attn_func, ops, planning, selftest, settings
from cute_fa.compile import fwd_cache
from cute_fa.device import capability, sm_count
from cute_fa.planning import FwdRequest
from cute_fa.reference import attention_ref, check_close

pytestmark = pytest.mark.gpu


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A fresh record directory (the compile cache stays where the session put it)."""
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    ops.clear_plans()
    selftest.forget_loaded()
    yield tmp_path
    ops.clear_plans()
    selftest.forget_loaded()


def device_config(request: FwdRequest):
    device = torch.device("cuda", torch.cuda.current_device())
    _, config = planning.fwd_plan(capability(device), request, 1100)
    if getattr(config.tuning, "num_ctas", 0):
        config = config.with_tuning(num_ctas=sm_count(device))
    return device, config


def test_forced_check_passes_and_is_recorded(fresh, monkeypatch):
    monkeypatch.setenv(settings.SELFTEST, "force")
    q = torch.randn(2, 500, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 700, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    device, config = device_config(FwdRequest("bf16", 128, 128, causal=True))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    out_pt, lse_pt = attention_ref(q, k, v, causal=True, upcast=False, reorder_ops=True)
    check_close(out, out_ref, out_pt)
    check_close(lse, lse_ref, lse_pt, atol=1e-4, name="lse")
    key = selftest.record_key(device)
    data = json.loads(selftest.record_path(key).read_text())
    assert data["key"] == list(key)
    results = data["results"]
    assert results == {selftest.variant_key(config): "pass"}, (config.name, results)


@pytest.mark.parametrize(
    "flags",
    [{}, {"local": True}, {"has_softcap": True}, {"varlen_q": True, "varlen_k": True},
     {"varlen_q": True, "varlen_k": True, "causal": True},
     {"varlen_q": True, "varlen_k": True, "seqused_q": True, "seqused_k": True}],
    ids=lambda f: "+".join(f) or "plain",
)  # fmt: skip
@pytest.mark.parametrize("arch", [None, 80])
def test_run_check_passes_real_kernels(fresh, monkeypatch, flags, arch):
    """The check's layouts (dense, packed, window, softcap, seqused) against the run-verified
    kernels of this GPU: each passes."""
    if arch is not None:
        monkeypatch.setenv(settings.FWD_ARCH, str(arch))
    device, config = device_config(FwdRequest("bf16", 64, 64, **flags))
    ok, error = selftest.run_check(fwd_cache().get(config), config, device)
    assert ok, f"{config.name}: {error}"


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the sm90 forward packs GQA and pages K/V",
)
@pytest.mark.parametrize(
    "flags",
    [{"pack_gqa": 2}, {"pack_gqa": 8, "causal": True}, {"pack_gqa": 4, "split_kv": True},
     {"pack_gqa": 4, "varlen_q": True, "varlen_k": True, "seqused_q": True,
      "seqused_k": True}, {"page_size": 16, "seqused_k": True, "causal": True},
     {"page_size": 128}, {"page_size": 48, "pack_gqa": 2, "split_kv": True}],
    ids=lambda f: "+".join(f"{k}{v if v is not True else ''}" for k, v in f.items()),
)  # fmt: skip
def test_run_check_passes_packed_and_paged_kernels(fresh, flags):
    """Packed GQA and paged K/V variants: the check draws its problems with the compiled group
    size and pages its keys (shuffled pages)."""
    device, config = device_config(FwdRequest("bf16", 128, 128, **flags))
    assert (config.pack_gqa, config.page_size) == (flags.get("pack_gqa", 0),
                                                   flags.get("page_size", 0))  # fmt: skip
    ok, error = selftest.run_check(fwd_cache().get(config), config, device)
    assert ok, f"{config.name}: {error}"


def test_a_wrong_kernel_fails_the_check(fresh):
    device, config = device_config(FwdRequest("bf16", 128, 128))
    kernel = fwd_cache().get(config)

    def wrong_scale(q, k, v, out, lse, scale, *rest):
        kernel(q, k, v, out, lse, scale * 1.1, *rest)

    ok, error = selftest.run_check(wrong_scale, config, device)
    assert not ok and "300 rows" in error and "AssertionError" in error


def test_selftest_command(fresh):
    argv = [sys.executable, "-m", "cute_fa", "selftest", "--head-dims", "64,128", "--dtypes",
            "bf16", "--variants", "plain"]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "bf16 d128 plain" in run.stdout and "pass" in run.stdout
    again = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "pass (recorded)" in again.stdout


# --------------------------------------------------------------------------------------------
# The backward's check (forced on the run-verified sm90 and sm80 backward kernels)


def bwd_device_config(arch: int | None = None, **flags):
    from cute_fa.backward import _compiled
    from cute_fa.config import target_for_capability

    device = torch.device("cuda", torch.cuda.current_device())
    config = planning.bwd_config(
        target_for_capability(*capability(device)), "bf16", 64, 64, arch=arch, **flags
    )
    return device, _compiled(config, False)


@pytest.mark.parametrize("flags", [{}, {"causal": True}, {"local": True, "has_softcap": True},
                                   {"varlen_q": True, "varlen_k": True, "seqused_q": True,
                                    "seqused_k": True}, {"deterministic": True}],
                         ids=lambda f: "+".join(f) or "plain")  # fmt: skip
@pytest.mark.parametrize("arch", [None, 80])
def test_run_bwd_check_passes_real_kernels(fresh, flags, arch):
    from cute_fa.backward import _launch

    device, found = bwd_device_config(arch, **flags)
    ok, error = selftest.run_bwd_check(lambda *a: _launch(found, *a, dlse=None), found[0], device)
    assert ok, f"{found[0].name}: {error}"


def test_a_wrong_backward_fails_the_check(fresh):
    from cute_fa.backward import _launch

    device, found = bwd_device_config(causal=True)

    def wrong_scale(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, mq, mk, scale, *rest):
        return _launch(found, dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, mq, mk,
                       scale * 1.01, *rest, dlse=None)  # fmt: skip

    ok, error = selftest.run_bwd_check(wrong_scale, found[0], device)
    assert not ok and "300 rows" in error and "AssertionError" in error


def test_forced_bwd_check_is_recorded_and_the_call_goes_on(fresh, monkeypatch):
    from cute_fa import backward

    monkeypatch.setenv(settings.SELFTEST, "force")
    monkeypatch.setattr(backward, "_launch_kernels", {})
    q = torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 444, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    out, _ = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    o_ref, _ = attention_ref(*leaves, causal=True)
    ref = torch.autograd.grad(o_ref, leaves, dout.float())
    pt_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o_pt, _ = attention_ref(*pt_leaves, causal=True, upcast=False, reorder_ops=True)
    pt = torch.autograd.grad(o_pt, pt_leaves, dout)
    for g, r, p, name in zip(grads, ref, pt, ("dq", "dk", "dv"), strict=True):
        check_close(g, r, p, name=name)
    device, found = bwd_device_config(causal=True)
    results = json.loads(selftest.record_path(selftest.record_key(device)).read_text())["results"]
    assert results.get(selftest.variant_key(found[0])) == "pass", results
