"""sm80 backward kernel: FlashAttention-2 design on mma.sync, cp.async and ldmatrix."""

from __future__ import annotations

import math
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from cute_fa.dsl.copy import elem_ptr, transposed, widen_cols
from cute_fa.dsl.kernel import AttentionKernel
from cute_fa.dsl.mask import (
    apply_mask,
    causal_block_unmasked,
    coresident_rotates,
    coresident_turn,
    first_key_block,
    query_block_range,
    rotated_query_block,
    visited_query_block,
)
from cute_fa.dsl.scheduler import bwd_block_coords, bwd_grid
from cute_fa.dsl.seqlen import seqlen_info
from cute_fa.dsl.softmax import lse_for_recompute, mn_view, score_scales, softcap_scores

from .copy import gmem_tiled_copies, load_rows, smem_layout, store_acc, store_zeros, zero_tile_cols
from .mma import gemm
from .support import (
    bwd_can_implement,
    bwd_q_stages,
    dq_accum_offset,
    set_head_dim_columns,
)


def warp_rows(rows: int, cols: int, num_warps: int, preferred: int) -> int:
    """How many warps split the rows of a (rows, cols) product (the rest split its columns in
    16-wide slices): the split that reads the fewest operand bytes through ldmatrix.

    Each warp reads its rows of A and its columns of B over the whole K, so the reads are
    proportional to rows * (num_warps / m) + cols * m for m warps along the rows. Ties go to
    the split nearest ``preferred``.
    """
    splits = [m for m in (1, 2, 4, 8) if num_warps % m == 0 and rows % (16 * m) == 0
              and cols % (16 * (num_warps // m)) == 0]  # fmt: skip
    return min(splits, key=lambda m: (rows * num_warps // m + cols * m, abs(m - preferred)))


def tiled_mma(dtype, rows: int, cols: int, num_warps: int, preferred: int) -> cute.TiledMma:
    """m16n8k16 tiled MMA of a (rows, cols) product over ``num_warps`` warps (``warp_rows``)."""
    m = warp_rows(rows, cols, num_warps, preferred)
    atom = warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16))
    return cute.make_tiled_mma(
        atom, (m, num_warps // m, 1), permutation_mnk=(16 * m, 16 * num_warps // m, 16)
    )


def dq_tiled_mma(dtype, tile_m: int, head_dim: int, num_warps: int) -> cute.TiledMma:
    """The tiled MMA of dQ = dS K, whose C fragments fix the order of the dQ accumulator
    (Note [dQ accumulator in fragment order]); the postprocess reads it with the same one."""
    return tiled_mma(dtype, tile_m, head_dim, num_warps, 2)


class QueryRows(NamedTuple):
    """This (batch, head)'s per-query-row tensors, shifted to the sequence start for varlen: Q,
    dO (seqlen_q, d), LSE, delta (seqlen_q,), the dQ accumulator (its blocks' rows) and the dQ
    semaphores (deterministic only, else None)."""

    mQ: cute.Tensor
    mdO: cute.Tensor
    mLSE: cute.Tensor
    mdPsum: cute.Tensor
    mdQaccum: cute.Tensor
    semaphores: cute.Tensor | None


class BwdSmem(NamedTuple):
    """Shared memory: K and V (loaded once), the Q / dO / LSE / delta stages, P and dS."""

    sK: cute.Tensor
    sV: cute.Tensor
    sQ: cute.Tensor
    sdO: cute.Tensor
    sP: cute.Tensor
    sdS: cute.Tensor
    sLSE: cute.Tensor
    sdPsum: cute.Tensor


class Walk(NamedTuple):
    """The query blocks a CTA visits, [m_min, m_max), and the rotation of the coresident order
    (``query_block``)."""

    m_min: Int32
    m_max: Int32
    shift: Int32


class FlashAttentionBackwardSm80(AttentionKernel):
    """Exact attention backward (dQ, dK, dV), FA2 design, for every GPU from sm80 up.

    Grid and work split
      grid = (ceil(max_seqlen_k / tile_n), num_heads, batch) (deterministic causal: (num_heads,
      batch, ceil(max_seqlen_k / tile_n)), Note [deterministic dQ]): one CTA owns tile_n keys of one
      (query head, batch), keeps their dK and dV in registers and walks the query blocks that
      see them (causal/local skip the rest), tile_m rows at a time. P is recomputed from Q, K
      and the forward's LSE: neither S nor P ever goes to global memory. dQ of each query block
      is added to an fp32 buffer with atomics, each block's tile_m x d floats in the order of
      the dQ MMA's fragments (Note [dQ accumulator in fragment order] in ``support``: one L2
      line per warp instruction); the postprocess kernel reorders, scales and casts it.
      GQA: the CTA of query head h reads K/V head h // (h / h_kv) and writes dK/dV for head h;
      the caller sums each group.
    Warps (num_warps, all identical)
      Tiled MMAs over the same threads: S and dP (tile_m x tile_n), dK (tile_n x d) and dV
      (tile_n x dv), dQ (tile_m x d); ``warp_rows`` picks each one's warp grid for the fewest
      ldmatrix bytes (e.g. d128, 64 x 128 tiles, 8 warps: 2 x 4, 4 x 2, 2 x 4).
    Shared memory: sK (tile_n x d), sV (tile_n x dv), loaded once; q_stages (2 where shared
      memory holds them, else 1; ``support.bwd_q_stages``) of sQ (tile_m x d), sdO (tile_m x
      dv) and sLSE, sdPsum (tile_m fp32) for one query block each; sP, sdS (tile_m x tile_n,
      16-bit), the operands that other warps read transposed. At the end sK / sV stage dK / dV
      for 128-bit stores.
    Head dims (Note [rounded head dims] in cute_fa/config.py): d and dv are the tile head dims
      (tile_hdim, tile_hdimv); the tensors' own may be smaller multiples of 8 (or dv != d, the
      pairs of ``support``). Global views are widened to the tiles' columns, loads skip the
      pieces past the tensors' columns (zeroed once in every smem tile, so S and dP get exact
      zeros from them), dK / dV stores write only the tensors' columns and the dQ
      accumulator is tile_hdim wide (its padded columns get no atomics: they stay 0).
    Per query block m (cp.async groups, one per block):
      2 stages: wait for block m's group (the only one in flight); barrier (every warp is done
        with block m - 1, so its stage and sP, sdS are free); issue Q, dO, LSE, delta of block
        m + 1 into the other stage
      1 stage:  issue Q, dO, LSE, delta of block m; wait for it; barrier
      (rows past seqlen_q are zero-filled in sQ / sdO and never read from sLSE / sdPsum)
      LSE (log2 units) and delta of this thread's rows from sLSE / sdPsum
      S = Q K^T, dP = dO V^T                          (ldmatrix A and B)
      P = exp2(S * scale * log2 e - LSE * log2 e)     (mask first where the block needs it: a
        window (or causal with softcap) every block, causal the blocks that cut the diagonal,
        any the seqlen_k tail; softcap: S = tanh(.), kept)
      dS = P (dP - delta)  (softcap: times 1 - tanh^2)
      P, dS -> sP, sdS; barrier
      dV += P^T dO, dK += dS^T Q                      (ldmatrix.trans A and B)
      dQ = dS K; atomically added to dQaccum          (ldmatrix.trans B; fragment order)
      1 stage: barrier (the stage is free for block m + 1's load)
    Deterministic mode (config.deterministic), warp by warp (no CTA barrier): before its dQ
      atomics for query block m, lane 0 of each warp spins with ld.acquire.gpu until the
      semaphore of (batch, head, m) reaches num_warps times the number of key blocks before this
      one in m's turn order; warp barrier; the warp's atomics (fire-and-forget REDG); later,
      the release: warp barrier, lane 0 red.release.gpu adds 1 (it waits until the warp's
      atomics are done). Every element of dQaccum then sums its terms in one fixed order,
      whatever the schedule. Two orders (Note [deterministic dQ]): the chain (turns in key block
      order, every CTA walking downward; the release right after the atomics) and, where a
      (batch, head)'s key blocks all fit on the GPU at once (config.det_coresident), the
      coresident order (turns in the order the key blocks reach m: causal walks upward with
      turns descending, no mask walks downward from block n - 1, wrapping), in which each key
      block's predecessor reaches m a step earlier, so the release of block m waits until the
      next block's S and dP products are done (by then the atomics are).
    Epilogue: barrier (2 stages: the last block's dQ product has read sK); dK *= softmax_scale;
      dK, dV through sK, sV to global memory.
    Out-of-range rows: Q and dO rows past seqlen_q are zero and their LSE is +inf (P = 0, dS = 0);
      K and V rows past seqlen_k are zero and their scores masked; rows whose forward LSE is -inf
      (no key) get P = 0.
    """

    arch = 80

    can_implement = staticmethod(bwd_can_implement)

    def __init__(self, config):
        super().__init__(config)
        set_head_dim_columns(self, config)  # head_dim(_v), tile_hdim(v), cols_qk / cols_vo
        self.q_stages = bwd_q_stages(config)
        self.deterministic = config.deterministic
        self.coresident = config.det_coresident

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
        stages = self.q_stages
        sQ_layout = smem_layout(self.dtype, tm, d, stages)
        sdO_layout = smem_layout(self.dtype, tm, dv, stages)
        sK_layout = smem_layout(self.dtype, tn, d)
        sV_layout = smem_layout(self.dtype, tn, dv)
        sP_layout = smem_layout(self.dtype, tm, tn)
        sLSE_layout = cute.make_layout((tm, stages))

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)],
                                   1024]  # fmt: skip
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm * stages], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, tm * stages], 128]

        copy_g2s, copy_r2g = gmem_tiled_copies(self.dtype, self.num_threads, d)
        w = self.num_warps
        mma_sdp = tiled_mma(self.dtype, tm, tn, w, 2)
        mma_dk = tiled_mma(self.dtype, tn, d, w, 4)
        mma_dv = tiled_mma(self.dtype, tn, dv, w, 4)
        mma_dq = dq_tiled_mma(self.dtype, tm, d, w)
        # Global views as wide as the tiles (Note [rounded head dims]); dQaccum already is.
        mQ, mK, mdK = widen_cols(mQ, d), widen_cols(mK, d), widen_cols(mdK, d)
        mV, mdO, mdV = widen_cols(mV, dv), widen_cols(mdO, dv), widen_cols(mdV, dv)

        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)

        batch = mQ.shape[0]
        if cutlass.const_expr(mCuSeqlensQ is not None):
            batch = mCuSeqlensQ.shape[0] - 1
        grid = bwd_grid(cute.ceil_div(max_seqlen_k, tn), cute.size(mQ.shape[2]), batch,
                        self.deterministic, self.causal, self.coresident)  # fmt: skip
        self.kernel(
            mQ, mK, mV, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV,
            softmax_scale, score_scale, scale_log2, window_left, window_right,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mdQsemaphore,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sP_layout, sLSE_layout, copy_g2s,
            copy_r2g, mma_sdp, mma_dk, mma_dv, mma_dq, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)  # fmt: skip

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
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
        score_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mdQsemaphore: cute.Tensor | None,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sLSE_layout: cute.Layout,
        copy_g2s: cute.TiledCopy,
        copy_r2g: cute.TiledCopy,
        mma_sdp: cute.TiledMma,
        mma_dk: cute.TiledMma,
        mma_dv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head, batch = bwd_block_coords(self.deterministic, self.causal, self.coresident)
        tm, tn, d, dv = self.tile_m, self.tile_n, self.tile_hdim, self.tile_hdimv
        offset_q, seqlen_q, offset_k, seqlen_k = seqlen_info(
            batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK
        )
        if n_block * tn < seqlen_k:
            head_kv = head // (mQ.shape[2] // mK.shape[2])
            qb = 0 if cutlass.const_expr(mCuSeqlensQ is not None) else batch
            kb = 0 if cutlass.const_expr(mCuSeqlensK is not None) else batch
            # dQaccum blocks of sequence b start tile_m * b rows further down (varlen).
            offset_acc = dq_accum_offset(offset_q, batch, tm, mCuSeqlensQ is not None)
            q_rows = QueryRows(
                cute.domain_offset((offset_q, 0), mQ[qb, None, head, None]),
                cute.domain_offset((offset_q, 0), mdO[qb, None, head, None]),
                cute.domain_offset((offset_q,), mLSE[qb, head, None]),
                cute.domain_offset((offset_q,), mdPsum[qb, head, None]),
                cute.domain_offset((offset_acc, 0), mdQaccum[qb, head, None, None]),
                mdQsemaphore[batch, head, None] if cutlass.const_expr(self.deterministic) else None,
            )
            mK_cur = cute.domain_offset((offset_k, 0), mK[kb, None, head_kv, None])
            mV_cur = cute.domain_offset((offset_k, 0), mV[kb, None, head_kv, None])
            gdK = cute.local_tile(
                cute.domain_offset((offset_k, 0), mdK[kb, None, head, None]), (tn, d), (n_block, 0)
            )
            gdV = cute.local_tile(
                cute.domain_offset((offset_k, 0), mdV[kb, None, head, None]), (tn, dv), (n_block, 0)
            )
            keys_left = seqlen_k - n_block * tn

            # Query blocks that see any key of this block (Note [bottom-right aligned masks]).
            m_block_min, m_block_max = query_block_range(
                n_block, seqlen_q, seqlen_k, window_left, window_right, tm, tn, self.causal,
                self.local,
            )  # fmt: skip
            if m_block_max <= m_block_min:
                store_zeros(gdK, keys_left, copy_r2g, tidx, self.cols_qk)
                store_zeros(gdV, keys_left, copy_r2g, tidx, self.cols_vo)
            else:
                smem = cutlass.memory.SmemAllocator()
                storage = smem.allocate(SharedStorage)
                smem_tiles = BwdSmem(
                    storage.sK.get_tensor(sK_layout),
                    storage.sV.get_tensor(sV_layout),
                    storage.sQ.get_tensor(sQ_layout),
                    storage.sdO.get_tensor(sdO_layout),
                    storage.sP.get_tensor(sP_layout),
                    storage.sdS.get_tensor(sP_layout),
                    storage.sLSE.get_tensor(sLSE_layout),
                    storage.sdPsum.get_tensor(sLSE_layout),
                )
                self.attend_bwd(
                    q_rows, mK_cur, mV_cur, gdK, gdV, smem_tiles, n_block, keys_left,
                    seqlen_q, seqlen_k, m_block_min, m_block_max, softmax_scale, score_scale,
                    scale_log2, window_left, window_right, copy_g2s, copy_r2g,
                    mma_sdp, mma_dk, mma_dv, mma_dq, tidx,
                )  # fmt: skip

    @cute.jit
    def attend_bwd(
        self,
        q_rows: QueryRows,
        mK: cute.Tensor,
        mV: cute.Tensor,
        gdK: cute.Tensor,
        gdV: cute.Tensor,
        smem_tiles: BwdSmem,
        n_block: Int32,
        keys_left: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        m_block_min: Int32,
        m_block_max: Int32,
        softmax_scale: Float32,
        score_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        copy_g2s: cute.TiledCopy,
        copy_r2g: cute.TiledCopy,
        mma_sdp: cute.TiledMma,
        mma_dk: cute.TiledMma,
        mma_dv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        tidx: Int32,
    ):
        """Load K, V once; loop over the query blocks; write dK, dV."""
        tn, d, dv = self.tile_n, self.tile_hdim, self.tile_hdimv
        sK, sV = smem_tiles.sK, smem_tiles.sV
        barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_threads)
        # The padded columns of a rounded head dim: zero once, no load writes them (Note
        # [rounded head dims]); the first block's barrier orders these stores before any read.
        if cutlass.const_expr(self.cols_qk is not None):
            zero_tile_cols(copy_g2s, sK, self.cols_qk, tidx)
            for stage in cutlass.range_constexpr(self.q_stages):
                zero_tile_cols(copy_g2s, smem_tiles.sQ[None, None, stage], self.cols_qk, tidx)
        if cutlass.const_expr(self.cols_vo is not None):
            zero_tile_cols(copy_g2s, sV, self.cols_vo, tidx)
            for stage in cutlass.range_constexpr(self.q_stages):
                zero_tile_cols(copy_g2s, smem_tiles.sdO[None, None, stage], self.cols_vo, tidx)
        thr_g2s = copy_g2s.get_slice(tidx)
        tKcK = thr_g2s.partition_S(cute.make_identity_tensor((tn, d)))
        tVcV = thr_g2s.partition_S(cute.make_identity_tensor((tn, dv)))
        load_rows(copy_g2s, thr_g2s.partition_S(cute.local_tile(mK, (tn, d), (n_block, 0))),
                  thr_g2s.partition_D(sK), tKcK, keys_left, True, self.cols_qk)  # fmt: skip
        load_rows(copy_g2s, thr_g2s.partition_S(cute.local_tile(mV, (tn, dv), (n_block, 0))),
                  thr_g2s.partition_D(sV), tVcV, keys_left, True, self.cols_vo)  # fmt: skip
        cute.arch.cp_async_commit_group()

        acc_dK = cute.make_rmem_tensor(mma_dk.get_slice(tidx).partition_shape_C((tn, d)), Float32)
        acc_dV = cute.make_rmem_tensor(mma_dv.get_slice(tidx).partition_shape_C((tn, dv)),
                                       Float32)  # fmt: skip
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # The order of the query blocks (``query_block``).
        # Coresident order: each key block's predecessor reaches a query block at least one
        # step earlier, so a block's turn is passed on late, during the next block
        # (``late``; Note [deterministic dQ]).
        shift = Int32(0)
        late = cutlass.Boolean(False)
        if cutlass.const_expr(self.coresident):
            late = cutlass.Boolean(True)
            if cutlass.const_expr(not self.causal):
                late = coresident_rotates(seqlen_q, seqlen_k, self.tile_m, tn)
                if late:
                    shift = n_block
        walk = Walk(m_block_min, m_block_max, shift)
        num_blocks = m_block_max - m_block_min
        if cutlass.const_expr(self.q_stages == 2):
            self.load_q_do(q_rows, smem_tiles, self.query_block(0, walk), 0, seqlen_q, copy_g2s,
                           tidx)  # fmt: skip
            cute.arch.cp_async_commit_group()
        for i in cutlass.range(num_blocks, unroll=1):
            m_block = self.query_block(i, walk)
            args = (
                q_rows, smem_tiles, m_block, self.query_block(i + 1, walk),
                i + 1 < num_blocks, self.query_block(i - 1, walk), i > 0, late,
                i % self.q_stages, n_block,
                seqlen_q, seqlen_k,
                score_scale, scale_log2, window_left, window_right, copy_g2s,
                mma_sdp, mma_dk, mma_dv, mma_dq, acc_dK, acc_dV, barrier, tidx,
            )  # fmt: skip
            if cutlass.const_expr(self.local or (self.causal and self.has_softcap)):
                # (Causal softcap: with a second body d128 spills 17 LDL / STL instead of 0.)
                self.step_bwd(*args, True)
            elif cutlass.const_expr(self.causal):
                # Only the query blocks that cut the diagonal (or the seqlen_k tail) mask: +3-5 %
                # at d128 on the H200 (the sm90 kernel measured a loss with two bodies).
                if causal_block_unmasked(m_block * self.tile_m, n_block, tn, seqlen_q, seqlen_k):
                    self.step_bwd(*args, False)
                else:
                    self.step_bwd(*args, True)
            else:
                # Without a window only a key block holding the seqlen_k tail needs a mask.
                if keys_left < tn:
                    self.step_bwd(*args, True)
                else:
                    self.step_bwd(*args, False)

        if cutlass.const_expr(self.deterministic):
            if late:  # the last block's turn
                self.release_dq_turn(q_rows.semaphores, self.query_block(num_blocks - 1, walk),
                                     tidx)  # fmt: skip
        # dK carries the softmax scale (dS is w.r.t. the scaled scores); sK and sV are free
        # once every warp has finished the last block.
        if cutlass.const_expr(self.q_stages == 2):
            barrier.arrive_and_wait()
        acc_dK.store(acc_dK.load() * softmax_scale)
        store_acc(acc_dK, mma_dk, sK, gdK, keys_left, copy_r2g, barrier, tidx, self.cols_qk)
        store_acc(acc_dV, mma_dv, sV, gdV, keys_left, copy_r2g, barrier, tidx, self.cols_vo)

    @cute.jit
    def query_block(self, i: Int32, walk: Walk) -> Int32:
        """The i-th query block this CTA visits; ``walk`` = (m_block_min, m_block_max, shift).
        Ascending; deterministic: downward (the chain, Note [deterministic dQ]), or coresident:
        upward (causal) / downward from ``shift`` blocks past the last, wrapping (no mask)."""
        m_block_min, m_block_max, shift = walk.m_min, walk.m_max, walk.shift
        if cutlass.const_expr(self.coresident and not self.causal):
            return rotated_query_block(i, m_block_min, m_block_max, shift)
        downward = self.deterministic and not self.coresident
        return visited_query_block(i, m_block_min, m_block_max, downward)

    @cute.jit
    def step_bwd(
        self,
        q_rows: QueryRows,
        smem_tiles: BwdSmem,
        m_block: Int32,
        m_next: Int32,
        has_next: cutlass.Boolean,
        m_prev: Int32,
        has_prev: cutlass.Boolean,
        late: cutlass.Boolean,
        stage: Int32,
        n_block: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        score_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        copy_g2s: cute.TiledCopy,
        mma_sdp: cute.TiledMma,
        mma_dk: cute.TiledMma,
        mma_dv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        barrier: pipeline.NamedBarrier,
        tidx: Int32,
        masked: cutlass.Constexpr[bool],
    ):
        """One query block against this CTA's keys (with 2 stages, the next one, m_next, is
        prefetched when ``has_next``). Deterministic and ``late``: the turn of the block before,
        m_prev (when ``has_prev``), is passed on after this block's S and dP products."""
        tm, tn, d = self.tile_m, self.tile_n, self.tile_hdim
        mdQaccum = q_rows.mdQaccum
        sK, sV = smem_tiles.sK, smem_tiles.sV
        sQ, sdO = smem_tiles.sQ[None, None, stage], smem_tiles.sdO[None, None, stage]
        sP, sdS = smem_tiles.sP, smem_tiles.sdS
        sLSE, sdPsum = smem_tiles.sLSE[None, stage], smem_tiles.sdPsum[None, stage]
        rows_left = seqlen_q - m_block * tm
        if cutlass.const_expr(self.deterministic):
            sem = elem_ptr(q_rows.semaphores, m_block).llvm_ptr
            # The semaphore counts warps: the turn comes when every warp of every key block
            # before this one that visits m_block has added its share.
            if cutlass.const_expr(self.coresident):
                # (Without a mask, ``late`` is whether this sequence's walk rotates.)
                turn = coresident_turn(m_block, n_block, seqlen_q, seqlen_k, tm, tn, self.causal,
                                       late)  # fmt: skip
            else:
                turn = n_block - first_key_block(
                    m_block, seqlen_q, seqlen_k, window_left, tm, tn, self.local
                )
            turn = turn * (self.num_threads // 32)
            lane = tidx % 32

        if cutlass.const_expr(self.q_stages == 2):
            # This block's group is the only one in flight. Past the barrier every warp has
            # finished the previous block, so its stage may take the next block's load.
            cute.arch.cp_async_wait_group(0)
            barrier.arrive_and_wait()
            if has_next:
                self.load_q_do(q_rows, smem_tiles, m_next, 1 - stage, seqlen_q, copy_g2s, tidx)
                cute.arch.cp_async_commit_group()
        else:
            self.load_q_do(q_rows, smem_tiles, m_block, 0, seqlen_q, copy_g2s, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            barrier.arrive_and_wait()

        # LSE (in log2 units) and delta of this thread's rows of S.
        thr_sdp = mma_sdp.get_slice(tidx)
        tScS = mn_view(thr_sdp.partition_C(cute.make_identity_tensor((tm, tn))))
        num_rows = cute.size(tScS.shape[0])
        lse_log2 = cute.make_rmem_tensor(num_rows, Float32)
        dpsum = cute.make_rmem_tensor(num_rows, Float32)
        for r in cutlass.range_constexpr(num_rows):
            row = tScS[r, 0][0]
            lse_log2[r] = Float32.inf  # rows past seqlen_q: P = 0
            dpsum[r] = 0.0
            if row < rows_left:
                lse_log2[r] = lse_for_recompute(sLSE[row])
                dpsum[r] = sdPsum[row]

        # S = Q K^T and dP = dO V^T.
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), self.dtype)
        acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
        acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
        acc_S.fill(0.0)
        acc_dP.fill(0.0)
        self.mma_ss(mma_sdp, acc_S, sQ, sK, ldsm, ldsm, tidx)
        self.mma_ss(mma_sdp, acc_dP, sdO, sV, ldsm, ldsm, tidx)
        if cutlass.const_expr(self.deterministic):
            if late:
                if has_prev:  # the atomics of m_prev went out a whole product ago
                    self.release_dq_turn(q_rows.semaphores, m_prev, tidx)

        dtanh = None
        if cutlass.const_expr(self.has_softcap):
            dtanh = softcap_scores(acc_S, score_scale, derivative=True)
        S = mn_view(acc_S)
        if cutlass.const_expr(masked):
            apply_mask(S, tScS, m_block * tm, n_block * tn, seqlen_q, seqlen_k,
                       window_left, window_right, self.causal, self.local)  # fmt: skip
        dP = mn_view(acc_dP)
        for r in cutlass.range_constexpr(num_rows):
            p = cute.math.exp2(S[r, None].load() * scale_log2 - lse_log2[r], fastmath=True)
            S[r, None].store(p)
            dP[r, None].store(p * (dP[r, None].load() - dpsum[r]))
        if cutlass.const_expr(self.has_softcap):
            acc_dP.store(acc_dP.load() * dtanh.load())

        # P and dS to shared memory (16-bit) for the transposed reads of the other products.
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype),
                                     mma_sdp)  # fmt: skip
        thr_r2s = r2s.get_slice(tidx)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        rdS = cute.make_fragment_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        cute.copy(r2s, thr_r2s.retile(rP), thr_r2s.partition_D(sP))
        cute.copy(r2s, thr_r2s.retile(rdS), thr_r2s.partition_D(sdS))
        barrier.arrive_and_wait()

        # dV += P^T dO, dK += dS^T Q, dQ = dS K.
        self.mma_ss(mma_dv, acc_dV, transposed(sP), transposed(sdO),
                    ldsm_t, ldsm_t, tidx)  # fmt: skip
        self.mma_ss(mma_dk, acc_dK, transposed(sdS), transposed(sQ),
                    ldsm_t, ldsm_t, tidx)  # fmt: skip
        thr_dq = mma_dq.get_slice(tidx)
        acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, d)), Float32)
        acc_dQ.fill(0.0)
        self.mma_ss(mma_dq, acc_dQ, sdS, transposed(sK), ldsm, ldsm_t, tidx)
        # The block's tm x d floats in fragment order: value i of thread t at i * threads + t,
        # so each atomic instruction of a warp covers 32 consecutive floats.
        gdQ = cute.local_tile(mdQaccum, (tm, d), (m_block, 0))
        block = cute.make_tensor(gdQ.iterator, cute.make_layout(tm * d))
        if cutlass.const_expr(self.deterministic):
            # Wait for this warp's turn: the key blocks before this one in m_block's order have
            # added their dQ (Note [deterministic dQ]). Lane 0 spins with acquire loads (a
            # relaxed read and a fence.acq_rel instead measured 0.74-0.78x of the default
            # speed: the fence invalidates L1 and waits for every memory access in flight).
            # At least, not equal: warps of this CTA that went first have raised it already.
            if lane == 0:
                count = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
                while count < turn:
                    count = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
            cute.arch.sync_warp()
        # Rows past seqlen_q (dS = 0) are skipped. Adding their zeros would be as right (the
        # padding of the note), but without the predicate the compiler schedules the atomics
        # into the dQ product and the d64 128 x 128 tile spills (0 -> 9 LDL/STL, 20 % slower
        # causal on the H200). So are the padded columns of a rounded head dim (K's are 0).
        # (Two unrolled loops: one of 64 would make the DSL warn about compile time.)
        tdQcdQ = thr_dq.partition_C(cute.make_identity_tensor((tm, d)))
        values = cute.size(acc_dQ)
        chunk = math.gcd(values, 32)
        for j in cutlass.range_constexpr(values // chunk):
            for k in cutlass.range_constexpr(chunk):
                i = j * chunk + k
                if self.dq_value_kept(tdQcdQ[i], rows_left):
                    cute.arch.atomic_add(
                        elem_ptr(block, i * self.num_threads + tidx).llvm_ptr, acc_dQ[i]
                    )
        if cutlass.const_expr(self.deterministic):
            if not late:
                self.release_dq_turn(q_rows.semaphores, m_block, tidx)
        if cutlass.const_expr(self.q_stages == 1):
            barrier.arrive_and_wait()  # the next block's load reuses this one's stage

    @cute.jit
    def dq_value_kept(self, coord, rows_left: Int32) -> cutlass.Boolean:
        """Whether a dQ value at ``coord`` (row, column) of the block goes to dQaccum: its row
        below ``rows_left`` and, for a rounded head dim, its column below head_dim."""
        if cutlass.const_expr(self.cols_qk is None):
            return coord[0] < rows_left
        return (coord[0] < rows_left) & (coord[1] < self.cols_qk)

    @cute.jit
    def release_dq_turn(self, semaphores: cute.Tensor, m_block: Int32, tidx: Int32):
        """Pass on this warp's turn of query block ``m_block``: the lanes' atomics precede the
        warp barrier, which precedes lane 0's increment with release semantics (it waits until
        the atomics are done; a fence.acq_rel before a relaxed increment, as before, also
        invalidated L1 and made ptxas return every atomic, ATOMG for REDG)."""
        cute.arch.sync_warp()
        if tidx % 32 == 0:
            sem = elem_ptr(semaphores, m_block).llvm_ptr
            cute.arch.red(sem, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")

    @cute.jit
    def load_q_do(
        self,
        q_rows: QueryRows,
        smem_tiles: BwdSmem,
        m_block: Int32,
        stage: Int32,
        seqlen_q: Int32,
        copy_g2s: cute.TiledCopy,
        tidx: Int32,
    ):
        """Issue cp.async of Q, dO (rows past seqlen_q zero-filled, so they contribute nothing),
        LSE and delta (rows past seqlen_q not loaded) of query block ``m_block`` into ``stage``.
        The caller commits the group."""
        tm = self.tile_m
        mQ, mdO, mLSE, mdPsum = q_rows.mQ, q_rows.mdO, q_rows.mLSE, q_rows.mdPsum
        rows_left = seqlen_q - m_block * tm
        thr_g2s = copy_g2s.get_slice(tidx)
        for src, dst, cols, width in (
            (mQ, smem_tiles.sQ, self.cols_qk, self.tile_hdim),
            (mdO, smem_tiles.sdO, self.cols_vo, self.tile_hdimv),
        ):
            gX = cute.local_tile(src, (tm, width), (m_block, 0))
            sX = dst[None, None, stage]
            tXcX = thr_g2s.partition_S(cute.make_identity_tensor((tm, width)))
            load_rows(copy_g2s, thr_g2s.partition_S(gX), thr_g2s.partition_D(sX), tXcX, rows_left,
                      True, cols)  # fmt: skip
        if tidx < cutlass.min(tm, rows_left):
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
            one = cute.make_layout(1)
            for src, dst in ((mLSE, smem_tiles.sLSE), (mdPsum, smem_tiles.sdPsum)):
                cute.copy(
                    atom,
                    cute.make_tensor(elem_ptr(src, m_block * tm + tidx), one),
                    cute.make_tensor(dst.iterator + cute.crd2idx((tidx, stage), dst.layout), one),
                )

    @cute.jit
    def mma_ss(
        self,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        sA: cute.Tensor,
        sB: cute.Tensor,
        atom_A: cute.CopyAtom,
        atom_B: cute.CopyAtom,
        tidx: Int32,
    ):
        """acc += A @ B with both operands read from shared memory by ldmatrix (.trans atoms
        for transposed views)."""
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB))
        s2r_A = cute.make_tiled_copy_A(atom_A, tiled_mma)
        s2r_B = cute.make_tiled_copy_B(atom_B, tiled_mma)
        thr_A = s2r_A.get_slice(tidx)
        thr_B = s2r_B.get_slice(tidx)
        gemm(tiled_mma, acc, tCrA, tCrB, thr_A.partition_S(sA), thr_A.retile(tCrA),
             thr_B.partition_S(sB), thr_B.retile(tCrB), s2r_A, s2r_B)  # fmt: skip


