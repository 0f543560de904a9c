"""sm100 backward main kernel: tcgen05 MMAs into tensor memory, warp roles (cross-compiled only)."""

from __future__ import annotations

import enum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import TmemAllocator
from cutlass.tensor_utils.layout import LayoutEnum

from cute_fa.config import BwdConfig
from cute_fa.dsl.copy import transposed, zero_rows_from
from cute_fa.dsl.kernel import AttentionKernel
from cute_fa.dsl.mask import (
    apply_mask,
    query_block_mask_bounds,
    query_block_range,
    visited_query_block,
)
from cute_fa.dsl.ring import ring_state
from cute_fa.dsl.scheduler import bwd_block_coords, bwd_grid
from cute_fa.dsl.seqlen import seqlen_info
from cute_fa.dsl.softmax import ScoreScales, lse_for_recompute, score_scales, softcap_scores
from cute_fa.dsl.turns import dq_turn, pass_dq_turn, wait_dq_turn

from .support import (
    SM100_BWD_DO_STAGES,
    SM100_BWD_DQ_CHUNK,
    SM100_BWD_DQ_STAGES,
    SM100_BWD_Q_STAGES,
    SM100_BWD_REGS,
    TMEM_COLUMNS,
    bwd_can_implement,
    bwd_smem_bytes,
    bwd_tmem_plan,
)

WARP = 32
WARPGROUP = 128
# Query columns of S^T / dP^T a compute thread loads per tcgen05.ld of dP^T (and per dS store).
DS_CHUNK = 32
# LSE / delta values a compute thread reads from smem at once (two 16-byte loads).
STAT_VEC = 8


# Note [softcap gradient folded into P]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With softcap the scores are t = tanh(s * softmax_scale / softcap) (times softcap, folded into
# scale_log2), so the gradient of the raw score s is P (dP - delta) (1 - t^2) times
# softmax_scale (the postprocess / the dK epilogue apply that). dS needs P and 1 - t^2 only as
# their product, and P itself only for the 16-bit P^T store before it: each pair of P^T is
# computed while t is still in its registers, its 16-bit values go to the P^T store buffer, and
# P (1 - t^2) takes its place. No second 64-value fragment (the sm80 / sm90 kernels keep
# 1 - tanh^2 beside S; at 168 registers a compute thread has no room for it), no MUFU.LG2
# (the sm90 split-d way recovers t from P). A masked score has t = -inf: 1 - t^2 = -inf,
# clamped to 0 (P is 0 there too, and 0 * -inf would be NaN).


