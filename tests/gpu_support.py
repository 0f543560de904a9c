"""Helpers shared by the GPU test modules: seeding, memory poisoning, independent mask
bookkeeping, cu_seqlens construction and the compile keys of the kernels that ran."""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

SEED_ENV = "CUTE_FA_TEST_SEED"


@pytest.fixture(autouse=True)
def seed() -> int:
    """Fresh seed per test (printed, so a failure shows it); CUTE_FA_TEST_SEED replays one."""
    value = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(2**31))
    torch.manual_seed(value)
    random.seed(value)
    print(f"seed {value} (replay with {SEED_ENV}={value})")
    return value


def _memset_ff(ptr: int, nbytes: int, stream: int) -> None:
    """cuMemsetD8Async(ptr, 0xFF, nbytes) on ``stream`` through cuda-python's driver bindings."""
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python before 12.6 named the module cuda.cuda
        from cuda import cuda as driver
    (err,) = driver.cuMemsetD8Async(driver.CUdeviceptr(ptr), 0xFF, nbytes, driver.CUstream(stream))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemsetD8Async failed: {err}")


class Poison:
    """Address ranges that held 0xFF bytes when ``poison_free_memory`` returned."""

    def __init__(self, ranges: list[tuple[int, int]], complete: bool):
        self.ranges = ranges
        self.complete = complete  # every free block was filled, not only the reserve

    def covers(self, t: torch.Tensor) -> bool:
        start = t.untyped_storage().data_ptr()
        end = start + t.untyped_storage().nbytes()
        return any(lo <= start and end <= lo + n for lo, n in self.ranges)


def _expandable_segments() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def poison_free_memory(reserve_bytes: int) -> Poison:
    """Fill the free memory of torch's CUDA caching allocator with 0xFF (NaN in bf16/fp16/fp32).

    How: first make sure each pool holds a free block that is big enough for what the next
    call allocates (a ``reserve_bytes`` tensor for the large pool, two 1 MiB tensors for the
    small pool, filled and freed), then read ``torch.cuda.memory_snapshot()`` and memset every
    ``inactive`` block of this device on the current stream. The caching allocator serves a
    request from a free cached block whenever one fits, so the kernel's ``out``/``lse`` start as
    NaN, and the memsets are ordered before the launch by the stream.

    Limits: memory the allocator does not hold yet (a fresh cudaMalloc when nothing cached
    fits) is not poisoned, hence the reserve; with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` nothing
    is cached and this does nothing useful; with expandable segments only the reserve blocks are
    filled (an inactive range there may be unmapped); blocks awaiting another stream and the
    pools of CUDA graphs are skipped.
    A kernel that writes the wrong value where it should write nothing is not caught by this
    (the reference comparison catches it).
    """
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream()
    big = torch.empty(reserve_bytes, dtype=torch.uint8, device="cuda")
    small = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ranges = []
    for t in (big, *small):
        t.fill_(0xFF)
        ranges.append((t.data_ptr(), t.numel()))
    del big, small, t
    if _expandable_segments():
        return Poison(ranges, complete=False)
    try:
        segments = torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # torch without include_traces
        segments = torch.cuda.memory_snapshot()
    ranges = []
    for seg in segments:
        # Only torch's default pool: free blocks of a CUDA-graph pool may still be read by a
        # replay of that graph.
        if seg.get("device", device) != device or tuple(seg.get("segment_pool_id", (0, 0))) != (
            0,
            0,
        ):
            continue
        addr = seg["address"]
        for block in seg["blocks"]:
            if block["state"] == "inactive" and block["size"] > 0:
                ptr = block.get("address", addr)
                _memset_ff(ptr, block["size"], stream.cuda_stream)
                ranges.append((ptr, block["size"]))
            addr += block["size"]
    return Poison(ranges, complete=True)


def empty_rows(seqlen_q: int, seqlen_k: int, causal: bool, window) -> torch.Tensor:
    """(seqlen_q,) bool: query rows that see no key under the bottom-right aligned mask.

    Query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right (None: unbounded;
    causal sets right = 0). Written independently of the reference on purpose.
    """
    left, right = window
    if causal:
        right = 0
    i = torch.arange(seqlen_q)
    shift = seqlen_k - seqlen_q
    lo = torch.zeros_like(i) if left is None else (i + shift - left).clamp(min=0)
    hi = (
        torch.full_like(i, seqlen_k - 1)
        if right is None
        else (i + shift + right).clamp(max=seqlen_k - 1)
    )
    return lo > hi


def unseen_keys(seqlen_q: int, seqlen_k: int, causal: bool, window) -> torch.Tensor:
    """(seqlen_k,) bool: keys that no query row sees (their dK and dV are exactly 0).

    Key j is seen by the queries i with j + sq - sk - right <= i <= j + sq - sk + left (the
    same rule as ``empty_rows``, solved for i); it is unseen when none of them is in
    [0, seqlen_q). Written independently of the reference on purpose.
    """
    left, right = window
    if causal:
        right = 0
    j = torch.arange(seqlen_k)
    shift = seqlen_q - seqlen_k
    lo = torch.zeros_like(j) if right is None else (j + shift - right).clamp(min=0)
    hi = (
        torch.full_like(j, seqlen_q - 1)
        if left is None
        else (j + shift + left).clamp(max=seqlen_q - 1)
    )
    return lo > hi