# Note [deterministic dQ]
# ~~~~~~~~~~~~~~~~~~~~~~~
# fp32 atomics are exact in any order only for exact sums, so dQ = sum over key blocks of dS K
# depends on the order in which the CTAs of one (batch, head) add their terms. In deterministic
# mode every query block m has a fixed order of the key blocks that visit it (its turns) and a
# semaphore: the CTA of key block n adds its term for m only when the semaphore counts the key
# blocks before n in that order, and then raises it by one. (The sm80 kernel counts warps: each
# warp adds its own elements of the block, raises the count by one, and waits for num_warps
# times the key blocks before it; the elements of a block belong to one thread each, so a warp
# needs no other warp of its CTA.) Which CTAs visit m: key block n walks query blocks
# [m_min(n), m_max(n)), and both bounds are non-decreasing in n, so the key blocks that visit m
# are one contiguous run starting at first_key_block(m) (0 without a window; with window_left,
# the block holding the first key that the first row of m sees).
#
# The chain (the sm90 kernel; the sm80 kernel with a window or too many key blocks): turns in
# ascending key block order, every CTA walking downward from m_max(n) - 1. It cannot deadlock:
# a CTA waits only for CTAs of lower key block index in the same (batch, head), and the
# hardware starts thread blocks in index order (x fastest), so those are running or done.
# With an ascending walk, causal key block n would first visit query block m_min(n) ~ n *
# tile_n / tile_m and wait there until key block 0 has walked up to it: half the CTAs' time
# idle (0.47x of the default speed at d128 8k). Walking downward, key blocks n' < n have
# m_max(n') <= m_max(n), so they visit each block no later in their walk than n does; but all
# of them reach a block at the same step, so n waits for the critical sections (atomics and
# release) of all the key blocks before it: a lag that grows by one critical section a key
# block.
# Grid order for the chain: a deterministic causal call makes the key block the grid's slowest
# dimension, grid = (heads, batch, key blocks), so the CTAs resident together are the first few
# key blocks of many (head, batch) pairs rather than all key blocks of one or two heads; key
# block n - 1 of a pair still has the lower linear index (no deadlock). Measured on the H200 at
# 8k (det / default): sm90 d64 causal 0.71x -> 0.84x, d128 causal 0.84x -> 0.86x, sm80 d128
# causal 0.77x -> 0.80x; but non-causal lost (sm90 d128 0.93x -> 0.87x, d64 0.87x -> 0.83x;
# sm80 0.75x either way), so non-causal calls keep the key block fastest.
#
# The coresident order (sm80 kernel, ``det_coresident``: no window, and at most half as many
# key blocks as the GPU has SMs, ``coresident_fits`` in cute_fa/backward.py): turns in the order
# in which the key blocks reach m, so that each key block's predecessor got there one or more
# steps earlier and, the CTAs running at the same pace, nobody waits (``coresident_turn`` and
# ``rotated_query_block`` in cute_fa/dsl/mask.py):
# - causal: every key block walks upward from m_min(n); m_min(n + 1) > m_min(n) (tile_n >=
#   tile_m), so n + 1 reaches m earlier than n: turns descending, from the last key block that
#   visits m;
# - no mask: key block n walks downward starting at block n - 1, wrapping (block m at step
#   (M - 1 + n - m) mod M, M query blocks): n - 1 reaches every block one step before n, and
#   the turns of m start at key block m + 1 (mod M) and go up, wrapping. Where a sequence has
#   more key blocks than query blocks, two key blocks would reach m at the same step; there
#   the kernel takes the chain (shift 0, ascending turns) for that sequence.
# A CTA now waits for CTAs of higher index too, so every key block of its (batch, head) must
# be resident: with thread blocks started in index order and key blocks fastest in the grid,
# at most as many key blocks as CTAs fit at once is enough (the lowest-index CTA not started
# yet waits only for CTAs of a head whose other CTAs cannot hold every slot); half the SMs
# leaves room for other kernels on the GPU. In both orders the waits point to strictly earlier
# steps or, among equal steps, one way along the key blocks, so they form no cycle. Where the
# GPU is shared in ways the SM count does not show (MPS thread limits, green contexts),
# ``CUTE_FA_BWD_DET_ORDER=chain`` keeps every call on the chain.
# With a step of slack, the coresident order releases late: block m's increment goes out after
# the next block's S and dP products, when its atomics are done, so the release's wait for them
# (red.release) costs nothing; the chain releases right after the atomics (a late release
# there makes the lag grow by a block's products a key block: measured slower).
# What it costs (H200, the sm80 kernel, d128 8k, det / default): with thread 0 taking the turn
# for the CTA between two CTA barriers, a relaxed spin and fence.acq_rel on both sides: 0.75x /
# 0.80x (non-causal / causal), the same in the chain and the coresident order and with turns per
# warp: the fences were the cost, not the waiting (the same kernel without any fence or
# semaphore, not deterministic: 0.97x / 1.00x). A fence.acq_rel is MEMBAR.ALL.GPU plus an
# invalidation of L1 (CCTL.IVALL), and with one after them ptxas returns the dQ atomics (ATOMG,
# waited for, instead of REDG). Acquire loads and red.release: 0.84-0.86x / 0.87-0.88x in the
# coresident order, 0.79x / 0.88x in the chain (docs/performance.md, 2026-12-01).
# The sm90 backward (hopper/flash_bwd.py) keeps the chain, its turns taken by its dQ writer
# warp around the TMA reduce-adds of a block.
