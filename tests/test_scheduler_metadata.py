"""``get_scheduler_metadata`` and ``flash_attn_varlen_func(scheduler_metadata=...)`` on the CPU
(Note [scheduler metadata] in cute_fa/scheduler.py): the signature, the decisions it computes
on a stand-in sm90 device, that a call with the metadata plans the kernel and split count of
the call without it and reads no cu_seqlens_q on the host, and the errors for metadata of
another call. tests/test_scheduler_metadata_gpu.py runs it on a GPU (bitwise results, CUDA
graphs)."""

from __future__ import annotations

import inspect

import pytest
import torch

import cute_fa
from cute_fa import api, checks, ops, planning, scheduler, settings
from cute_fa.planning import FwdRequest
from cute_fa.scheduler import SchedulerMetadata, get_scheduler_metadata

NEEDS_CUDA = "cute_fa runs on CUDA GPUs"
SMS = 132

# flash_attn.cute.interface.get_scheduler_metadata (flash-attention 0251105a), in order.
FA_CUTE_GET_SCHEDULER_METADATA = [
    ("max_seqlen_q", inspect.Parameter.empty), ("max_seqlen_k", inspect.Parameter.empty),
    ("nheads", inspect.Parameter.empty), ("nheads_kv", inspect.Parameter.empty),
    ("headdim", inspect.Parameter.empty), ("num_splits", inspect.Parameter.empty),
    ("headdim_v", None), ("pack_gqa", None), ("causal", False), ("window_size_left", None),
    ("window_size_right", None), ("seqlen_k_new", 0), ("cu_seqlens_q", None),
    ("cu_seqlens_k", None), ("cu_seqlens_k_new", None), ("seqused_q", None),
    ("seqused_k", None), ("leftpad_k", None), ("seqlen_k_per_split", None), ("_arch", None),
]  # fmt: skip


def test_signature_matches_flash_attn_cute() -> None:
    params = inspect.signature(get_scheduler_metadata).parameters
    positional = [(n, p.default) for n, p in params.items()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]  # fmt: skip
    assert positional == FA_CUTE_GET_SCHEDULER_METADATA
    extras = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert extras == {"has_softcap": False, "page_size": None, "qkv_dtype": None}


def test_exported() -> None:
    assert cute_fa.get_scheduler_metadata is get_scheduler_metadata
    assert api.get_scheduler_metadata is get_scheduler_metadata
    assert "get_scheduler_metadata" in cute_fa.__all__
    assert "scheduler_metadata" not in planning.UNIMPLEMENTED_ARGUMENTS


class Launch:
    """A compiled kernel of the stand-in device: records its launches."""

    def __init__(self, config):
        self.config = config
        self.max_seqlen_q: list[int] = []

    def __call__(self, *args):
        self.max_seqlen_q.append(args[9])


@pytest.fixture
def gpu(monkeypatch):
    """CPU tensors pass the device checks; the device is an sm90 GPU of 132 SMs without a tuned
    table; kernels record their launches; value checks are off (as under CUDA-graph capture
    or CUTE_FA_SKIP_CHECKS=1); the eager path calls the op's implementation directly."""

    class Device:
        capability = (9, 0)
        kernels: dict = {}

    dev = Device()

    def compiled_kernel(config):
        return dev.kernels.setdefault(config, Launch(config))

    monkeypatch.setattr(ops, "_plans", {})
    monkeypatch.setattr(ops, "device_of", lambda *named: torch.device("cpu"))
    monkeypatch.setattr(scheduler, "device_of", lambda *named: torch.device("cpu"))
    monkeypatch.setattr(ops, "capability", lambda _: dev.capability)
    monkeypatch.setattr(ops, "sm_count", lambda _: SMS)
    monkeypatch.setattr(ops, "tuned_table", lambda _: None)
    monkeypatch.setattr(ops, "_compiled_kernel", compiled_kernel)
    monkeypatch.setattr(ops, "combine_kernel", lambda *args: "combine")
    monkeypatch.setattr(ops, "launch_combine", lambda *args: None)
    monkeypatch.setattr(api, "eager_cuda", lambda t: True)
    monkeypatch.setattr(checks, "SKIP_VALUE_CHECKS", True)
    monkeypatch.setenv(settings.SELFTEST, "0")
    return dev


