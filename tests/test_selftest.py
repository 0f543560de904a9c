"""The first-use self-check (cute_fa/selftest.py) and its place in dispatch, on CPU: a stand-in
for the device (a "B200" of capability 10.0) and kernels that are right (the reference) or
deliberately wrong."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from cute_fa import flash_attn_func, flash_attn_varlen_func, ops, planning, selftest, settings
from cute_fa.planning import FwdRequest
from cute_fa.reference import attention_ref, attention_varlen_ref
from cute_fa.settings import SettingError


class RefKernel:
    """The forward protocol computed by the reference at the kernels' precision (passes the
    check); ``wrong=True`` writes 1 to out and 2 to lse instead (fails it)."""

    def __init__(self, config, wrong: bool = False):
        self.config = config
        self.wrong = wrong
        self.launches = 0

    def __call__(self, q, k, v, out, lse, scale, softcap, wl, wr, max_seqlen_q,
                 cu_q, cu_k, used_q, used_k, page_table=None):  # fmt: skip
        self.launches += 1
        if self.wrong:
            out.fill_(1.0)
            lse.fill_(2.0)
            return
        c = self.config
        if c.split_kv:
            # Split-KV partials (cute_fa/ops.py, Note [split-KV launches]): the whole result as
            # split 0, empty splits after it (O 0, LSE -inf), which the merge ignores.
            first = 1 if c.varlen_q else q.shape[0]
            assert out.shape[0] == selftest.CHECK_SPLITS * first
            out[first:] = 0.0
            lse[first:] = -float("inf")
            out, lse = out[:first], lse[:first]
        window = (wl, wr) if c.local else (None, 0) if c.causal else (None, None)
        kw = dict(softmax_scale=scale, window_size=window, softcap=softcap, upcast=False,
                  reorder_ops=True)  # fmt: skip
        if c.varlen_q or c.varlen_k:
            assert c.varlen_q and c.varlen_k, "the stand-in takes varlen on both sides"
            o, lv = attention_varlen_ref(q[0], k[0], v[0], cu_q, cu_k, seqused_q=used_q,
                                         seqused_k=used_k, **kw)  # fmt: skip
            out[0].copy_(o)
            lse[0].copy_(lv)
        else:
            o, lv = attention_ref(q, k, v, **kw)
            out.copy_(o)
            lse.copy_(lv)


@pytest.fixture
def device(monkeypatch, tmp_path):
    """CPU tensors pass the device check; the device is a "Fake B200" (capability 10.0); the
    record goes to a fresh cache directory; ``device.kernels`` maps a config to its kernel,
    ``device.wrong`` names the families whose kernels are wrong."""

    class Device:
        capability = (10, 0)
        wrong: set[int] = set()
        wrong_split = False
        kernels: dict = {}

    dev = Device()

    def compiled_kernel(config):
        if config not in dev.kernels:
            wrong = config.arch in dev.wrong or (config.split_kv and dev.wrong_split)
            dev.kernels[config] = RefKernel(config, wrong=wrong)
        return dev.kernels[config]

    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(settings.SELFTEST, raising=False)
    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    monkeypatch.setattr(ops, "_plans", {})
    monkeypatch.setattr(ops, "device_of", lambda *named: named[0][0].device)
    monkeypatch.setattr(ops, "capability", lambda _: dev.capability)
    monkeypatch.setattr(ops, "sm_count", lambda _: 148)
    monkeypatch.setattr(ops, "tuned_table", lambda _: None)
    monkeypatch.setattr(ops, "_compiled_kernel", compiled_kernel)
    monkeypatch.setattr(selftest, "gpu_name", lambda _: "Fake B200")
    selftest.forget_loaded()
    yield dev
    selftest.forget_loaded()


def qkv(sq=40, sk=40, h=4, hk=2, d=128):
    return (torch.randn(1, sq, h, d).bfloat16(), torch.randn(1, sk, hk, d).bfloat16(),
            torch.randn(1, sk, hk, d).bfloat16())  # fmt: skip


def kernels_of(dev, arch):
    return [k for c, k in dev.kernels.items() if c.arch == arch]


def new_process():
    """What a later process starts with: no plans, no records or warnings read."""
    ops.clear_plans()
    selftest.forget_loaded()


def record_file():
    key = selftest.record_key(torch.device("cpu"))
    return selftest.record_path(key)


def test_needs_check_by_family_and_target(monkeypatch):
    monkeypatch.delenv(settings.SELFTEST, raising=False)
    sm100 = planning.fwd_plan((10, 0), FwdRequest("bf16", 128, 128))[1]
    sm90 = planning.fwd_plan((9, 0), FwdRequest("bf16", 128, 128))[1]
    assert sm100.arch == 100 and sm90.arch == 90
    assert selftest.needs_check(sm100) and not selftest.needs_check(sm90)
    for capability, checked in [((8, 0), False), ((8, 6), True), ((8, 9), True),
                                ((12, 0), True)]:  # fmt: skip
        config = planning.fwd_plan(capability, FwdRequest("bf16", 256, 256))[1]
        assert config.arch == 80 and selftest.needs_check(config) is checked, capability
    # d 256 on sm100: the one-Q-tile sm100 forward, checked like every sm100 variant.
    config = planning.fwd_plan((10, 0), FwdRequest("bf16", 256, 256))[1]
    assert config.arch == 100 and config.tile_m == 128 and selftest.needs_check(config)
    with selftest.forced(90):
        assert selftest.needs_check(sm90)
    assert not selftest.needs_check(sm90)
    monkeypatch.setenv(settings.SELFTEST, "force")
    assert selftest.needs_check(sm90)
    monkeypatch.setenv(settings.SELFTEST, "0")
    assert not selftest.needs_check(sm100)
    monkeypatch.setenv(settings.SELFTEST, "sometimes")
    with pytest.raises(SettingError, match="CUTE_FA_SELFTEST"):
        selftest.needs_check(sm100)


VARIANTS = [
    {},
    {"causal": True},
    {"local": True},
    {"has_softcap": True},
    {"varlen_q": True, "varlen_k": True},
    {"varlen_q": True, "varlen_k": True, "causal": True},
    {"varlen_q": True, "varlen_k": True, "seqused_q": True, "seqused_k": True},
]


@pytest.mark.parametrize("flags", VARIANTS, ids=lambda f: "+".join(f) or "plain")
def test_run_check_passes_a_right_kernel_and_fails_a_wrong_one(flags):
    """The check's problems in each variant's layout (dense or packed, window, softcap,
    seqused): the reference passes, a kernel that writes constants fails naming the problem."""
    config = planning.fwd_plan((8, 0), FwdRequest("bf16", 64, 64, **flags))[1]
    kernel = RefKernel(config)
    assert selftest.run_check(kernel, config, torch.device("cpu")) == (True, "")
    assert kernel.launches == len(selftest.CHECK_PROBLEMS)
    ok, error = selftest.run_check(RefKernel(config, wrong=True), config, torch.device("cpu"))
    assert not ok and error.startswith("300 rows, 2 heads / 2 kv heads: AssertionError: ")


def test_run_check_reports_a_kernel_that_raises():
    config = planning.fwd_plan((10, 0), FwdRequest("bf16", 128, 128))[1]

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    ok, error = selftest.run_check(broken, config, torch.device("cpu"))
    assert not ok and "RuntimeError: CUDA error: an illegal memory access" in error


def test_a_kernel_that_leaves_rows_unwritten_fails():
    """The output is poisoned with NaN before the launch: a kernel that skips the tail fails."""
    config = planning.fwd_plan((10, 0), FwdRequest("bf16", 128, 128))[1]
    right = RefKernel(config)

    def skips_the_tail(q, k, v, out, lse, *rest):
        full_out, full_lse = out.clone(), lse.clone()
        right(q, k, v, full_out, full_lse, *rest)
        out[:, :256].copy_(full_out[:, :256])
        lse[..., :256].copy_(full_lse[..., :256])

    ok, error = selftest.run_check(skips_the_tail, config, torch.device("cpu"))
    assert not ok and "NaN" in error


def test_pass_runs_once_and_is_recorded(device):
    q, k, v = qkv()
    out, _ = flash_attn_func(q, k, v, causal=True)
    (sm100,) = kernels_of(device, 100)
    assert sm100.config.causal and not kernels_of(device, 80)
    assert sm100.launches == len(selftest.CHECK_PROBLEMS) + 1  # the check, then the call
    data = json.loads(record_file().read_text())
    assert data["key"] == ["Fake B200", data["key"][1], data["key"][2]]
    assert data["results"] == {selftest.variant_key(sm100.config): "pass"}
    flash_attn_func(*qkv(sq=77, sk=77), causal=True)  # another signature: the same variant
    assert sm100.launches == len(selftest.CHECK_PROBLEMS) + 2
    new_process()
    flash_attn_func(q, k, v, causal=True)
    assert sm100.launches == len(selftest.CHECK_PROBLEMS) + 3  # the record: no check


def test_fail_warns_once_records_and_falls_back_to_sm80(device):
    device.wrong = {100}
    q, k, v = qkv()
    with pytest.warns(RuntimeWarning) as caught:
        out, lse = flash_attn_func(q, k, v, return_lse=True)
    (warning,) = [w for w in caught if "self-check" in str(w.message)]
    text = str(warning.message)
    assert "fwd_sm100_sm_100a_bf16_d128" in text and "failed its first-use self-check" in text
    assert "Fake B200" in text and "AssertionError" in text and "fwd_sm80_sm_100a" in text
    (sm100,) = kernels_of(device, 100)
    (sm80,) = kernels_of(device, 80)
    assert sm100.launches == 1  # the first problem failed: no more launches of it
    assert sm80.launches == 1  # the call ran on the sm80 kernel (which needs no check here)
    out_ref, lse_ref = attention_ref(q, k, v, upcast=False, reorder_ops=True)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    result = json.loads(record_file().read_text())["results"][selftest.variant_key(sm100.config)]
    assert result.startswith("fail: 300 rows") and "AssertionError" in result
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_func(*qkv(sq=90, sk=90))  # same variant: no new warning, no new check
    assert sm100.launches == 1 and sm80.launches == 2
    new_process()  # a later process: the record says fail; one warning, no check
    with pytest.warns(RuntimeWarning, match="recorded in .*selftest"):
        flash_attn_func(q, k, v)
    assert sm100.launches == 1 and sm80.launches == 3


def test_varlen_call_falls_back_too(device):
    device.wrong = {100}
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    q, k = torch.randn(70, 4, 64).bfloat16(), torch.randn(70, 2, 64).bfloat16()
    with pytest.warns(RuntimeWarning, match="fwd_sm100.*varlen_q_varlen_k"):
        out, _ = flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out_ref, _ = attention_varlen_ref(q, k, k, cu, cu)
    assert (out.float() - out_ref).abs().max() < 0.05
    assert [c.arch for c in device.kernels] == [100, 80]


def test_setting_off_skips_the_check(device, monkeypatch):
    device.wrong = {100}
    monkeypatch.setenv(settings.SELFTEST, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_func(*qkv())
    (sm100,) = kernels_of(device, 100)
    assert sm100.launches == 1 and not kernels_of(device, 80)
    assert not record_file().exists()


def test_force_checks_a_run_verified_family(device, monkeypatch):
    """CUTE_FA_SELFTEST=force (or ``selftest.forced``) checks the sm90 kernels on an sm90 GPU."""
    device.capability = (9, 0)
    monkeypatch.setenv(settings.SELFTEST, "force")
    flash_attn_func(*qkv())
    (sm90,) = kernels_of(device, 90)
    assert sm90.launches == len(selftest.CHECK_PROBLEMS) + 1
    assert json.loads(record_file().read_text())["results"] == {
        selftest.variant_key(sm90.config): "pass"
    }
    monkeypatch.delenv(settings.SELFTEST)
    new_process()
    device.wrong = {90}
    device.kernels.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_func(*qkv())  # not forced: no check
        with selftest.forced(90):
            flash_attn_func(*qkv(sq=50))  # forced, but the recorded pass stands
    assert [c.arch for c in device.kernels] == [90]
    record_file().unlink()  # a machine without the record
    new_process()
    with selftest.forced(90), pytest.warns(RuntimeWarning, match="fwd_sm90.*fwd_sm80"):
        flash_attn_func(*qkv())
    assert [c.arch for c in device.kernels] == [90, 80]


def test_forced_check_runs_again_after_a_recorded_pass_only_with_force(device):
    config = planning.fwd_plan((10, 0), FwdRequest("bf16", 64, 64))[1]
    cpu = torch.device("cpu")
    assert selftest.check(RefKernel(config), config, cpu) == ("pass", True)
    assert selftest.check(RefKernel(config, wrong=True), config, cpu) == ("pass", False)
    result, ran = selftest.check(RefKernel(config, wrong=True), config, cpu, force=True)
    assert ran and result.startswith("fail: ")


def test_sm80_failing_on_a_small_smem_gpu_has_no_fallback(device):
    device.capability = (8, 6)
    device.wrong = {80}
    with pytest.raises(selftest.SelfCheckError, match="fwd_sm80_sm_86.*no other kernel"):
        flash_attn_func(*qkv())


def test_record_is_keyed_and_robust(device, monkeypatch):
    config = planning.fwd_plan((10, 0), FwdRequest("bf16", 64, 64))[1]
    cpu = torch.device("cpu")
    selftest.check(RefKernel(config), config, cpu)
    path = record_file()
    assert path.parent.name == "selftest" and path.name.startswith("fake-b200-driver")
    assert selftest.record_key(cpu).fingerprint in path.name
    path.write_text("{ truncated")  # a broken record is ignored and the check runs again
    new_process()
    assert selftest.check(RefKernel(config), config, cpu) == ("pass", True)
    other = selftest.RecordKey("Fake B200", 1, "0" * 16)  # another driver: its own file
    assert selftest.record_path(other) != path and selftest.results(other) == {}
    monkeypatch.setenv(settings.CACHE, "0")  # disk cache off: kept for the process only
    new_process()
    path.unlink()
    assert selftest.check(RefKernel(config), config, cpu) == ("pass", True)
    assert selftest.check(RefKernel(config), config, cpu) == ("pass", False)
    assert not path.exists()


def test_selftest_command_without_a_gpu(monkeypatch, capsys):
    from cute_fa.tools import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["selftest"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_selftest_command_lists_what_precompile_builds(monkeypatch):
    """On a B200 the command checks the sm100 variants (and the sm80 ones for the rest): at
    d128 both the single CTA and, for long sequences, the CTA pair (2-CTA MMAs)."""
    import argparse

    import cute_fa.device
    from cute_fa.tools import selftest as tool

    monkeypatch.delenv(settings.FWD_ARCH, raising=False)
    monkeypatch.setattr(cute_fa.device, "capability", lambda _: (10, 0))
    monkeypatch.setattr(cute_fa.device, "sm_count", lambda _: 148)
    args = argparse.Namespace(head_dims=[64, 128, 256], dtypes=["bf16"], variants=["plain"])
    variants, skipped = tool._variants(args, torch.device("cpu"))
    assert [(label, c.arch) for label, c in variants] == [
        ("bf16 d64 plain", 100), ("bf16 d128 plain", 100),
        ("bf16 d128 plain (1024-row sequences)", 100), ("bf16 d256 plain", 100),
    ]  # fmt: skip
    assert [c.tuning.cta_pair for _, c in variants] == [False, False, True, False]
    assert variants[3][1].tile_m == 128  # d 256: one Q tile a CTA
    assert not skipped and all(selftest.needs_check(c) for _, c in variants)


# --------------------------------------------------------------------------------------------
# The backward's check


class RefBackward:
    """The backward's launch sequence (``cute_fa.backward._launch``'s arguments after
    ``found``) computed by autograd of the reference at the kernels' precision, rows past
    seqused 0 (passes the check); ``scale_error`` multiplies the softmax scale (a 1 % error
    fails it)."""

    def __init__(self, config, scale_error: float = 1.0):
        self.config = config
        self.scale_error = scale_error
        self.launches = 0

    def __call__(self, dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k,
                 scale, wl, wr, softcap, dlse=None):  # fmt: skip
        self.launches += 1
        c = self.config
        window = (wl, wr) if c.local else (None, 0) if c.causal else (None, None)
        kw = dict(softmax_scale=scale * self.scale_error, window_size=window, softcap=softcap,
                  upcast=False, reorder_ops=True)  # fmt: skip
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        if c.varlen_q:
            seqs = [(slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1])))
                    for i in range(len(cu_q) - 1)]  # fmt: skip
        else:
            seqs = [(i, i) for i in range(q.shape[0])]
        for i, (sq, sk) in enumerate(seqs):
            nq = int(used_q[i]) if used_q is not None else None
            nk = int(used_k[i]) if used_k is not None else None
            qi, ki, vi, doi = q[sq][:nq], k[sk][:nk], v[sk][:nk], dout[sq][:nq]
            with torch.enable_grad():  # a kernel needs no grad mode; this stand-in does
                leaves = [t.unsqueeze(0).detach().clone().requires_grad_() for t in (qi, ki, vi)]
                o, _ = attention_ref(*leaves, **kw)
                computed = torch.autograd.grad(o, leaves, doi.unsqueeze(0))
            rows = (sq, sk, sk) if c.varlen_q else (i, i, i)
            for g, x, r in zip(grads, computed, rows, strict=True):
                g[r][: x.shape[1]] = x[0]
        return tuple(grads)


def bwd_key(**flags):
    return planning.bwd_config("sm_90a", "bf16", 64, 64, **flags)


BWD_VARIANTS = [
    {},
    {"causal": True},
    {"local": True, "has_softcap": True},
    {"varlen_q": True, "varlen_k": True, "seqused_q": True, "seqused_k": True},
]


@pytest.mark.parametrize("flags", BWD_VARIANTS, ids=lambda f: "+".join(f) or "plain")
def test_bwd_check_passes_the_reference_and_fails_a_one_percent_scale_error(flags):
    config = bwd_key(**flags)
    right = RefBackward(config)
    assert selftest.run_bwd_check(right, config, torch.device("cpu")) == (True, "")
    assert right.launches == len(selftest.CHECK_PROBLEMS)
    ok, error = selftest.run_bwd_check(RefBackward(config, 1.01), config, torch.device("cpu"))
    assert not ok and error.startswith("300 rows, 2 heads / 2 kv heads: AssertionError")
    assert "dq of sequence 0" in error


def test_bwd_check_fails_gradients_past_seqused():
    config = bwd_key(varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)

    def leaky(*args, **kwargs):
        dq, dk, dv = RefBackward(config)(*args, **kwargs)
        return dq, dk, dv.fill_(0.0) + dv + (dv == 0).to(dv.dtype)  # 1 where it was 0

    ok, error = selftest.run_bwd_check(leaky, config, torch.device("cpu"))
    assert not ok and "dv of sequence 0" in error


@pytest.fixture
def bwd_device(monkeypatch, tmp_path):
    """The backward's kernels on CPU: ``_compiled`` gives (config, None, None, None), ``_launch``
    the reference (``RefBackward``), wrong (a 2 % scale error) for the families in
    ``dev.wrong``; the sm90 family is checked (forced)."""
    from cute_fa import backward

    class Device:
        wrong: set[int] = set()
        launched: list = []

    dev = Device()

    def launch(found, *args, dlse=None):
        config = found[0]
        dev.launched.append(config.arch)
        return RefBackward(config, 1.02 if config.arch in dev.wrong else 1.0)(*args)

    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(settings.SELFTEST, raising=False)
    monkeypatch.setattr(backward, "_compiled", lambda config, has_dlse: (config, None, None, None))
    monkeypatch.setattr(backward, "_launch", launch)
    monkeypatch.setattr(backward, "tuned_table", lambda _: None)
    monkeypatch.setattr(selftest, "gpu_name", lambda _: "Fake H200")
    selftest.forget_loaded()
    with selftest.forced(90, 80):
        yield dev
    selftest.forget_loaded()


def test_bwd_failing_variant_falls_back_to_sm80_with_one_warning(bwd_device):
    from cute_fa import backward

    bwd_device.wrong = {90}
    found = backward._compiled(bwd_key(causal=True), False)
    with pytest.warns(RuntimeWarning, match=r"bwd_sm90.*failed its first-use self-check.*bwd_sm80"):
        checked = backward._checked(found, torch.device("cpu"), False)
    assert checked[0].arch == 80 and checked[0].causal
    results = json.loads(record_file().read_text())["results"]
    assert sorted(results.values(), key=len) == ["pass", results[selftest.variant_key(found[0])]]
    assert results[selftest.variant_key(found[0])].startswith("fail: 300 rows")
    # Recorded: a later process neither checks again nor launches the failing kernel.
    selftest.forget_loaded()
    bwd_device.launched.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert backward._checked(found, torch.device("cpu"), False)[0].arch == 80
    assert bwd_device.launched == []


def test_bwd_check_runs_with_grad_mode_off(bwd_device):
    """The check runs inside autograd's backward, where grad mode is off: its reference
    gradients still come out."""
    from cute_fa import backward

    found = backward._compiled(bwd_key(causal=True), False)
    with torch.no_grad():
        assert backward._checked(found, torch.device("cpu"), False) == found


def test_bwd_failing_sm80_variant_has_no_fallback(bwd_device):
    from cute_fa import backward

    bwd_device.wrong = {80}
    found = backward._compiled(bwd_key(causal=True).replace(arch=80), False)
    with pytest.raises(selftest.SelfCheckError, match="no other backward kernel"):
        backward._checked(found, torch.device("cpu"), False)


# --------------------------------------------------------------------------------------------
# Split-KV variants


@pytest.mark.parametrize("flags", [{}, {"causal": True},
                                   {"varlen_q": True, "varlen_k": True, "seqused_q": True,
                                    "seqused_k": True}],
                         ids=lambda f: "+".join(f) or "plain")  # fmt: skip
def test_split_variant_is_checked_split_then_merged(flags):
    config = planning.fwd_plan((9, 0), FwdRequest("bf16", 64, 64, split_kv=True, **flags))[1]
    # Split variants of the sm90 / sm80 forwards ran on the H200: checked like their family.
    assert config.split_kv and not selftest.needs_check(config)
    with selftest.forced(90):
        assert selftest.needs_check(config)
    right = RefKernel(config)
    assert selftest.run_check(right, config, torch.device("cpu")) == (True, "")
    ok, error = selftest.run_check(RefKernel(config, wrong=True), config, torch.device("cpu"))
    assert not ok and "AssertionError" in error

    def unwritten_split(q, k, v, out, lse, *rest):  # the last split's partials left as NaN
        right(q, k, v, out, lse, *rest)
        last = out.shape[0] // selftest.CHECK_SPLITS
        out[-last:] = float("nan")

    ok, error = selftest.run_check(unwritten_split, config, torch.device("cpu"))
    assert not ok and "nan" in error.lower()


def test_failing_split_variant_serves_its_calls_unsplit(device):
    device.capability = (9, 0)
    device.wrong_split = True
    q, k, v = qkv(sq=5, sk=700, h=4, hk=2, d=64)
    failed = r"splitkv(_packgqa\d+)? failed its first-use self-check"
    with selftest.forced(90), pytest.warns(RuntimeWarning, match=failed):
        out, lse = flash_attn_func(q, k, v, num_splits=3, return_lse=True)
    o_ref, l_ref = attention_ref(q, k, v, upcast=False, reorder_ops=True)
    assert torch.equal(out, o_ref) and torch.equal(lse, l_ref)
    assert {c.split_kv for c in device.kernels} == {True, False}