def cu_seqlens(lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")


def fwd_plan_configs() -> list:
    """The compile keys of the kernels that the forward launch plans made so far launch
    (``cute_fa.ops._plans``; plans with nothing to launch left out). A plan holds its compiled
    kernel, the object ``cute_fa.compile.fwd_cache()`` keeps under that key, so a test that
    empties ``_plans`` before a call reads here which kernel the call ran."""
    from cute_fa import ops
    from cute_fa.compile import fwd_cache

    keys = {id(kernel): key for key, kernel in fwd_cache()._memory.items()}
    return [keys[id(plan.kernel)] for plan in ops._plans.values() if plan.kernel is not None]


def sm90_forward_here() -> bool:
    """Whether dispatch runs the sm90 forward on this machine's GPU (an sm90 GPU without
    ``CUTE_FA_FWD_ARCH=80``): the family with split-KV, packed GQA and paged K/V."""
    forced = os.environ.get("CUTE_FA_FWD_ARCH")
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and forced in (None, "", "90")
    )


def fwd_family_here() -> int:
    """The forward kernel family dispatch picks on this machine's GPU: ``CUTE_FA_FWD_ARCH``
    when set, else 90 on sm90, 100 on sm100 / sm103, 80 elsewhere (sm80, sm86, sm89, sm120)."""
    forced = os.environ.get("CUTE_FA_FWD_ARCH")
    if forced:
        return int(forced)
    major, minor = torch.cuda.get_device_capability()
    return {(9, 0): 90, (10, 0): 100, (10, 3): 100}.get((major, minor), 80)


needs_sm90_forward = pytest.mark.skipif(
    not sm90_forward_here(),
    reason="runs on the sm90 forward (an sm90 GPU without CUTE_FA_FWD_ARCH=80)",
)


def randn_cuda(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    """Standard normal values of ``dtype`` on the GPU, drawn in fp32."""
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


def run_planned(fn, *args, **kwargs):
    """Call ``fn`` with a fresh table of launch plans; return its result and the one plan the
    call made (``cute_fa.ops._Plan``: its split count, packing)."""
    from cute_fa import ops

    ops.clear_plans()
    result = fn(*args, **kwargs)
    plans = list(ops._plans.values())
    assert len(plans) == 1, f"{len(plans)} launch plans"
    return result, plans[0]


def check_fwd(out, lse, q, k, v, window=(None, None), softcap=0.0, lse_atol=1e-4) -> None:
    """out, lse of dense (batch, seqlen, heads, d) inputs against the fp32 reference (DESIGN.md's
    tolerance); rows that see no key exactly 0 / -inf; nothing NaN. ``window`` (None, 0) is
    causal."""
    from cute_fa.reference import attention_ref, check_close

    sq = q.shape[1]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    dead = empty_rows(sq, k.shape[1], False, window).to(out.device)
    if dead.any():
        assert (out[:, dead] == 0).all() and torch.isneginf(lse[:, :, dead]).all()
    kw = dict(window_size=window, softcap=softcap)
    out_ref, lse_ref = attention_ref(q, k, v, upcast=True, **kw)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    check_close(out, out_ref, out_pt, name="out")
    check_close(lse, lse_ref, lse_pt, atol=lse_atol, name="lse")


def check_grads(grads, q, k, v, dout, causal: bool) -> None:
    """dq, dk, dv of dense inputs against the gradients of the fp32 reference (DESIGN.md's
    tolerance, the baseline the reference at the inputs' precision); nothing NaN."""
    from cute_fa.reference import attention_ref, check_close

    refs = []
    for upcast in (True, False):
        dtype = torch.float32 if upcast else q.dtype
        ref_leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref_out, _ = attention_ref(*ref_leaves, causal=causal, upcast=upcast,
                                   reorder_ops=not upcast)  # fmt: skip
        refs.append(torch.autograd.grad(ref_out, ref_leaves, dout.to(ref_out.dtype)))
    for g, g_ref, g_pt, name in zip(grads, *refs, ("dq", "dk", "dv"), strict=True):
        assert not torch.isnan(g).any()
        check_close(g, g_ref, g_pt, name=name)


def graph_capture(step):
    """Warm ``step`` up on a side stream (compiles, plans, allocator), capture it in a CUDA
    graph, return (graph, captured outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def paged_cache(lens_k, page_size, h_kv, d, dv, spare=3):
    """(k_pages, v_pages, page_table, ks, vs): the pool in shuffled order with ``spare`` unused
    pages, and each sequence's keys and values (for the reference)."""
    counts = [-(-n // page_size) for n in lens_k]
    max_pages = max(max(counts), 1)
    total = sum(counts) + spare
    k_pages = torch.full((total, page_size, h_kv, d), float("nan"), device="cuda")
    v_pages = torch.full((total, page_size, h_kv, dv), float("nan"), device="cuda")
    k_pages, v_pages = k_pages.bfloat16(), v_pages.bfloat16()
    order = torch.randperm(total, device="cuda")
    table = torch.full((len(lens_k), max_pages), -1, dtype=torch.int32, device="cuda")
    ks, vs, slot = [], [], 0
    for b, n in enumerate(lens_k):
        kb, vb = randn_cuda(n, h_kv, d), randn_cuda(n, h_kv, dv)
        ks.append(kb)
        vs.append(vb)
        for j in range(counts[b]):
            page = int(order[slot])
            slot += 1
            table[b, j] = page
            rows = slice(j * page_size, min((j + 1) * page_size, n))
            k_pages[page, : rows.stop - rows.start] = kb[rows]
            v_pages[page, : rows.stop - rows.start] = vb[rows]
    return k_pages, v_pages, table, ks, vs