B, H, HK, D, SK = 4, 16, 2, 128, 8192


def decode(b=B, h=H, hk=HK, d=D, sk=SK, cu_device="cpu", dtype=torch.bfloat16):
    """A decode step: one query row a sequence (packed), a dense cache of ``sk`` keys with
    ``seqused_k``: (q, k, v, cu_seqlens_q, seqused_k)."""
    q = torch.randn(b, h, d, dtype=dtype)
    k, v = (torch.randn(b, sk, hk, d, dtype=dtype) for _ in range(2))
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=cu_device)
    used_k = torch.full((b,), sk // 2, dtype=torch.int32)
    return q, k, v, cu_q, used_k


def metadata(cu_q, used_k, max_seqlen_q=1, max_seqlen_k=SK, num_splits=0, **kwargs):
    kwargs = {"nheads": H, "nheads_kv": HK, "headdim": D, **kwargs}
    return get_scheduler_metadata(max_seqlen_q, max_seqlen_k, num_splits=num_splits,
                                  cu_seqlens_q=cu_q, seqused_k=used_k, **kwargs)  # fmt: skip


def the_plan():
    (plan,) = ops._plans.values()
    return plan


# --------------------------------------------------------------------------------------------
# What it computes


def test_decode_step_values(gpu) -> None:
    """A decode step packs (8 query heads a K/V head, one row each) and splits by the
    heuristic: 4 sequences x 2 K/V heads = 8 packed tiles, 64 key blocks of 128."""
    _, _, _, cu_q, used_k = decode()
    md = metadata(cu_q, used_k)
    assert isinstance(md, SchedulerMetadata)
    assert md.max_seqlen_q == 1 and md.max_seqlen_k == SK and md.pack_gqa is True
    assert md.num_splits == planning.num_splits_heuristic(B * 2 * 1, SK // 128, SMS) == 16
    assert (md.batch, md.nheads, md.nheads_kv, md.headdim, md.headdim_v) == (B, H, HK, D, D)
    assert (md.varlen_q, md.varlen_k, md.has_seqused_q, md.has_seqused_k) == (
        True, False, False, True)  # fmt: skip
    assert md.num_splits_asked == 0 and md.pack_gqa_asked is None
    assert md.causal is False and md.window_size == (None, None)
    with pytest.raises(dataclasses_frozen()):
        md.num_splits = 2


def dataclasses_frozen():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
    "kwargs, splits, packs",
    [
        ({}, 16, True),
        ({"max_seqlen_k": 1000}, 2, True),  # 8 key blocks: 2 splits of at least 4
        ({"max_seqlen_k": 896}, 1, True),  # 7 key blocks: too few to split
        ({"pack_gqa": False}, min(SMS // (B * H), SK // 128 // 4), False),
        ({"pack_gqa": True}, 16, True),
        ({"num_splits": 1}, 1, True),
        ({"num_splits": None}, 16, True),
        ({"num_splits": 5}, 5, True),
        ({"max_seqlen_q": 4096, "causal": True}, 1, False),  # a prefill: neither
        ({"nheads": 16, "nheads_kv": 16}, 2, False),  # MHA: 64 tiles; nothing to pack
        ({"window_size_left": 256, "window_size_right": 0}, 16, True),
    ],
)
def test_decisions(gpu, kwargs, splits, packs) -> None:
    _, _, _, cu_q, used_k = decode()
    md = metadata(cu_q, used_k, **kwargs)
    assert (md.num_splits, md.pack_gqa) == (splits, packs)


def test_decisions_on_sm80(gpu) -> None:
    """The sm80 forward packs and splits too (its 64-key blocks: more of them than sm90's
    128, so more splits are possible); pack_gqa=False splits over one query head a tile, and
    an explicit split count is kept."""
    gpu.capability = (8, 0)
    _, _, _, cu_q, used_k = decode()
    md = metadata(cu_q, used_k, pack_gqa=True)
    assert md.num_splits > 1 and md.pack_gqa is True
    unpacked = metadata(cu_q, used_k, pack_gqa=False)
    assert unpacked.num_splits > 1 and unpacked.pack_gqa is False
    assert metadata(cu_q, used_k, num_splits=3).num_splits == 3


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (10, 0)])
@pytest.mark.parametrize("max_seqlen_q", [1, 4, 300])
@pytest.mark.parametrize("h, hk", [(16, 2), (8, 8), (32, 4)])
def test_dtype_and_paging_change_no_decision(capability, max_seqlen_q, h, hk) -> None:
    """Why qkv_dtype may be left out and page_size where paging keeps the kernel (Note
    [scheduler metadata]): the same decisions for fp16 and bf16, paged (pages of 16, 64, 256)
    or not, on sm90 and sm80. On sm100 a paged call runs the sm80 forward (its gather), so
    there page_size changes the decisions: the metadata then needs it (checked below)."""
    cpu = torch.device("cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "capability", lambda _: capability)
        mp.setattr(ops, "sm_count", lambda _: SMS)
        mp.setattr(ops, "tuned_table", lambda _: None)
        for num_splits, pack in ((0, -1), (0, 1), (1, -1)):
            seen = set()
            for dtype in ("bf16", "fp16"):
                for page_size in (0, 16, 64, 256) if capability != (10, 0) else (0,):
                    request = FwdRequest(dtype, 128, 128, seqused_k=True, varlen_q=True,
                                         page_size=page_size)  # fmt: skip
                    seen.add(ops.scheduler_choice(cpu, request, 4, h, hk, max_seqlen_q, SK,
                                                  num_splits, pack))  # fmt: skip
            assert len(seen) == 1, seen
        paged = FwdRequest("bf16", 128, 128, seqused_k=True, varlen_q=True, page_size=16)
        if capability == (10, 0):  # the sm80 forward, which packs groups dividing its tile
            packs = ops.scheduler_choice(cpu, paged, 4, h, hk, max_seqlen_q, SK, 0, 1)[1]
            assert packs == (h != hk)


# --------------------------------------------------------------------------------------------
# The call with the metadata


def test_a_call_with_metadata_plans_what_the_call_without_it_plans(gpu) -> None:
    q, k, v, cu_q, used_k = decode()
    flash_attn = cute_fa.flash_attn_varlen_func
    flash_attn(q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, max_seqlen_q=1, num_splits=0)
    without = the_plan()
    ops._plans.clear()
    md = metadata(cu_q, used_k)
    flash_attn(q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, num_splits=0, scheduler_metadata=md)
    with_md = the_plan()
    assert with_md.kernel is without.kernel  # the same compiled kernel (compile key)
    assert with_md.kernel.config.split_kv and with_md.kernel.config.pack_gqa == H // HK
    assert with_md.num_splits == without.num_splits == md.num_splits == 16
    assert with_md.pack_gqa == without.pack_gqa == H // HK
    assert with_md.kernel.max_seqlen_q == [1, 1]  # the grid of both launches


def test_a_smaller_max_seqlen_k_splits_as_its_count_asks(gpu) -> None:
    """A cache filled to 1000 of its 8192 keys: the metadata splits for 1000 keys; the call
    without it sees only the cache's extent. The call with the metadata plans what the call
    with md's num_splits and pack_gqa plans."""
    q, k, v, cu_q, used_k = decode()
    md = metadata(cu_q, used_k, max_seqlen_k=1000)
    assert md.num_splits == 2
    flash_attn = cute_fa.flash_attn_varlen_func
    flash_attn(q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, num_splits=0, scheduler_metadata=md)
    with_md = the_plan()
    ops._plans.clear()
    flash_attn(q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, max_seqlen_q=1, num_splits=2,
               pack_gqa=True)  # fmt: skip
    explicit = the_plan()
    assert (with_md.kernel, with_md.num_splits) == (explicit.kernel, explicit.num_splits)


def test_a_paged_call(gpu) -> None:
    """Paged K/V (the metadata without page_size, as flash_attn.cute's callers write it): the
    plan of the call without the metadata, pages * page_size being max_seqlen_k."""
    q, _, _, cu_q, used_k = decode()
    page_size, pages = 64, SK // 64
    k, v = (torch.randn(B * pages, page_size, HK, D, dtype=torch.bfloat16) for _ in range(2))
    table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    flash_attn = cute_fa.flash_attn_varlen_func
    args = dict(cu_seqlens_q=cu_q, seqused_k=used_k, page_table=table, num_splits=0)
    flash_attn(q, k, v, max_seqlen_q=1, **args)
    without = the_plan()
    ops._plans.clear()
    for md in (metadata(cu_q, used_k), metadata(cu_q, used_k, page_size=page_size)):
        flash_attn(q, k, v, scheduler_metadata=md, **args)
        assert (the_plan().kernel, the_plan().num_splits) == (without.kernel, without.num_splits)
        assert the_plan().kernel.config.page_size == page_size


def test_no_host_read_of_cu_seqlens_q(gpu) -> None:
    """With value checks off (CUDA-graph capture, CUTE_FA_SKIP_CHECKS=1) the metadata's
    max_seqlen_q spares the read of cu_seqlens_q that a call without max_seqlen_q makes: here
    cu_seqlens_q is a meta tensor, which has no values to read."""
    q, k, v, cu_q, used_k = decode(cu_device="meta")
    flash_attn = cute_fa.flash_attn_varlen_func
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        flash_attn(q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, num_splits=0)
    ops._plans.clear()
    md = metadata(cu_q, used_k)  # reads no values either
    for _ in range(2):  # the first call plans; the second reuses the plan
        flash_attn(q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, num_splits=0,
                   scheduler_metadata=md)  # fmt: skip
    assert the_plan().kernel.max_seqlen_q == [1, 1]


def test_max_seqlen_k_fills_in_for_the_backward(monkeypatch) -> None:
    """A call with metadata and no max_seqlen_k takes md's (the backward's grid for packed
    keys; no sync there); the call's own must agree with it."""
    seen = []
    monkeypatch.setattr(api, "_forward", lambda *args, **kwargs: seen.append(kwargs) or (
        torch.zeros(1), torch.zeros(1)))  # fmt: skip
    monkeypatch.setattr(scheduler, "device_of", lambda *named: torch.device("cpu"))
    monkeypatch.setattr(ops, "capability", lambda _: (9, 0))
    monkeypatch.setattr(ops, "sm_count", lambda _: SMS)
    monkeypatch.setattr(ops, "tuned_table", lambda _: None)
    q, k, v, cu_q, used_k = decode()
    md = metadata(cu_q, used_k, max_seqlen_k=5000)
    cute_fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, num_splits=0,
                                   scheduler_metadata=md)  # fmt: skip
    assert seen[-1]["max_seqlen_k"] == 5000


def test_torch_compile_traces_a_call_with_metadata(gpu, monkeypatch) -> None:
    """fullgraph=True: the metadata's checks trace without a graph break (the tuning state is
    not compared there) and the op runs md's plan."""
    monkeypatch.setattr(api, "eager_cuda", ops.eager_cuda)
    torch._dynamo.reset()
    q, k, v, cu_q, used_k = decode()
    md = metadata(cu_q, used_k)

    def step(q, k, v, cu_q, used_k):
        return _call(md, q, k, v, cu_q, used_k)[0]

    try:
        out = torch.compile(step, backend="eager", fullgraph=True)(q, k, v, cu_q, used_k)
    finally:
        torch._dynamo.reset()
    assert out.shape == q.shape
    assert (the_plan().num_splits, the_plan().pack_gqa) == (16, H // HK)


# --------------------------------------------------------------------------------------------
# Metadata of another call


def _call(md, q, k, v, cu_q, used_k, **kwargs):
    args = dict(cu_seqlens_q=cu_q, seqused_k=used_k, num_splits=0, scheduler_metadata=md)
    return cute_fa.flash_attn_varlen_func(q, k, v, **{**args, **kwargs})


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(h=32), "nheads 16, this call 32"),
        (dict(hk=4), "nheads_kv 2, this call 4"),
        (dict(d=64), "headdim 128, this call 64"),
        (dict(b=3), r"batch \(len\(cu_seqlens_q\) - 1\) 4, this call 3"),
        (dict(sk=4096), r"max_seqlen_k 8192, more than this call's keys hold \(k.shape\[1\]"),
        (dict(causal=True), "causal False, this call True"),
        (dict(window_size=(128, 0)), r"window_size \(None, None\), this call \(128, 0\)"),
        (dict(softcap=30.0), "has_softcap False, this call True"),
        (dict(max_seqlen_q=2), "max_seqlen_q 1, this call 2"),
        (dict(max_seqlen_k=100), "max_seqlen_k 8192, this call 100"),
        (dict(num_splits=1), r"num_splits \(0: the heuristic\) 0, this call 1"),
        (dict(pack_gqa=False), "pack_gqa None, this call False"),
        (dict(seqused_k=None), "seqused_k given: True, this call False"),
        (dict(seqused_q=True), "seqused_q given: False, this call True"),
    ],
)
def test_metadata_of_another_call(gpu, change, match) -> None:
    _, _, _, cu_q, used_k = decode()
    md = metadata(cu_q, used_k)
    shape = {n: change.pop(n) for n in ("b", "h", "hk", "d", "sk") if n in change}
    q, k, v, cu_q2, used_k2 = decode(**shape)
    if change.pop("seqused_k", True) is None:
        used_k2 = None
    if change.pop("seqused_q", False):
        change["seqused_q"] = torch.ones(B, dtype=torch.int32)
    with pytest.raises(ValueError, match="scheduler_metadata was computed for another call"):
        _call(md, q, k, v, cu_q2, used_k2, **change)
    with pytest.raises(ValueError, match=match):
        _call(md, q, k, v, cu_q2, used_k2, **change)
    assert not ops._plans  # nothing planned