class Role(enum.IntEnum):
    """First warp of each role (warps 0-15, 512 threads)."""

    DQ = 0  # warps 0-3: dQ TMEM -> smem -> TMA reduce-add
    COMPUTE0 = 4  # warps 4-7: query columns [0, tile_m / 2) of every block
    COMPUTE1 = 8  # warps 8-11: query columns [tile_m / 2, tile_m)
    MMA = 12
    LOAD = 13
    IDLE = 14  # warps 14-15


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads)."""

    TMEM_ALLOC = 1  # dQ + compute + MMA warps (416 threads): TMEM address published
    TMEM_FREE = 2  # dQ + compute warps (384 threads): every TMEM read done, warp 4 frees
    DQ_STAGE = 3  # dQ warps (128 threads): a dQ chunk is in sdQ, the previous reduce read its own


class FlashAttentionBackwardSm100(AttentionKernel):
    """Exact attention backward (dQ, dK, dV) on tcgen05 (sm_100a / sm_103a; cross-compiled only).

    Nothing of this kernel has run on a Blackwell GPU: it is compiled for sm_100a and sm_103a
    with fake tensors and checked by its SASS, its resource usage and the protocol below,
    asserted while tracing (tests/test_compile_sm100_bwd.py; docs/blackwell.md has its counts
    beside FA4's). Planning sends capability 10.x to it where it implements the call, behind
    the first-use self-check of each variant (cute_fa/selftest.py run_bwd_check). It takes
    the backward protocol of ``cute_fa/dsl/fake.py bwd_fake_args``, so the existing
    preprocess (delta = rowsum(dO O), dQaccum zeroed) and postprocess (dQaccum *
    softmax_scale -> dtype; GQA sums of dK / dV) serve it unchanged.

    Scope: bf16 / fp16; d = dv in (64, 96, 128); dense or varlen (cu_seqlens_q / cu_seqlens_k),
    seqused_q / seqused_k; no mask, causal or a sliding window (bottom-right aligned, Note
    [bottom-right aligned masks]); softcap; GQA / MQA (K/V head = head // (heads / kv heads);
    dK / dV written per query head); deterministic dQ (the chain order, below).
    ``blackwell/support.py bwd_can_implement`` rejects the rest (d 192 / 256: one CTA's TMEM
    plan needs 640 columns or more, Note [backward TMEM plan]; the CTA pair,
    ``Sm100BwdTuning.cta_pair``: planned there, not built; the sm80 kernel's det_coresident
    order) with its reason.

    Grid and work split
      grid = (ceil(max_seqlen_k / tile_n), heads, batch) (``bwd_grid``; deterministic causal:
      key blocks slowest): one CTA owns tile_n = 128 keys of one (query head, batch); K and V
      are loaded once, dV and dK accumulate in TMEM; the CTA walks the query blocks that see
      its keys (``query_block_range``: causal skips those above the diagonal, a window those
      outside it) upward (deterministic: downward; every role alike, ``query_block``),
      tile_m = 128 query rows a step. P is recomputed
      from Q, K and the forward's LSE. Everything is computed transposed, keys x queries, so
      the keys are the M = 128 rows of the MMAs and the 128 TMEM lanes: thread t of a
      warpgroup owns key row t (32x32b TMEM loads and stores).
    Warp roles (16 warps; setmaxnreg per warpgroup, ``support.SM100_BWD_REGS``: 128 * (2 * 168
      + 80 + 96) = 65536)
      warps 0-3   dq: dQ of each block from TMEM (thread = query row) in 16-column chunks to
                  smem, then one TMA reduce-add (cp.reduce.async.bulk.tensor .add.f32) per
                  chunk into dQaccum, issued by warp 0.                                   80
      warps 4-7   compute0: query columns [0, 64) of S^T / dP^T (thread t = key row t);   168
      warps 8-11  compute1: query columns [64, 128). Warp 4 allocates and frees TMEM.      168
                  After the last block both store dK (times softmax_scale) and dV (16-bit)
                  from TMEM to global, compute w its half of the columns.
      warp 12     mma: one elected thread issues every tcgen05.mma and commit (96: its
                  loop-invariant smem descriptors spilled at 48 and 88).                  96
      warp 13     load: TMA of K, V (once), Q, dO (per block); LSE (log2 units) and delta
                  of each block to smem with its 32 lanes.                                 96
      warps 14-15 idle.                                                                   96
    Tensor memory (512 columns allocated; ``support.bwd_tmem_plan``, asserted at trace time):
      S^T  [0, 128)          keys x queries, fp32
      P^T  16-bit over S^T:  queries [0, 64) at columns [0, 32), queries [64, 128) at [64, 96):
                             each compute warpgroup writes P^T only over the S^T columns it
                             alone reads, so no barrier between the two is needed; the dV MMA
                             reads its two K halves from the two places.
      dP^T [128, 256)        keys x queries, fp32
      dQ   [128, 128 + d)    queries x d, fp32, over dP^T (dead once loaded; see the MMA order)
      dV   [256, 256 + dv)   dK [256 + dv, 256 + dv + d)     keys x d, fp32
      = 2 * 128 + d + dv columns: 384 (d 64), 448 (d 96), 512 (d 128). The CTA pair's plan
      (the same but dQ d / 2 wide; (192, 128) with S^T and dP^T sharing 64 columns) is Note
      [backward TMEM plan] in ``blackwell/support.py``.
    GEMMs of block i (all tcgen05, one CTA, M x N x K; SS: both operands in smem, TS: A in TMEM)
      S^T  = K Q^T     SS  128 x 128 x d    A sK (K-major), B sQ (K-major)
      dP^T = V dO^T    SS  128 x 128 x dv   A sV, B sdO
      dV  += P^T dO    TS  128 x dv x 128   A P^T (TMEM), B sdO viewed transposed (MN-major)
      dK  += dS^T Q    SS  128 x d x 128    A sdS (keys x queries, K-major), B sQ transposed
      dQ   = dS K      SS  128 x d x 128    A sdS transposed (MN-major), B sK transposed
      The transposed views are the same smem bytes (``cute_fa/dsl/copy.py transposed``).
      UTCHMMA count: prologue S and dP, then in the loop dV, S(i + 1), dK, dQ, dP(i + 1):
      2 (d / 16) + 2 (dv / 16) + 3 (128 / 16) MMA instructions (16 = the K of one MMA).
    MMA order (one thread; tcgen05 MMAs of one thread run in issue order):
      S(0); dP(0); then for each block i:
        wait P(i) (pipeline_s), dV (+)= P^T(i) dO(i), release dO(i);
        S(i + 1) = K Q(i + 1)^T (overwrites P^T(i): issued after the dV that reads it);
        wait dS(i) (pipeline_ds), dK (+)= dS^T(i) Q(i), release Q(i); dQ(i) = dS(i) K;
        commit dQ full; release sdS;
        wait dO(i + 1), dP^T(i) loaded (pipeline_dp) and dQ(i) drained (pipeline_dq), then
        dP(i + 1) = V dO(i + 1)^T (overwrites dQ(i)).
      After the last block: commit dK / dV full (pipeline_dkv).
    Pipelines (producer -> consumer, stages, arrivals on full / empty; ``self.protocol``)
      pipeline_kv  (PipelineTmaUmma)  load -> mma, 1 stage: K and V on one barrier, 1 arrive +
                   TMA bytes; used once, never released.
      pipeline_q   (PipelineTmaUmma)  load -> mma, 2 stages, 1 + TMA bytes / 1 (tcgen05.commit
                   after dK(i), the last reader of Q(i)).
      pipeline_do  (PipelineTmaUmma)  load -> mma, 1 stage, 1 + TMA bytes / 1 (commit after
                   dV(i)).
      pipeline_lse (PipelineAsync)    load -> compute, 2 stages (with Q's), 32 / 256: LSE_log2
                   and delta of the block's rows (LSE +inf for rows past seqlen_q or with no
                   key in the forward: P = 0 there, delta 0).
      pipeline_s   (PipelineUmmaAsync) mma -> compute, 1 stage, 1 (commit after S(i)) / 256
                   (each compute thread once its P^T is in TMEM: tcgen05.wait::st, arrive).
      pipeline_dp  (PipelineUmmaAsync) mma -> compute, 1 stage, 1 / 256 (once dP^T(i) is
                   loaded: tcgen05.fence::before_thread_sync, arrive).
      pipeline_ds  (PipelineAsyncUmma) compute -> mma, 1 stage, 256 (each thread after its dS^T
                   row half is in sdS and fence.proxy.async) / 1 (commit after dK(i), dQ(i)).
      pipeline_dq  (PipelineUmmaAsync) mma -> dq, 1 stage, 1 (commit after dQ(i)) / 128 (each
                   dq thread after its last tcgen05.ld of dQ(i)).
      pipeline_dkv (PipelineUmmaAsync) mma -> compute, 1 stage, 1 / 256; used once.
      Uses are counted, not carried (``cute_fa/dsl/ring.py ring_state``): block i is use i of
      every per-block pipeline; the MMA's wait for P(i) is its acquire of use i + 1 of
      pipeline_s (granted by the release of use i).
    Tail barriers (seqused; not pipelines): mbar_tail[0] (K and V of a CTA whose keys cut
      seqused_k, phase 0) and mbar_tail[1] (Q, phase 0, then dO, phase 1, of the block that
      holds seqused_q), 1 arrival + the tiles' bytes each, the load warp's own (``load_tail``):
      it waits, zeroes the rows past seqused, fences and only then completes the stage's full
      barrier of pipeline_kv / pipeline_q / pipeline_do with no bytes.
    Named barriers (``Barrier``): TMEM_ALLOC (416), TMEM_FREE (384), DQ_STAGE (128: per dQ
      chunk, after the threads wrote it to sdQ and warp 0 waited until the previous chunk's
      reduce-add has read its buffer; two buffers, so the writes of chunk c + 1 never meet
      the reduce of chunk c - 1).
    Compute step (thread t: key row t of the CTA, warpgroup w: queries [64 w, 64 w + 64)):
      wait LSE / delta(i), S(i); tcgen05.ld the 64 S^T values; softcap: tanh(S^T score_scale)
      (``softcap_scores``, shared with the sm80 / sm90 kernels); mask (causal: every block;
      window: the blocks that may cut an edge, ``query_block_mask_bounds``, one loop choosing
      the step per block; all blocks of a CTA whose keys cut seqlen_k; ``apply_mask`` on a
      (queries, 1 key) view of the row); P^T = exp2(S^T scale_log2 - LSE_log2[query]) (FFMA2 +
      MUFU.EX2); P^T -> 16 bits -> tcgen05.st over the warpgroup's own S^T columns; wait::st;
      release S (= P ready). Wait dP(i), acquire sdS; per 32-column chunk: tcgen05.ld dP^T,
      dS^T = P^T (dP^T - delta[query]) (FADD2 / FMUL2; softcap: P^T (1 - tanh^2) kept in
      place of P^T, Note [softcap gradient folded into P]), 16 bits -> sdS (16-byte stores);
      release dP after the last load; fence.proxy.async; commit sdS; release LSE / delta.
    Shared memory (K-major swizzled tiles, ``_operand_layout``): sK (128, d), sV (128, dv),
      sQ (128, d, 2), sdO (128, dv, 1), sdS (128 keys, 128 queries), sdQ (128, 16, 2) fp32,
      sLSE / sdPsum (128, 2) fp32. 132 KiB (d 64), 172 KiB (d 96), 212 KiB (d 128)
      (``support.bwd_smem_bytes``).
    Out of range: dense, TMA zero-fills Q / dO rows past seqlen_q and K / V rows past seqlen_k;
      varlen, those rows are the next sequence's (finite). Their LSE is +inf and delta 0 (P = 0,
      dS = 0); keys past seqlen_k are masked (P = 0, dS = 0), so every dQ row past seqlen_q and
      every dK / dV term from a key past seqlen_k is an exact 0. The TMA reduce clips rows past
      the tensor (dense); packed varlen adds exact zeros to the next sequence's dQaccum rows.
      dK / dV stores skip keys past seqlen_k. A CTA whose keys no query row sees (a window
      outside them, or, varlen, past its sequence) issues no MMA and stores dK = dV = 0 for
      its keys below seqlen_k. seqused_q / seqused_k: seqlen_q / seqlen_k are the used
      lengths; the rows between them and the end of the tensor (or sequence) may hold NaN,
      so the load warp zeroes them in smem (tail barriers above) before any MMA reads them;
      dK / dV rows past seqused_k are the caller's zeros (cute_fa/backward.py), dQ rows past
      seqused_q get exact zeros added.
    Deterministic dQ (config.deterministic; Note [deterministic dQ] in ampere/flash_bwd.py:
      each dQaccum element gets its terms in ascending key block order; the sm90 kernel's
      handshake, ``cute_fa/dsl/turns.py``)
      mdQsemaphore (batch, head, query block) int32, zeroed by the caller. Every role walks
      its query blocks downward. Only dq warp 0 (the one that issues the reduce-adds) touches
      the semaphores; for query block m, with turn = n_block - first_key_block(m), it
        1. before its wait for dQ(m) in TMEM (pipeline_dq; the spin overlaps the block's
           MMAs): lane 0 reads the semaphore (ld.acquire.gpu) until it equals turn;
           __syncwarp; fence.proxy.async.global;
        2. the block's d / 16 chunk reduce-adds as without determinism (the other dq warps
           meet it at DQ_STAGE per chunk);
        3. cp.async.bulk.wait_group 0 (the writes complete), fence.proxy.async.global,
           __syncwarp, lane 0: red.release.gpu.add 1.
      A CTA waits only for key blocks first_key_block(m) .. n_block - 1 of the same (batch,
      head): CTAs of lower index (causal: key blocks slowest in the grid), started first,
      whose turns never depend on higher key blocks: no deadlock. While warp 0 waits, dQ(m)
      stays in TMEM: the MMA warp's dP of the next block (over dQ's columns) waits for its
      drain, so a CTA runs at most one block ahead of its turn. Walking downward, every key
      block starts at the same last query blocks: key block n waits for n - 1's reduce-adds
      (a wavefront).
    Not yet: the 2-CTA MMA (the CTA pair: d 128, (192, 128); planned in Note [backward TMEM
      plan] and ``support.bwd_smem_bytes``, declined by ``bwd_can_implement``), a persistent
      / LPT scheduler, TMA stores of dK / dV, a dedicated dQ region at d 64 (TMEM has room;
      dP(i + 1) would not wait for the dQ drain, and a deterministic CTA could run further
      ahead of its turn).
    """

    arch = 100

    can_implement = staticmethod(bwd_can_implement)

    def __init__(self, config: BwdConfig):
        super().__init__(config)
        assert self.tile_m == WARPGROUP and self.tile_n == WARPGROUP
        self.half_m = self.tile_m // 2  # query columns of one compute warpgroup
        self.q_stages = SM100_BWD_Q_STAGES
        self.do_stages = SM100_BWD_DO_STAGES
        self.dq_chunk = SM100_BWD_DQ_CHUNK
        self.dq_stages = SM100_BWD_DQ_STAGES
        self.regs_compute, self.regs_dq, self.regs_other = SM100_BWD_REGS
        self.deterministic = config.deterministic
        self.num_threads = WARP * 16
        # TMEM plan (columns of 32 bits), asserted <= 512 by the plan itself.
        self.tmem = bwd_tmem_plan(self.tile_m, self.tile_hdim, self.tile_hdimv)
        # P^T of warpgroup w over the first half of its own S^T columns.
        self.tmem_p = [self.tmem["P"] + w * self.half_m for w in range(2)]
        assert self.half_m * self.dtype.width // 32 <= self.half_m  # P half fits its S half
        assert self.tmem["dQ"] + self.tile_hdim <= self.tmem["dP"] + self.tile_m
        assert self.tmem["total"] <= TMEM_COLUMNS
        assert self.tile_hdim % self.dq_chunk == 0 and self.half_m % DS_CHUNK == 0
        # dQ chunk c of every block goes through buffer c % dq_stages (reduce_dq).
        assert (self.tile_hdim // self.dq_chunk) % self.dq_stages == 0
        # Columns of dK / dV one compute thread moves per tcgen05.ld in the epilogue.
        self.epi_chunk = 32 if (self.tile_hdim // 2) % 32 == 0 else 16

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        max_seqlen_k: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mdQsemaphore: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        tm, tn, d, dv = self.tile_m, self.tile_n, self.tile_hdim, self.tile_hdimv
        # TMA views: (seqlen, d, heads, batch); dQaccum (seqlen, d, heads, batch) too.
        mQ_t, mK_t, mV_t, mdO_t = (
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mV, mdO)
        )
        mdQ_t = cute.make_tensor(mdQaccum.iterator, cute.select(mdQaccum.layout, mode=[2, 3, 1, 0]))
        sK_layout = self._operand_layout(tn, d, 1)
        sV_layout = self._operand_layout(tn, dv, 1)
        sQ_layout = self._operand_layout(tm, d, self.q_stages)
        sdO_layout = self._operand_layout(tm, dv, self.do_stages)
        sdS_layout = self._operand_layout(tn, tm, 1)
        self._check_operand_views(sK_layout, sV_layout, sQ_layout, sdO_layout, sdS_layout)
        sdQ_layout = sm100_utils.make_smem_layout_epi(
            Float32, LayoutEnum.ROW_MAJOR, (tm, self.dq_chunk), self.dq_stages
        )
        tile = lambda layout: cute.slice_(layout, (None, None, 0))  # noqa: E731
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(load, mK_t, tile(sK_layout), (tn, d))
        tma_v, mV_tma = cpasync.make_tiled_tma_atom(load, mV_t, tile(sV_layout), (tn, dv))
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(load, mQ_t, tile(sQ_layout), (tm, d))
        tma_do, mdO_tma = cpasync.make_tiled_tma_atom(load, mdO_t, tile(sdO_layout), (tm, dv))
        tma_dq, mdQ_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQ_t, tile(sdQ_layout), (tm, self.dq_chunk)
        )
        self.tx_kv = cute.size_in_bytes(self.dtype, tile(sK_layout)) + cute.size_in_bytes(
            self.dtype, tile(sV_layout)
        )
        self.tx_q = cute.size_in_bytes(self.dtype, tile(sQ_layout))
        self.tx_do = cute.size_in_bytes(self.dtype, tile(sdO_layout))
        # P^T in TMEM as the A operand of dV += P^T dO, one K half (64 queries) at a time.
        mma_dv_tiler = (tn, dv, self.half_m)
        tP_layout = sm100_utils.make_smem_layout_a(self.make_mma("dv"), mma_dv_tiler, self.dtype, 1)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages]
            mbar_lse: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dp: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_ds: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dq: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dkv: cute.struct.MemRange[cutlass.Int64, 2]
            # seqused: the load warp's own barriers of the tail tiles (K / V; Q, dO).
            mbar_tail: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.q_stages], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.q_stages], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        assert SharedStorage.size_in_bytes() <= bwd_smem_bytes(self.config)
        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)
        batch = cute.size(mQ.shape[0])
        if cutlass.const_expr(mCuSeqlensQ is not None):
            batch = mCuSeqlensQ.shape[0] - 1
        grid = bwd_grid(cute.ceil_div(max_seqlen_k, tn), cute.size(mQ.shape[2]), batch,
                        self.deterministic, self.causal)  # fmt: skip
        self.kernel(
            mQ_tma, mK_tma, mV_tma, mdO_tma, mdQ_tma, mQ, mK, mLSE, mdPsum, mdK, mdV,
            tma_q, tma_k, tma_v, tma_do, tma_dq, softmax_scale, score_scale, scale_log2,
            window_left, window_right, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
            mdQsemaphore, sK_layout, sV_layout, sQ_layout,
            sdO_layout, sdS_layout, sdQ_layout, tP_layout, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)  # fmt: skip

    def _operand_layout(self, rows: int, cols: int, stages: int) -> cute.ComposedLayout:
        """(rows, cols, stages) 16-bit smem tile, cols contiguous (K-major for the GEMM that
        reads it with cols as K), with the widest swizzle atom the columns allow (as
        ``make_smem_layout_a`` picks it). The transposed view is the MN-major operand of the
        GEMM that contracts over rows."""
        kind = sm100_utils.get_smem_layout_atom_ab(
            cute.nvgpu.OperandMajorMode.K, self.dtype, (rows, cols)
        )
        atom = sm100_utils.make_smem_layout_atom(kind, self.dtype)
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

    def _check_operand_views(self, sK_layout, sV_layout, sQ_layout, sdO_layout, sdS_layout):
        """Trace-time check that every smem operand view (a tile, or its transposed view) is
        the same map from (row, col, stage) to element as the canonical layout the DSL's
        ``make_smem_layout_a / _b`` builds for that GEMM's operand: the ten operand uses of the
        five GEMMs read the bytes TMA and the compute warps wrote, in the order the MMA
        expects. Sampled coordinates (every 7th row, every 5th column, the last of each)."""
        tm, tn, d, dv = self.tile_m, self.tile_n, self.tile_hdim, self.tile_hdimv

        def t(layout):
            return cute.select(layout, mode=[1, 0, 2])

        uses = (  # (view, GEMM, its M x N x K tiler, operand)
            (sK_layout, "s", (tn, tm, d), "a"), (sQ_layout, "s", (tn, tm, d), "b"),
            (sV_layout, "dp", (tn, tm, dv), "a"), (sdO_layout, "dp", (tn, tm, dv), "b"),
            (t(sdO_layout), "dv", (tn, dv, tm), "b"), (sdS_layout, "dk", (tn, d, tm), "a"),
            (t(sQ_layout), "dk", (tn, d, tm), "b"), (t(sdS_layout), "dq", (tm, d, tn), "a"),
            (t(sK_layout), "dq", (tm, d, tn), "b"),
        )  # fmt: skip
        for view, which, tiler, operand in uses:
            make = sm100_utils.make_smem_layout_b
            if operand == "a":
                make = sm100_utils.make_smem_layout_a
            stages = cute.size(view, mode=[2])
            canonical = make(self.make_mma(which), tiler, self.dtype, stages)
            rows, cols = cute.size(view, mode=[0]), cute.size(view, mode=[1])
            assert cute.size(canonical) == rows * cols * stages, which
            k_mma = 256 // self.dtype.width  # K of one 16-bit MMA: 16
            for s in range(stages):
                for r in [*range(0, rows, 7), rows - 1]:
                    for c in [*range(0, cols, 5), cols - 1]:
                        mine = cute.crd2idx((r, c, s), view)
                        want = cute.crd2idx(((r, c % k_mma), 0, c // k_mma, s), canonical)
                        assert mine == want, f"{which} {operand}: ({r}, {c}, {s}) {mine} != {want}"

    def make_mma(self, which: str, cols: int = 0) -> cute.TiledMma:
        """A fresh TiledMma (one whose ACCUMULATE field was set inside a staged loop or branch
        cannot be used outside it): "s" S^T = K Q^T, "dp" dP^T = V dO^T, "dv" dV += P^T dO (A
        from TMEM), "dk" dK += dS^T Q, "dq" dQ = dS K; "acc" a (128, cols) fp32 accumulator
        view of the same TMEM layout (thread = lane = row), for loads, stores and coordinates."""
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tm, tn, d, dv = self.tile_m, self.tile_n, self.tile_hdim, self.tile_hdimv
        a_major, b_major, shape, source = {
            "s": (K, K, (tn, tm), tcgen05.OperandSource.SMEM),
            "dp": (K, K, (tn, tm), tcgen05.OperandSource.SMEM),
            "dv": (K, MN, (tn, dv), tcgen05.OperandSource.TMEM),
            "dk": (K, MN, (tn, d), tcgen05.OperandSource.SMEM),
            "dq": (MN, MN, (tm, d), tcgen05.OperandSource.SMEM),
            "acc": (K, K, (WARPGROUP, cols), tcgen05.OperandSource.SMEM),
        }[which]
        return sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, a_major, b_major, Float32, tcgen05.CtaGroup.ONE, shape,
            source,
        )  # fmt: skip

    def tmem_acc(self, tmem_ptr: cute.Pointer, column: int, cols: int) -> cute.Tensor:
        """(128 lanes, cols) fp32 TMEM tensor from ``column`` of the plan."""
        thr = self.make_mma("acc", cols).get_slice(0)
        layout = thr.make_fragment_C(thr.partition_shape_C((WARPGROUP, cols))).layout
        return cute.make_tensor(tmem_ptr + column, layout)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ_tma: cute.Tensor,
        mK_tma: cute.Tensor,
        mV_tma: cute.Tensor,
        mdO_tma: cute.Tensor,
        mdQ_tma: cute.Tensor,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        tma_dq: cute.CopyAtom,
        softmax_scale: Float32,
        score_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mdQsemaphore: cute.Tensor | None,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        pipes = self._pipelines(storage)
        if cutlass.const_expr(self.config.seqused_q or self.config.seqused_k):
            if warp_idx == Role.LOAD:
                with cute.arch.elect_one():
                    for b in cutlass.range_constexpr(2):
                        cute.arch.mbarrier_init(storage.mbar_tail.data_ptr() + b, 1)
        tmem = TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=int(Barrier.TMEM_ALLOC), num_threads=WARP * (Role.MMA + 1)
            ),
            allocator_warp_id=int(Role.COMPUTE0),
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        smem_t = dict(
            sK=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)[None, None, 0],
            sV=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)[None, None, 0],
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sdO=storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            sdS=storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)[None, None, 0],
            sdQ=storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner),
            # LSE / delta of a block's rows: (STAT_VEC, rows / STAT_VEC, stage).
            sLSE=storage.sLSE.get_tensor(
                cute.make_layout((STAT_VEC, self.tile_m // STAT_VEC, self.q_stages))),
            sdPsum=storage.sdPsum.get_tensor(
                cute.make_layout((STAT_VEC, self.tile_m // STAT_VEC, self.q_stages))),
        )  # fmt: skip
        gmem = (mQ, mK, mLSE, mdPsum, mdK, mdV, mQ_tma, mK_tma, mV_tma, mdO_tma, mdQ_tma,
                mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mdQsemaphore, window_left,
                window_right)  # fmt: skip
        # Each role finds its CTA's work itself, after its setmaxnreg.
        if warp_idx == Role.LOAD:
            cute.arch.setmaxregister_decrease(self.regs_other)
            self.load(self.tile_work(*gmem), tma_q, tma_k, tma_v, tma_do, smem_t, pipes,
                      storage.mbar_tail.data_ptr())  # fmt: skip
        if warp_idx == Role.MMA:
            cute.arch.setmaxregister_decrease(self.regs_other)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.mma(self.tile_work(*gmem), smem_t, tP_layout, tmem_ptr, pipes)
        if warp_idx >= Role.IDLE:
            cute.arch.setmaxregister_decrease(self.regs_other)
        if warp_idx < Role.COMPUTE0:
            cute.arch.setmaxregister_decrease(self.regs_dq)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.reduce_dq(self.tile_work(*gmem), tma_dq, smem_t["sdQ"], tmem_ptr, pipes,
                           window_left, tidx % WARPGROUP, warp_idx)  # fmt: skip
            pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_FREE),
                                  num_threads=3 * WARPGROUP).arrive()  # fmt: skip
        if warp_idx >= Role.COMPUTE0 and warp_idx < Role.MMA:
            cute.arch.setmaxregister_increase(self.regs_compute)
            tmem.allocate(TMEM_COLUMNS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            # One code path for both compute warpgroups: the query half is a runtime value.
            self.compute(self.tile_work(*gmem), (warp_idx - Role.COMPUTE0) // 4, smem_t,
                         tmem_ptr, softmax_scale, ScoreScales(score_scale, scale_log2),
                         window_left, window_right, pipes, tidx % WARPGROUP)  # fmt: skip
            tmem.relinquish_alloc_permit()
            pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_FREE),
                                  num_threads=3 * WARPGROUP).arrive_and_wait()  # fmt: skip
            tmem.free(tmem_ptr, TMEM_COLUMNS)

    def _pipelines(self, storage) -> dict:
        """Every mbarrier pipeline of the class docstring, its arrival counts asserted."""
        compute_threads = 2 * WARPGROUP
        dq_threads = WARPGROUP
        load_threads = WARP
        assert (Role.MMA - Role.COMPUTE0) * WARP == compute_threads
        assert (Role.COMPUTE0 - Role.DQ) * WARP == dq_threads

        def group(n: int):
            return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)

        def tma(mbar, stages: int, tx: int):
            return pipeline.PipelineTmaUmma.create(
                barrier_storage=mbar.data_ptr(), num_stages=stages, producer_group=group(1),
                consumer_group=group(1), tx_count=tx, defer_sync=True,
            )  # fmt: skip

        def make(kind, mbar, producers: int, consumers: int, stages: int = 1):
            return kind.create(
                barrier_storage=mbar.data_ptr(), num_stages=stages,
                producer_group=group(producers), consumer_group=group(consumers),
                defer_sync=True,
            )  # fmt: skip

        pipes = dict(
            kv=tma(storage.mbar_kv, 1, self.tx_kv),
            q=tma(storage.mbar_q, self.q_stages, self.tx_q),
            do=tma(storage.mbar_do, self.do_stages, self.tx_do),
            lse=make(pipeline.PipelineAsync, storage.mbar_lse, load_threads, compute_threads,
                     self.q_stages),
            s=make(pipeline.PipelineUmmaAsync, storage.mbar_s, 1, compute_threads),
            dp=make(pipeline.PipelineUmmaAsync, storage.mbar_dp, 1, compute_threads),
            ds=make(pipeline.PipelineAsyncUmma, storage.mbar_ds, compute_threads, 1),
            dq=make(pipeline.PipelineUmmaAsync, storage.mbar_dq, 1, dq_threads),
            dkv=make(pipeline.PipelineUmmaAsync, storage.mbar_dkv, 1, compute_threads),
        )  # fmt: skip
        # The protocol the docstring states: (stages, producer arrivals, consumer arrivals).
        self.protocol = {
            "kv": (1, 1, 1), "q": (self.q_stages, 1, 1), "do": (self.do_stages, 1, 1),
            "lse": (self.q_stages, load_threads, compute_threads),
            "s": (1, 1, compute_threads), "dp": (1, 1, compute_threads),
            "ds": (1, compute_threads, 1), "dq": (1, 1, dq_threads),
            "dkv": (1, 1, compute_threads),
        }  # fmt: skip
        assert set(self.protocol) == set(pipes)
        for name, (stages, _, _) in self.protocol.items():
            assert pipes[name].num_stages == stages, name
        return pipes

    @cute.jit
    def tile_work(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mQ_tma: cute.Tensor,
        mK_tma: cute.Tensor,
        mV_tma: cute.Tensor,
        mdO_tma: cute.Tensor,
        mdQ_tma: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mdQsemaphore: cute.Tensor | None,
        window_left: Int32,
        window_right: Int32,
    ):
        """Where this CTA's keys lie and which query blocks it visits, the same in every role:
        (n_block, seqlen_q, seqlen_k, m_block_min, n_steps, and the (head, batch) views of Q,
        K, V, dO, dQaccum (TMA coordinates), LSE, delta, dK, dV, and of the dQ semaphores
        (deterministic; else None))."""
        n_block, head, batch = bwd_block_coords(self.deterministic, self.causal)
        offset_q, seqlen_q, offset_k, seqlen_k = seqlen_info(
            batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK
        )
        m_block_min, m_block_max = query_block_range(
            n_block, seqlen_q, seqlen_k, window_left, window_right, self.tile_m, self.tile_n,
            self.causal, self.local,
        )  # fmt: skip
        n_steps = cutlass.max(m_block_max - m_block_min, 0)
        if n_block * self.tile_n >= seqlen_k:
            n_steps = Int32(0)  # varlen: a key block past this sequence's keys
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        qb = 0 if cutlass.const_expr(mCuSeqlensQ is not None) else batch
        kb = 0 if cutlass.const_expr(mCuSeqlensK is not None) else batch
        views = (
            cute.domain_offset((offset_q, 0), mQ_tma[None, None, head, qb]),
            cute.domain_offset((offset_k, 0), mK_tma[None, None, head_kv, kb]),
            cute.domain_offset((offset_k, 0), mV_tma[None, None, head_kv, kb]),
            cute.domain_offset((offset_q, 0), mdO_tma[None, None, head, qb]),
            cute.domain_offset((offset_q, 0), mdQ_tma[None, None, head, qb]),
            cute.domain_offset((offset_q,), mLSE[qb, head, None]),
            cute.domain_offset((offset_q,), mdPsum[qb, head, None]),
            cute.domain_offset((offset_k, 0), mdK[kb, None, head, None]),
            cute.domain_offset((offset_k, 0), mdV[kb, None, head, None]),
            mdQsemaphore[batch, head, None] if cutlass.const_expr(self.deterministic) else None,
        )
        return (n_block, seqlen_q, seqlen_k, m_block_min, n_steps) + views

    @cute.jit
    def query_block(self, i: Int32, m_block_min: Int32, n_steps: Int32) -> Int32:
        """The i-th query block every role of this CTA visits: ascending from m_block_min, or
        deterministic downward from the last (``visited_query_block``; docstring:
        deterministic dQ)."""
        return visited_query_block(i, m_block_min, m_block_min + n_steps, self.deterministic)

    @cute.jit
    def load(
        self,
        work: tuple,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        smem_t: dict,
        pipes: dict,
        mbar_tail: cute.Pointer,
    ):
        """Load warp: K and V once; per block i: Q(i) (use i of pipeline_q), LSE / delta(i)
        (use i of pipeline_lse, the 32 lanes), dO(i) (use i of pipeline_do). seqused_k: K and
        V of a CTA whose keys cut seqlen_k, seqused_q: Q and dO of the block that holds
        seqlen_q, through ``load_tail`` (their rows past seqused zeroed)."""
        (n_block, seqlen_q, seqlen_k, m_block_min, n_steps, mQ, mK, mV, mdO, _, mLSE, mdPsum, _,
         _, _) = work  # fmt: skip
        tm, tn, d, dv = self.tile_m, self.tile_n, self.tile_hdim, self.tile_hdimv
        lane = cute.arch.lane_idx()

        def part(atom, s, g):
            return cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
            )

        sK = cute.append_ones(smem_t["sK"])
        sV = cute.append_ones(smem_t["sV"])
        tKsK, tKgK = part(tma_k, sK, cute.local_tile(mK, (tn, d), (None, 0)))
        tVsV, tVgV = part(tma_v, sV, cute.local_tile(mV, (tn, dv), (None, 0)))
        tQsQ, tQgQ = part(tma_q, smem_t["sQ"], cute.local_tile(mQ, (tm, d), (None, 0)))
        tdOsdO, tdOgdO = part(tma_do, smem_t["sdO"], cute.local_tile(mdO, (tm, dv), (None, 0)))
        for atom in (tma_q, tma_do, tma_k, tma_v):
            cpasync.prefetch_descriptor(atom)
        pipeline_kv, pipeline_q, pipeline_do = pipes["kv"], pipes["q"], pipes["do"]
        pipeline_lse = pipes["lse"]
        sLSE, sdPsum = smem_t["sLSE"], smem_t["sdPsum"]
        seqused_q, seqused_k = self.config.seqused_q, self.config.seqused_k
        if n_steps > 0:
            kv_state = ring_state(1, 0, producer=True)
            kv = ((tma_k, tKgK[None, n_block], tKsK[None, 0]),
                  (tma_v, tVgV[None, n_block], tVsV[None, 0]))  # fmt: skip
            if cutlass.const_expr(seqused_k):
                valid_k = seqlen_k - n_block * tn
                if valid_k < tn:
                    self.load_tail(kv, pipeline_kv, kv_state, (smem_t["sK"], smem_t["sV"]),
                                   valid_k, mbar_tail, 0, self.tx_kv)  # fmt: skip
                else:
                    self.load_tiles(kv, pipeline_kv, kv_state)
            else:
                self.load_tiles(kv, pipeline_kv, kv_state)
        for i in cutlass.range(n_steps, unroll=1):
            m_block = self.query_block(i, m_block_min, n_steps)
            valid_q = seqlen_q - m_block * tm
            q_state = ring_state(self.q_stages, i, producer=True)
            q = ((tma_q, tQgQ[None, m_block], tQsQ[None, q_state.index]),)
            if cutlass.const_expr(seqused_q):
                # Only the block that holds seqlen_q (the last visited, deterministic the
                # first): phase 0 of tail
                # barrier 1 for Q, phase 1 for dO.
                if valid_q < tm:
                    self.load_tail(q, pipeline_q, q_state,
                                   (smem_t["sQ"][None, None, q_state.index],), valid_q,
                                   mbar_tail + 1, 0, self.tx_q)  # fmt: skip
                else:
                    self.load_tiles(q, pipeline_q, q_state)
            else:
                self.load_tiles(q, pipeline_q, q_state)
            # LSE in log2 units and delta of the block's rows; rows past seqlen_q and rows that
            # saw no key in the forward (LSE = -inf) get +inf: P = 0 there.
            pipeline_lse.producer_acquire(q_state)
            for r in cutlass.range_constexpr(tm // WARP):
                row = r * WARP + lane
                lse_log2 = Float32.inf
                dpsum = Float32(0.0)
                if m_block * tm + row < seqlen_q:
                    lse_log2 = lse_for_recompute(mLSE[m_block * tm + row])
                    dpsum = mdPsum[m_block * tm + row]
                sLSE[row % STAT_VEC, row // STAT_VEC, q_state.index] = lse_log2
                sdPsum[row % STAT_VEC, row // STAT_VEC, q_state.index] = dpsum
            pipeline_lse.producer_commit(q_state)
            do_state = ring_state(self.do_stages, i, producer=True)
            do = ((tma_do, tdOgdO[None, m_block], tdOsdO[None, do_state.index]),)
            if cutlass.const_expr(seqused_q):
                if valid_q < tm:
                    self.load_tail(do, pipeline_do, do_state,
                                   (smem_t["sdO"][None, None, do_state.index],), valid_q,
                                   mbar_tail + 1, 1, self.tx_do)  # fmt: skip
                else:
                    self.load_tiles(do, pipeline_do, do_state)
            else:
                self.load_tiles(do, pipeline_do, do_state)

    @cute.jit
    def load_tiles(self, copies: tuple, pipe, state: pipeline.PipelineState):
        """One use of a TMA pipeline: acquire its stage, then every (atom, gmem, smem) copy on
        its full barrier (which expects the bytes of all of them: ``tx_*``)."""
        pipe.producer_acquire(state)
        for atom, src, dst in copies:
            cute.copy(atom, src, dst, tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def load_tail(self, copies: tuple, pipe, state: pipeline.PipelineState, tiles: tuple,
                  valid: Int32, mbar: cute.Pointer, phase: cutlass.Constexpr[int],
                  tx_bytes: cutlass.Constexpr[int]):  # fmt: skip
        """seqused: ``load_tiles`` with the rows [valid, rows) of every (rows, cols) smem tile
        of ``tiles`` zeroed before the MMA warp may read the stage.

        Rows past seqused_q / seqused_k (up to the end of the tensor or of the sequence) are
        not inputs and may hold NaN: their P and dS are 0, but 0 * NaN in the GEMMs that read
        them (S^T, dP^T, dQ = dS K, dK += dS^T Q, dV += P^T dO) would spread. The copies
        complete on the load warp's own barrier ``mbar`` (1 arrival + ``tx_bytes``; phase
        ``phase``: each tail barrier is used at most twice a CTA, at fixed points) instead of
        the stage's full barrier; the warp waits for it, zeroes the rows (lane l: every 32nd
        element from l), fences the generic-proxy stores for the async proxy (the MMAs read
        smem through it) and only then arrives on the stage's full barrier with no bytes
        expected, which completes its phase. The stage's empty wait comes first, as in any
        acquire (the forward's ``load_v_tail`` does the same for V)."""
        pipe.sync_object_empty.wait(state.index, state.phase)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, tx_bytes)
        for atom, src, dst in copies:
            cute.copy(atom, src, dst, tma_bar_ptr=mbar)
        cute.arch.mbarrier_wait(mbar, phase)
        for tile in tiles:
            zero_rows_from(tile, valid, cute.arch.lane_idx(), WARP)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        pipe.producer_acquire(state, try_acquire_token=cutlass.Boolean(True), expected_tx=0)

    @cute.jit
    def mma(self, work: tuple, smem_t: dict, tP_layout: cute.ComposedLayout,
            tmem_ptr: cute.Pointer, pipes: dict):  # fmt: skip
        """MMA warp: the order of the class docstring. Block i is use i of every per-block
        pipeline."""
        n_steps = work[4]
        thr_s = self.make_mma("s").get_slice(0)
        thr_dp = self.make_mma("dp").get_slice(0)
        thr_dv = self.make_mma("dv").get_slice(0)
        thr_dk = self.make_mma("dk").get_slice(0)
        thr_dq = self.make_mma("dq").get_slice(0)
        sK, sV, sQ, sdO, sdS = (smem_t[k] for k in ("sK", "sV", "sQ", "sdO", "sdS"))
        # Operand fragments (smem descriptors); transposed views are the same bytes.
        tSrK = thr_s.make_fragment_A(thr_s.partition_A(sK))
        tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ))
        tdPrV = thr_dp.make_fragment_A(thr_dp.partition_A(sV))
        tdPrdO = thr_dp.make_fragment_B(thr_dp.partition_B(sdO))
        tdVrdO = thr_dv.make_fragment_B(thr_dv.partition_B(transposed(sdO)))
        tdKrdS = thr_dk.make_fragment_A(thr_dk.partition_A(sdS))
        tdKrQ = thr_dk.make_fragment_B(thr_dk.partition_B(transposed(sQ)))
        tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(transposed(sdS)))
        tdQrK = thr_dq.make_fragment_B(thr_dq.partition_B(transposed(sK)))
        # P^T halves (TMEM A operands, K = 64 queries each).
        tP = thr_dv.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))
        tP = tP[None, None, None, 0]
        tdVrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_p[w], dtype=self.dtype),
                                  tP.layout)
                 for w in range(2)]  # fmt: skip
        acc_S = cute.make_tensor(tmem_ptr + self.tmem["S"], self._acc_layout(thr_s, "s"))
        acc_dP = cute.make_tensor(tmem_ptr + self.tmem["dP"], self._acc_layout(thr_dp, "dp"))
        acc_dV = cute.make_tensor(tmem_ptr + self.tmem["dV"], self._acc_layout(thr_dv, "dv"))
        acc_dK = cute.make_tensor(tmem_ptr + self.tmem["dK"], self._acc_layout(thr_dk, "dk"))
        acc_dQ = cute.make_tensor(tmem_ptr + self.tmem["dQ"], self._acc_layout(thr_dq, "dq"))
        pipeline_kv, pipeline_q, pipeline_do = pipes["kv"], pipes["q"], pipes["do"]
        pipeline_s, pipeline_ds = pipes["s"], pipes["ds"]
        pipeline_dq, pipeline_dkv = pipes["dq"], pipes["dkv"]
        if n_steps > 0:
            pipeline_kv.consumer_wait(ring_state(1, 0, producer=False))
            # Prologue: S(0), dP(0).
            q_state = ring_state(self.q_stages, 0, producer=False)
            pipeline_q.consumer_wait(q_state)
            pipeline_s.producer_acquire(ring_state(1, 0, producer=True))
            self.gemm("s", acc_S, tSrK, tSrQ[None, None, None, q_state.index], False)
            pipeline_s.producer_commit(ring_state(1, 0, producer=True))
            self.issue_dp(acc_dP, tdPrV, tdPrdO, pipes, 0)
            for i in cutlass.range(n_steps, unroll=1):
                q_state = ring_state(self.q_stages, i, producer=False)
                do_state = ring_state(self.do_stages, i, producer=False)
                # dV (+)= P^T(i) dO(i), once P(i) is in TMEM (acquire of use i + 1 of
                # pipeline_s = release of use i).
                pipeline_s.producer_acquire(ring_state(1, i + 1, producer=True))
                for w in cutlass.range_constexpr(2):
                    self.gemm("dv", acc_dV, tdVrP[w],
                              tdVrdO[None, None, None, do_state.index], i > 0, w)  # fmt: skip
                pipeline_do.consumer_release(do_state)
                # S(i + 1) over P^T(i): issued after the dV GEMM that reads P^T(i).
                if i + 1 < n_steps:
                    q_next = ring_state(self.q_stages, i + 1, producer=False)
                    pipeline_q.consumer_wait(q_next)
                    self.gemm("s", acc_S, tSrK, tSrQ[None, None, None, q_next.index], False)
                    pipeline_s.producer_commit(ring_state(1, i + 1, producer=True))
                # dK (+)= dS^T(i) Q(i); dQ(i) = dS(i) K.
                ds_state = ring_state(1, i, producer=False)
                pipeline_ds.consumer_wait(ds_state)
                self.gemm("dk", acc_dK, tdKrdS, tdKrQ[None, None, None, q_state.index], i > 0)
                pipeline_q.consumer_release(q_state)
                self.gemm("dq", acc_dQ, tdQrdS, tdQrK, False)
                pipeline_dq.producer_commit(ring_state(1, i, producer=True))
                pipeline_ds.consumer_release(ds_state)
                if i + 1 < n_steps:
                    self.issue_dp(acc_dP, tdPrV, tdPrdO, pipes, i + 1)
            pipeline_dkv.producer_commit(ring_state(1, 0, producer=True))

    def _acc_layout(self, thr: cute.ThrMma, which: str) -> cute.Layout:
        tm, tn, d, dv = self.tile_m, self.tile_n, self.tile_hdim, self.tile_hdimv
        shape = {"s": (tn, tm), "dp": (tn, tm), "dv": (tn, dv), "dk": (tn, d), "dq": (tm, d)}
        return thr.make_fragment_C(thr.partition_shape_C(shape[which])).layout

    @cute.jit
    def issue_dp(self, acc_dP: cute.Tensor, tdPrV: cute.Tensor, tdPrdO: cute.Tensor,
                 pipes: dict, i: Int32):  # fmt: skip
        """dP^T(i) = V dO(i)^T once dO(i) landed, dP^T(i - 1) was loaded (pipeline_dp, use i)
        and dQ(i - 1), which shares its columns, was drained (pipeline_dq, use i)."""
        do_state = ring_state(self.do_stages, i, producer=False)
        pipes["do"].consumer_wait(do_state)
        pipes["dp"].producer_acquire(ring_state(1, i, producer=True))
        pipes["dq"].producer_acquire(ring_state(1, i, producer=True))
        self.gemm("dp", acc_dP, tdPrV, tdPrdO[None, None, None, do_state.index], False)
        pipes["dp"].producer_commit(ring_state(1, i, producer=True))

    @cute.jit
    def gemm(self, which: cutlass.Constexpr[str], acc: cute.Tensor, tA: cute.Tensor,
             tB: cute.Tensor, accumulate, b_k_half: cutlass.Constexpr[int] = -1):  # fmt: skip
        """acc (+)= A B over the K phases of tA (``accumulate`` False overwrites acc on the
        first phase). ``b_k_half`` >= 0: tA is one K half (dV's P^T halves) and B's phases of
        that half are taken."""
        tiled_mma = self.make_mma(which)
        phases = cute.size(tA, mode=[2])
        for k in cutlass.range_constexpr(phases):
            if cutlass.const_expr(k == 0 and b_k_half <= 0):
                tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
            else:
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
            kb = k if cutlass.const_expr(b_k_half < 0) else b_k_half * phases + k
            cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, kb], acc)

    @cute.jit
    def compute(
        self,
        work: tuple,
        half: Int32,
        smem_t: dict,
        tmem_ptr: cute.Pointer,
        softmax_scale: Float32,
        scales: ScoreScales,
        window_left: Int32,
        window_right: Int32,
        pipes: dict,
        tidx: Int32,
    ):
        """Compute warpgroup ``half`` (0 or 1, a runtime value): query columns [64 half,
        64 half + 64) of every block, thread ``tidx`` key row ``tidx`` (docstring: compute
        step); then its half of the columns of dK and dV to global."""
        (n_block, seqlen_q, seqlen_k, m_block_min, n_steps, _, _, _, _, _, _, _, mdK,
         mdV, _) = work  # fmt: skip
        hm = self.half_m
        # S^T half: (128 keys, 64 queries) at column 64 half; P^T half: 32 fp32 words at the
        # same column; dP^T chunks of DS_CHUNK queries.
        tS = self.tmem_acc(tmem_ptr, self.tmem["S"], hm)
        tS = cute.make_tensor(tS.iterator + half * hm, tS.layout)
        p_words = hm * self.dtype.width // 32
        tP = self.tmem_acc(tmem_ptr, self.tmem["P"], p_words)
        tP = cute.make_tensor(tP.iterator + half * hm, tP.layout)
        tdP = self.tmem_acc(tmem_ptr, self.tmem["dP"], DS_CHUNK)
        load_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tS,
        )
        store_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(p_words)),
                                Float32),
            tP,
        )  # fmt: skip
        load_dp = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(DS_CHUNK)),
                                Float32),
            tdP,
        )  # fmt: skip
        thr_load_s = load_s.get_slice(tidx)
        thr_store_p = store_p.get_slice(tidx)
        thr_load_dp = load_dp.get_slice(tidx)
        thr_acc_h = self.make_mma("acc", hm).get_slice(0)
        thr_acc_c = self.make_mma("acc", DS_CHUNK).get_slice(0)
        # (query, key) coordinates of the thread's row half, as a (queries, 1 key) view.
        tScS = thr_load_s.partition_D(
            thr_acc_h.partition_C(transposed(cute.make_identity_tensor((hm, self.tile_n))))
        )
        sdS = smem_t["sdS"]
        dP_shape = thr_load_dp.partition_D(
            thr_acc_c.partition_C(cute.make_identity_tensor((self.tile_n, DS_CHUNK)))
        ).shape
        # Register j of a thread's S^T half (and of a dP^T chunk) is query column j: the LSE /
        # delta reads below index by it (32x32b: the same for every thread, so thread 0's
        # static coordinates are checked).
        t0ScS = load_s.get_slice(0).partition_D(
            thr_acc_h.partition_C(transposed(cute.make_identity_tensor((hm, self.tile_n))))
        )
        t0dPcdP = load_dp.get_slice(0).partition_D(
            thr_acc_c.partition_C(transposed(cute.make_identity_tensor((DS_CHUNK, self.tile_n))))
        )
        for frag in (t0ScS, t0dPcdP):
            for j in cutlass.range_constexpr(cute.size(frag)):
                assert frag[j][0] == j, f"register {j} holds query {frag[j][0]}"
        tPrP_shape = thr_store_p.partition_S(tP).shape
        step = (thr_load_s.partition_S(tS), tScS, load_s, store_p, thr_store_p.partition_D(tP),
                tPrP_shape, load_dp, thr_load_dp, thr_acc_c, tdP, dP_shape, sdS, smem_t["sLSE"],
                smem_t["sdPsum"], pipes, half, tidx, n_block, seqlen_q, seqlen_k, window_left,
                window_right, scales)  # fmt: skip
        # Sliding window: the query blocks [lo, hi) cut neither window edge (blocks before lo
        # may cut the right edge, from hi on the left one), none in a CTA whose keys cut
        # seqlen_k. One loop picks the step per block (a loop per kind keeps more values live:
        # the forward's window as a third loop spilled).
        lo, hi = Int32(0), Int32(0)
        if cutlass.const_expr(self.local):
            lo, hi = query_block_mask_bounds(
                n_block, seqlen_q, seqlen_k, window_left, window_right, self.tile_m,
                self.tile_n, False, True,
            )  # fmt: skip
            if (n_block + 1) * self.tile_n > seqlen_k:
                hi = lo
        for i in cutlass.range(n_steps, unroll=1):
            m_block = self.query_block(i, m_block_min, n_steps)
            if cutlass.const_expr(self.causal):
                self.compute_step(step, i, m_block, True)
            elif cutlass.const_expr(self.local):
                if m_block >= lo and m_block < hi:
                    self.compute_step(step, i, m_block, False)
                else:
                    self.compute_step(step, i, m_block, True)
            else:
                # Only a CTA whose keys cut seqlen_k needs the mask (a per-CTA choice).
                if (n_block + 1) * self.tile_n > seqlen_k:
                    self.compute_step(step, i, m_block, True)
                else:
                    self.compute_step(step, i, m_block, False)
        self.epilogue(n_steps, seqlen_k, n_block, tmem_ptr, mdK, mdV, softmax_scale, pipes,
                      half, tidx)  # fmt: skip

    @cute.jit
    def compute_step(self, step: tuple, i: Int32, m_block: Int32,
                     masked: cutlass.Constexpr[bool]):  # fmt: skip
        """Block i (query block m_block) of one compute thread: S^T -> P^T (TMEM), dP^T ->
        dS^T (sdS). Use i of pipeline_s, pipeline_dp, pipeline_ds and pipeline_lse."""
        (tStS_t, tScS, load_s, store_p, tStP_t, tPrP_shape, load_dp, thr_load_dp, thr_acc_c, tdP,
         dP_shape, sdS, sLSE, sdPsum, pipes, half, tidx, n_block, seqlen_q, seqlen_k, window_left,
         window_right, scales) = step  # fmt: skip
        score_scale, scale_log2 = scales
        hm = self.half_m
        state = ring_state(1, i, producer=False)
        lse_state = ring_state(self.q_stages, i, producer=False)
        pipes["lse"].consumer_wait(lse_state)
        pipes["s"].consumer_wait(state)
        tSrS = cute.make_rmem_tensor(tScS.shape, Float32)
        cute.copy(load_s, tStS_t, tSrS)
        if cutlass.const_expr(self.has_softcap):  # before the mask: -inf stays -inf
            softcap_scores(tSrS, score_scale)
        if cutlass.const_expr(masked):
            n = cute.size(tSrS)
            col_view = cute.make_layout((n, 1))
            apply_mask(cute.make_tensor(tSrS.iterator, cute.composition(tSrS.layout, col_view)),
                       cute.make_tensor(tScS.iterator, cute.composition(tScS.layout, col_view)),
                       m_block * self.tile_m + half * hm, n_block * self.tile_n, seqlen_q,
                       seqlen_k, window_left, window_right, self.causal, self.local)  # fmt: skip
        # P^T = exp2(S^T scale_log2 - LSE_log2[query]); element j is query 64 half + j.
        tPrP = cute.make_rmem_tensor(tPrP_shape, Float32)
        tPrP_16 = cute.make_tensor(cute.recast_ptr(tPrP.iterator, dtype=self.dtype), tSrS.layout)
        stat = cute.make_rmem_tensor((STAT_VEC,), Float32)
        p_vec = cute.make_rmem_tensor((STAT_VEC,), Float32)
        one = Float32(1.0)
        if cutlass.const_expr(self.has_softcap):  # P^T's groups of STAT_VEC are contiguous
            for j in cutlass.range_constexpr(cute.size(tSrS)):
                assert cute.crd2idx(j, tSrS.layout) == j
        for g in cutlass.range_constexpr(hm // STAT_VEC):
            cute.autovec_copy(sLSE[None, half * (hm // STAT_VEC) + g, lse_state.index], stat)
            for v in cutlass.range_constexpr(0, STAT_VEC, 2):
                j = g * STAT_VEC + v
                a0, a1 = cute.arch.fma_packed_f32x2((tSrS[j], tSrS[j + 1]),
                                                    (scale_log2, scale_log2),
                                                    (-stat[v], -stat[v + 1]))  # fmt: skip
                p0 = cute.math.exp2(a0, fastmath=True)
                p1 = cute.math.exp2(a1, fastmath=True)
                if cutlass.const_expr(self.has_softcap):
                    # Note [softcap gradient folded into P]: keep P(1 - tanh^2) for dS.
                    p_vec[v], p_vec[v + 1] = p0, p1
                    t0, t1 = tSrS[j], tSrS[j + 1]
                    d0, d1 = cute.arch.fma_packed_f32x2((t0, t1), (-t0, -t1), (one, one))
                    d0 = cute.arch.fmax(d0, Float32(0.0))  # a masked score: 1 - inf^2 -> 0
                    d1 = cute.arch.fmax(d1, Float32(0.0))
                    tSrS[j], tSrS[j + 1] = cute.arch.mul_packed_f32x2((p0, p1), (d0, d1))
                else:
                    tSrS[j], tSrS[j + 1] = p0, p1
            if cutlass.const_expr(self.has_softcap):
                p_g = cute.make_tensor(tPrP_16.iterator + g * STAT_VEC,
                                       cute.make_layout(STAT_VEC))  # fmt: skip
                p_g.store(p_vec.load().to(self.dtype))
        if cutlass.const_expr(not self.has_softcap):
            tPrP_16.store(tSrS.load().to(self.dtype))
        cute.copy(store_p, tPrP, tStP_t)
        cute.arch.fence_view_async_tmem_store()
        pipes["s"].consumer_release(state)
        # dS^T = P^T (dP^T - delta[query]) by chunks of DS_CHUNK queries, 16-bit into sdS
        # (softcap: tSrS holds P^T (1 - tanh^2)).
        pipes["dp"].consumer_wait(state)
        pipes["ds"].producer_acquire(ring_state(1, i, producer=True))
        chunks = hm // DS_CHUNK
        for c in cutlass.range_constexpr(chunks):
            col = half * hm + c * DS_CHUNK
            tdPrdP = cute.make_rmem_tensor(dP_shape, Float32)
            cute.copy(load_dp, thr_load_dp.partition_S(cute.make_tensor(tdP.iterator + col,
                                                                         tdP.layout)),
                      tdPrdP)  # fmt: skip
            if cutlass.const_expr(c == chunks - 1):
                cute.arch.fence_view_async_tmem_load()
                pipes["dp"].consumer_release(state)
            for g in cutlass.range_constexpr(DS_CHUNK // STAT_VEC):
                cute.autovec_copy(sdPsum[None, (col // STAT_VEC) + g, lse_state.index], stat)
                for v in cutlass.range_constexpr(0, STAT_VEC, 2):
                    j = g * STAT_VEC + v
                    p = (tSrS[c * DS_CHUNK + j], tSrS[c * DS_CHUNK + j + 1])
                    t0, t1 = cute.arch.sub_packed_f32x2((tdPrdP[j], tdPrdP[j + 1]),
                                                        (stat[v], stat[v + 1]))  # fmt: skip
                    tdPrdP[j], tdPrdP[j + 1] = cute.arch.mul_packed_f32x2(p, (t0, t1))
            tdSrdS = cute.make_rmem_tensor(tdPrdP.shape, self.dtype)
            tdSrdS.store(tdPrdP.load().to(self.dtype))
            sdS_c = cute.local_tile(sdS, (self.tile_n, DS_CHUNK), (0, half * chunks + c))
            cute.autovec_copy(tdSrdS, thr_load_dp.partition_D(thr_acc_c.partition_C(sdS_c)))
        cute.arch.fence_view_async_shared()
        pipes["ds"].producer_commit(ring_state(1, i, producer=True))
        pipes["lse"].consumer_release(lse_state)

    @cute.jit
    def epilogue(self, n_steps: Int32, seqlen_k: Int32, n_block: Int32, tmem_ptr: cute.Pointer,
                 mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32, pipes: dict,
                 half: Int32, tidx: Int32):  # fmt: skip
        """dK * softmax_scale and dV of this thread's key row, columns of warpgroup ``half``,
        16-bit to global; keys past seqlen_k not written; zeros when no block was visited."""
        if n_steps > 0:
            pipes["dkv"].consumer_wait(ring_state(1, 0, producer=False))
        ec = self.epi_chunk
        tE = self.tmem_acc(tmem_ptr, 0, ec)
        load_e = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(ec)), Float32),
            tE,
        )
        thr_load_e = load_e.get_slice(tidx)
        thr_acc = self.make_mma("acc", ec).get_slice(0)
        # This thread's key row (lane = row), from the coordinates of its fragment.
        tEcE = thr_load_e.partition_D(
            thr_acc.partition_C(cute.make_identity_tensor((self.tile_n, ec)))
        )
        key = n_block * self.tile_n + tEcE[0][0]
        for m, cols, base, scale in ((mdK, self.tile_hdim, self.tmem["dK"], True),
                                     (mdV, self.tile_hdimv, self.tmem["dV"], False)):  # fmt: skip
            gX = cute.local_tile(m, (self.tile_n, ec), (n_block, None))
            for c in cutlass.range_constexpr(cols // 2 // ec):
                col = half * (cols // 2) + c * ec
                tXrX = cute.make_rmem_tensor(
                    thr_load_e.partition_D(thr_acc.partition_C(gX[None, None, 0])).shape, Float32
                )
                if n_steps > 0:
                    cute.copy(
                        load_e,
                        thr_load_e.partition_S(
                            cute.make_tensor(tE.iterator + base + col, tE.layout)
                        ),
                        tXrX,
                    )
                    if cutlass.const_expr(scale):
                        tXrX.store(tXrX.load() * softmax_scale)
                else:
                    tXrX.fill(0.0)
                tXrX_16 = cute.make_rmem_tensor(tXrX.shape, self.dtype)
                tXrX_16.store(tXrX.load().to(self.dtype))
                if key < seqlen_k:
                    g = gX[None, None, half * (cols // 2 // ec) + c]
                    cute.autovec_copy(tXrX_16, thr_load_e.partition_D(thr_acc.partition_C(g)))
        if n_steps > 0:
            cute.arch.fence_view_async_tmem_load()

    @cute.jit
    def reduce_dq(self, work: tuple, tma_dq: cute.CopyAtom, sdQ: cute.Tensor,
                  tmem_ptr: cute.Pointer, pipes: dict, window_left: Int32, tidx: Int32,
                  warp_idx: Int32):  # fmt: skip
        """dQ warpgroup: per block, dQ (thread = query row) from TMEM in chunks of dq_chunk
        columns to sdQ (dq_stages buffers), one TMA reduce-add per chunk issued by warp 0
        (docstring: named barrier DQ_STAGE). Use i of pipeline_dq. Deterministic: warp 0
        takes the block's turn before its first reduce-add and passes it on after the last
        (docstring: deterministic dQ)."""
        (n_block, seqlen_q, seqlen_k, m_block_min, n_steps, _, _, _, _, mdQ, _, _, _, _,
         mSem) = work  # fmt: skip
        tm, ch = self.tile_m, self.dq_chunk
        chunks = self.tile_hdim // ch
        gdQ = cute.local_tile(mdQ, (tm, ch), (None, None))
        tdQsdQ, tdQgdQ = cpasync.tma_partition(
            tma_dq, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
            cute.group_modes(gdQ, 0, 2),
        )  # fmt: skip
        if warp_idx == Role.DQ:
            cpasync.prefetch_descriptor(tma_dq)
        tQ = self.tmem_acc(tmem_ptr, self.tmem["dQ"], ch)
        load_q = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(ch)), Float32),
            tQ,
        )
        thr_load = load_q.get_slice(tidx)
        thr_acc = self.make_mma("acc", ch).get_slice(0)
        tdQsdQ_t = [thr_load.partition_D(thr_acc.partition_C(sdQ[None, None, s]))
                    for s in range(self.dq_stages)]  # fmt: skip
        stage_bar = pipeline.NamedBarrier(barrier_id=int(Barrier.DQ_STAGE), num_threads=WARPGROUP)
        for i in cutlass.range(n_steps, unroll=1):
            m_block = self.query_block(i, m_block_min, n_steps)
            state = ring_state(1, i, producer=False)
            if cutlass.const_expr(self.deterministic):
                if warp_idx == Role.DQ:
                    # Before dQ(i) is in TMEM: the spin overlaps the MMAs of the block.
                    wait_dq_turn(mSem, m_block,
                                 dq_turn(m_block, n_block, seqlen_q, seqlen_k, window_left,
                                         self.tile_m, self.tile_n, self.local))  # fmt: skip
            pipes["dq"].consumer_wait(state)
            for c in cutlass.range_constexpr(chunks):
                stage = c % self.dq_stages  # chunks is even: stage c % 2 in every block
                tdQrdQ = cute.make_rmem_tensor(tdQsdQ_t[0].shape, Float32)
                cute.copy(
                    load_q,
                    thr_load.partition_S(cute.make_tensor(tQ.iterator + c * ch, tQ.layout)),
                    tdQrdQ,
                )
                if cutlass.const_expr(c == chunks - 1):
                    cute.arch.fence_view_async_tmem_load()
                    pipes["dq"].consumer_release(state)
                cute.autovec_copy(tdQrdQ, tdQsdQ_t[stage])
                cute.arch.fence_view_async_shared()
                if warp_idx == Role.DQ:
                    # The previous chunk's reduce has read its buffer (written next chunk).
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                stage_bar.arrive_and_wait()
                if warp_idx == Role.DQ:
                    cute.copy(tma_dq, tdQsdQ[None, stage], tdQgdQ[None, m_block, c])
                    cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.deterministic):
                if warp_idx == Role.DQ:
                    pass_dq_turn(mSem, m_block)
        if warp_idx == Role.DQ:
            cute.arch.cp_async_bulk_wait_group(0)
