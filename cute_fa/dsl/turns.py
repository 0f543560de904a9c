"""The deterministic backward's dQ turns for kernels that add dQ by TMA reduce-adds (sm90,
sm100): a semaphore per (batch, head, query block) counts the key blocks that have added their
dQ of that block (Note [deterministic dQ] in ampere/flash_bwd.py; the sm80 kernel adds by
per-thread atomics and keeps its own release).

One warp does the handshake around its reduce-adds of a query block:
  ``wait_dq_turn``: lane 0 reads the semaphore (ld.acquire.gpu) until it equals the CTA's turn;
    __syncwarp; fence.proxy.async.global (the reduce-adds that follow are async-proxy operations:
    ordered after the generic acquire).
  ``pass_dq_turn``: cp.async.bulk.wait_group 0 (without .read: the reduce-adds' writes are
    complete and visible to the issuing thread); fence.proxy.async.global (those async-proxy
    writes ordered before the generic operations that follow); __syncwarp; lane 0:
    red.release.gpu.add 1. Acquire loads and a release increment: no fence.acq_rel.gpu, whose
    MEMBAR.ALL.GPU measured slower on the H200 (docs/log/deterministic.md).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from .copy import elem_ptr
from .mask import first_key_block


@cute.jit
def dq_turn(
    m_block: Int32,
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    tile_m: cute.Constexpr[int],
    tile_n: cute.Constexpr[int],
    local: cute.Constexpr[bool],
) -> Int32:
    """How many key blocks add their dQ of ``m_block`` before ``n_block`` (ascending key
    blocks): the visitors of m_block are first_key_block(m_block) .. its last one."""
    return n_block - first_key_block(m_block, seqlen_q, seqlen_k, window_left, tile_m, tile_n,
                                     local)  # fmt: skip


@cute.jit
def wait_dq_turn(semaphores: cute.Tensor, m_block: Int32, turn: Int32):
    """The whole warp returns once ``semaphores[m_block]`` (a (query blocks,) int32 view of
    this (batch, head)) equals ``turn``: the key blocks before this one that visit m_block have
    added their dQ, and their writes are ordered before this warp's next reduce-adds."""
    if cute.arch.lane_idx() == 0:
        sem = elem_ptr(semaphores, m_block).llvm_ptr
        # Acquire loads (LDG.STRONG.GPU, CCTL.IVALL): no MEMBAR.ALL.GPU as with a fence.
        count = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
        while count != turn:
            count = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    # The next reduce-adds go through the async proxy: order them after the acquire.
    cute.arch.fence_proxy("async.global")


@cute.jit
def pass_dq_turn(semaphores: cute.Tensor, m_block: Int32):
    """Once this warp's reduce-adds of query block ``m_block`` (every bulk group it committed)
    have written dQaccum, add 1 to its semaphore (the release)."""
    # Without .read: the reduce-adds' writes are complete, not just their reads of smem.
    cute.arch.cp_async_bulk_wait_group(0)
    # The writes were made by the async proxy: order them before this warp's generic
    # operations, then the whole warp before lane 0's release.
    cute.arch.fence_proxy("async.global")
    cute.arch.sync_warp()
    if cute.arch.lane_idx() == 0:
        sem = elem_ptr(semaphores, m_block).llvm_ptr
        cute.arch.red(sem, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")