def test_metadata_of_a_dense_query_call(gpu) -> None:
    """A dense q (batch, seqlen_q, ...): max_seqlen_q is its seqlen_q, the batch its first dim."""
    _, k, v, _, used_k = decode()
    q = torch.randn(B, 3, H, D, dtype=torch.bfloat16)
    md = metadata(None, used_k, max_seqlen_q=3)
    cute_fa.flash_attn_varlen_func(q, k, v, seqused_k=used_k, num_splits=0,
                                   scheduler_metadata=md)  # fmt: skip
    assert the_plan().num_splits == md.num_splits
    wrong = metadata(None, used_k, max_seqlen_q=4)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(for a dense q, q.shape\[1\]\) 4, "):
        cute_fa.flash_attn_varlen_func(q, k, v, seqused_k=used_k, num_splits=0,
                                       scheduler_metadata=wrong)  # fmt: skip


def test_stated_dtype_and_page_size_are_checked(gpu) -> None:
    q, k, v, cu_q, used_k = decode()
    with pytest.raises(ValueError, match="qkv_dtype torch.float16, this call torch.bfloat16"):
        _call(metadata(cu_q, used_k, qkv_dtype=torch.float16), q, k, v, cu_q, used_k)
    with pytest.raises(ValueError, match="page_size 64, this call None"):
        _call(metadata(cu_q, used_k, page_size=64), q, k, v, cu_q, used_k)
    _call(metadata(cu_q, used_k, qkv_dtype=torch.bfloat16), q, k, v, cu_q, used_k)


def test_metadata_of_another_tuning_state(gpu) -> None:
    q, k, v, cu_q, used_k = decode()
    md = metadata(cu_q, used_k)
    with cute_fa.tuning(sm90_fwd={"tile_n": 112}):
        with pytest.raises(ValueError, match="another tuning state"):
            _call(md, q, k, v, cu_q, used_k)
        _call(metadata(cu_q, used_k), q, k, v, cu_q, used_k)


def test_metadata_must_be_get_scheduler_metadatas(gpu) -> None:
    q, k, v, cu_q, used_k = decode()
    with pytest.raises(TypeError, match="scheduler_metadata must be what"):
        _call((None, None, None, None, None), q, k, v, cu_q, used_k)


def test_disable_scheduler_metadata_ignores_it(gpu) -> None:
    q, k, v, cu_q, used_k = decode()
    md = metadata(cu_q, used_k, max_seqlen_q=7, num_splits=3)
    _call(md, q, k, v, cu_q, used_k, max_seqlen_q=1, disable_scheduler_metadata=True)
    assert the_plan().kernel.max_seqlen_q == [1] and the_plan().num_splits == 16


# --------------------------------------------------------------------------------------------
# Arguments of get_scheduler_metadata


def test_needs_a_cuda_device() -> None:
    _, _, _, cu_q, used_k = decode()
    with pytest.raises(ValueError, match=NEEDS_CUDA):
        metadata(cu_q, used_k)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(cu_seqlens_q=None, seqused_k=None), ValueError, "at least one of cu_seqlens_q"),
        (dict(seqused_q=torch.ones(3, dtype=torch.int32)), ValueError, "different batch sizes"),
        (dict(seqused_k=torch.ones(4)), TypeError, "seqused_k must be torch.int32"),
        (dict(nheads=12, nheads_kv=8), ValueError, "multiple of nheads_kv"),
        (dict(headdim=12), ValueError, "headdim must be a positive multiple of 8"),
        (dict(headdim=64, headdim_v=128), NotImplementedError, "head_dim=64, head_dim_v=128"),
        (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
        (dict(max_seqlen_k=1.5), TypeError, "max_seqlen_k must be an int"),
        (dict(num_splits="2"), TypeError, "num_splits must be an int"),
        (dict(pack_gqa=1), TypeError, "pack_gqa must be True, False or None"),
        (dict(window_size_left=True), TypeError, r"window_size\[0\] must be an int"),
        (dict(qkv_dtype=torch.float32), TypeError, "qkv_dtype must be"),
        (dict(page_size=64, cu_seqlens_k=torch.zeros(5, dtype=torch.int32)), ValueError,
         "page_size and cu_seqlens_k"),
        (dict(seqlen_k_new=1), NotImplementedError, "seqlen_k_new is not implemented"),
        (dict(cu_seqlens_k_new=torch.zeros(5, dtype=torch.int32)), NotImplementedError,
         "cu_seqlens_k_new is not implemented"),
        (dict(leftpad_k=torch.zeros(4, dtype=torch.int32)), NotImplementedError,
         "leftpad_k is not implemented"),
        (dict(seqlen_k_per_split=128), NotImplementedError, "seqlen_k_per_split is not"),
    ],
)  # fmt: skip
def test_argument_errors(gpu, kwargs, error, match) -> None:
    _, _, _, cu_q, used_k = decode()
    args = dict(cu_q=cu_q, used_k=used_k)
    if "cu_seqlens_q" in kwargs:
        args["cu_q"] = kwargs.pop("cu_seqlens_q")
    if "seqused_k" in kwargs:
        args["used_k"] = kwargs.pop("seqused_k")
    with pytest.raises(error, match=match):
        metadata(args["cu_q"], args["used_k"], **kwargs)


def test_accepted_without_meaning(gpu) -> None:
    """flash_attn.cute's ``_arch`` is accepted and the device decides; the append-KV
    arguments are accepted at their off values."""
    _, _, _, cu_q, used_k = decode()
    md = metadata(cu_q, used_k, _arch=80, seqlen_k_new=0, cu_seqlens_k_new=None, leftpad_k=None,
                  seqlen_k_per_split=None)  # fmt: skip
    assert md == metadata(cu_q, used_k)
    assert md.num_splits == 16  # sm90's split kernel, not sm80's none
