"""sm80 forward kernel: FlashAttention-2 design on mma.sync, cp.async and ldmatrix."""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from cute_fa.dsl.copy import acc_to_smem, col_predicate, copy_cols, store_rows, widen_cols
from cute_fa.dsl.kernel import AttentionKernel
from cute_fa.dsl.mask import Window, apply_mask, block_range, split_block_range
from cute_fa.dsl.pack_gqa import packed_row_views
from cute_fa.dsl.seqlen import seqlen_info
from cute_fa.dsl.softmax import OnlineSoftmax, mn_view, score_scales, softcap_scores

from .copy import gmem_tiled_copies, smem_layout, store_zeros, zero_tile_cols
from .mma import acc_as_A_operand, gemm
from .support import fwd_can_implement, set_head_dim_columns


class MmaFragments(NamedTuple):
    """The CTA's MMA, this thread's slice, its operand fragments, O and the identity of S."""

    tiled_mma: cute.TiledMma
    thr_mma: cute.ThrMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrVt: cute.Tensor
    acc_O: cute.Tensor
    tScS: cute.Tensor


class SmemToReg(NamedTuple):
    """ldmatrix copies of Q, K and V^T and their smem sources and register views."""

    s2r_Q: cute.TiledCopy
    s2r_K: cute.TiledCopy
    s2r_V: cute.TiledCopy
    tSsQ: cute.Tensor
    tSrQ_view: cute.Tensor
    tSsK: cute.Tensor
    tSrK_view: cute.Tensor
    tOsVt: cute.Tensor
    tOrVt_view: cute.Tensor


class KVLoads(NamedTuple):
    """cp.async of the K and V tiles: the copy, each tile's global and smem partitions, and
    their identities (rows: the seqlen_k tail; columns: a rounded head dim's tail)."""

    copy_g2s: cute.TiledCopy
    tKgK: cute.Tensor
    tKsK: cute.Tensor
    tVgV: cute.Tensor
    tVsV: cute.Tensor
    tKcK: cute.Tensor
    tVcV: cute.Tensor
    thr_g2s: cute.ThrCopy  # paged K/V: partitions each gathered row
    pages: cute.Tensor | None  # paged K/V: the sequence's row of the page table


class BlockRows(NamedTuple):
    """What the mask of this query block needs: its index, its sequence's lengths, the window."""

    m_block: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    window: Window


class FlashAttentionForwardSm80(AttentionKernel):
    """Exact attention forward, FA2 design, for every GPU from sm80 up.

    Grid and work split
      grid = (ceil(max_seqlen_q / tile_m), num_heads, batch); one CTA owns one tile_m block of
      queries of one (head, batch) and visits its key blocks from the last to the first (so the
      one that needs the seqlen/causal mask comes first). Causal grids run query blocks in reverse
      (the longest rows first). Consecutive CTAs share a (head, batch), so K/V tiles hit in L2.
    Warps (num_warps, all identical: no warp specialization on sm80)
      Sliced-Q: warp w owns query rows [16 w, 16 w + 16) of the tile (per MMA M repetition); K and
      V tiles are shared by all warps; a row's max and sum stay inside one quad of one warp, so no
      inter-warp reduction exists anywhere.
    Shared memory: sQ (tile_m x d), sK (tile_n x d) and sV (tile_n x dv), swizzled (no ldmatrix
      bank conflicts); sO (tile_m x dv, dv <= d) reuses sQ for the epilogue.
    Head dims (Note [rounded head dims] in cute_fa/config.py): d and dv above are the tile head
      dims (tile_hdim, tile_hdimv: 64, 96, 128, 192 or 256); the tensors' own (head_dim,
      head_dim_v) may be smaller multiples of 8. Global views are widened to the tile's columns
      (``widen_cols``), loads skip the 16-byte pieces past the tensor's columns, whose smem
      columns each CTA zeroes once before its first load, and O's stores write only its own.
    Pipeline (cp.async groups; every wait is followed by a CTA barrier):
      prologue: Q and K[n_max - 1] -> commit
      per key block n (from n_max - 1 down to n_min):
        wait(K[n]); barrier; issue V[n]; commit       V[n] lands while S = Q K[n]^T multiplies
        S = Q K^T (ldmatrix k-slice k+1 overlaps mma of slice k)
        wait(V[n]); barrier; issue K[n-1]; commit     K[n-1] lands during softmax and P V
        mask (only blocks cutting the seqlen tail, causal diagonal or window edge)
        online softmax (base 2, scale folded in; cute_fa/dsl/softmax.py), rescale acc_O
        O += P V with P converted to 16-bit in registers as the A operand (never through smem)
      epilogue: O / l once, O -> sO -> 128-bit stores; LSE from the quad leaders.
    Out-of-range rows: Q rows past seqlen_q are computed but never stored; K rows past seqlen_k
      are masked to -inf; V rows past seqlen_k are zero-filled (0 * garbage could be NaN).
    Split-KV (config.split_kv; cute_fa/ops.py Note [split-KV launches]): mO is fp32
      (num_splits * batch, seqlen, heads, d) and mLSE (num_splits * batch, heads, seqlen), split
      slowest (packed q: batch 1), so num_splits = mO.shape[0] // mQ.shape[0]; the grid's z is
      batch * num_splits (z = batch index * num_splits + split). A CTA visits its split's piece
      of the query block's key blocks (``split_block_range``, shared with the sm90 forward): the
      walk above runs unchanged on the piece (its first block is always masked, the mask
      boundaries are those of the whole range). O, divided by the split's own row sums, goes
      from the accumulator straight to global memory (fp32, no staging in sQ), LSE as usual; a
      split without key blocks writes O = 0 and LSE = -inf. The combine
      (ampere/flash_combine.py) merges the splits.
    Paged K/V (config.page_size > 0; any page size from 1): mK / mV are (num_pages,
      page_size, h_kv, d) and sequence b's key j is row j % page_size of page
      mPageTable[b, j // page_size]; without mSeqUsedK every page of the row is full. The
      cp.async of a K / V tile is the dense tile's, row by row: each of a thread's rows reads
      its page index from the table (one 4-byte load a row) and copies its 16-byte chunks of
      that global row (a (tile_n, d) view of the one row, row stride 0, partitioned like the
      dense tile), so pages of any size, in any order, land in the same swizzled sK / sV. Rows
      past seqlen_k (only in the first visited block) are skipped as before: the table entries
      past a sequence's pages are never read.
    Packed GQA (config.pack_gqa = G, the query heads a K/V head; Note [packed GQA] in
      cute_fa/dsl/pack_gqa.py): the kernel views Q, O and LSE with (G, seqlen) rows and the K/V
      heads (``packed_row_views``); the grid is (ceil(max_seqlen_q * G / tile_m), h_kv, batch)
      and packed row r of a CTA is position r // G of query head head_kv * G + r % G. The
      loads and stores above run unchanged on these views: each 16-byte piece's address comes
      from its row's (head, position) coordinate, so Q rows are gathered, and O, the LSE and
      split-KV's fp32 partials scattered, by the same row-predicated cp.async and 16-byte stores
      (rows_left counts packed rows, seqlen_q * G). Masks and the key block range take the
      query position (row // G). G divides tile_m or is a multiple of it (support.py), so the
      thread and MMA row partitions of a tile split (G, tile_m / G) evenly.
    """

    arch = 80

    can_implement = staticmethod(fwd_can_implement)

    def __init__(self, config) -> None:
        super().__init__(config)
        set_head_dim_columns(self, config)  # head_dim(_v), tile_hdim(v), cols_qk / cols_vo
        self.split_kv = config.split_kv  # fp32 O and LSE of one key split (class docstring)
        self.page_size = config.page_size  # paged K/V: keys a page (class docstring)
        # Packed GQA: query heads whose rows share a tile (1: one head a tile; class docstring)
        self.packed_heads = config.pack_gqa or 1
        # Masks take a thread's query positions from its first row's (Note [packed mask rows]
        # in cute_fa/dsl/mask.py): exact for power-of-two tiles and warp counts, or G a
        # multiple of tile_m.
        g, tm, nw = self.packed_heads, self.tile_m, self.num_warps
        self.positions_from_first = g > 1 and (
            (tm & (tm - 1) == 0 and nw & (nw - 1) == 0) or g % tm == 0
        )

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        max_seqlen_q: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        # Shared memory: 8-row swizzled atoms, 64 (or 32) columns wide, so ldmatrix and the
        # 128-bit cp.async writes are both bank-conflict free.
        d, dv = self.tile_hdim, self.tile_hdimv
        sQ_layout = smem_layout(self.dtype, self.tile_m, d)
        sK_layout = smem_layout(self.dtype, self.tile_n, d)
        sV_layout = smem_layout(self.dtype, self.tile_n, dv)
        sO_layout = smem_layout(self.dtype, self.tile_m, dv)  # over sQ (dv <= d)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        # Global <-> shared copies: 16 bytes a thread, a row of 64 (or 32) columns per 8 (or 4)
        # threads (the same for the K and the V side: ``__init__``).
        copy_g2s, copy_r2g = gmem_tiled_copies(self.dtype, self.num_threads, d)
        # Global views as wide as the tiles (Note [rounded head dims]).
        mQ, mK = widen_cols(mQ, d), widen_cols(mK, d)
        mV, mO = widen_cols(mV, dv), widen_cols(mO, dv)
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (self.num_threads // 32, 1, 1),
            permutation_mnk=(self.num_threads // 32 * 16, 16, 16),
        )

        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)

        batch = mQ.shape[0]
        if cutlass.const_expr(mCuSeqlensQ is not None):
            batch = mCuSeqlensQ.shape[0] - 1
        if cutlass.const_expr(self.split_kv):  # the split index goes with the batch index
            batch = batch * (cute.size(mO.shape[0]) // cute.size(mQ.shape[0]))
        # Packed GQA: G heads' rows a tile, one CTA column a K/V head (class docstring).
        grid = (cute.ceil_div(max_seqlen_q * self.packed_heads, self.tile_m),
                cute.size(mQ.shape[2]) // self.packed_heads, batch)  # fmt: skip
        self.kernel(
            mQ, mK, mV, mO, mLSE,
            score_scale, scale_log2, window_left, window_right,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable,
            sQ_layout, sK_layout, sV_layout, sO_layout, copy_g2s, copy_r2g, tiled_mma,
            SharedStorage,
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
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        score_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        copy_g2s: cute.TiledCopy,
        copy_r2g: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        split = Int32(0)
        num_splits = Int32(1)
        if cutlass.const_expr(self.split_kv):
            num_splits = mO.shape[0] // mQ.shape[0]
            split = batch % num_splits
            batch = batch // num_splits
        if cutlass.const_expr(self.causal):
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        offset_q, seqlen_q, offset_k, seqlen_k = seqlen_info(
            batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK
        )
        if cutlass.const_expr(self.page_size and mSeqUsedK is None):
            seqlen_k = mPageTable.shape[1] * self.page_size  # every page of the row is full
        g = self.packed_heads
        if m_block * self.tile_m < seqlen_q * g:
            # This (batch, head)'s slices, moved to the sequence start for varlen. Packed GQA:
            # Q, O and LSE with (G, seqlen) rows, ``head`` a K/V head (class docstring).
            head_kv = head
            if cutlass.const_expr(g == 1):
                head_kv = head // (mQ.shape[2] // mK.shape[2])
            mQ_rows, mO_rows, mLSE_rows = packed_row_views(mQ, mO, mLSE, g)
            row_offset = offset_q * g  # packed: (head 0 of the group, position offset_q)
            qb = 0 if cutlass.const_expr(mCuSeqlensQ is not None) else batch
            kb = 0 if cutlass.const_expr(mCuSeqlensK is not None) else batch
            mQ_cur = cute.domain_offset((row_offset, 0), mQ_rows[qb, None, head, None])
            ob = qb  # split-KV: O and LSE are (num_splits * batch, ...), split slowest
            if cutlass.const_expr(self.split_kv):
                ob = split * mQ.shape[0] + qb
            mO_cur = cute.domain_offset((row_offset, 0), mO_rows[ob, None, head, None])
            mLSE_cur = cute.domain_offset((row_offset,), mLSE_rows[ob, head, None])
            pages = None
            if cutlass.const_expr(self.page_size):  # (num_pages, page_size, d) and the table row
                mK_cur = mK[None, None, head_kv, None]
                mV_cur = mV[None, None, head_kv, None]
                pages = mPageTable[batch, None]
            else:
                mK_cur = cute.domain_offset((offset_k, 0), mK[kb, None, head_kv, None])
                mV_cur = cute.domain_offset((offset_k, 0), mV[kb, None, head_kv, None])
            n_block_min, n_block_max, n_block_no_right, n_block_no_left = block_range(
                m_block, seqlen_q, seqlen_k, window_left, window_right,
                self.tile_m, self.tile_n, self.causal, self.local, g,
            )  # fmt: skip
            if cutlass.const_expr(self.split_kv):
                n_block_min, n_block_max = split_block_range(n_block_min, n_block_max, split,
                                                             num_splits)  # fmt: skip
            rows_left = seqlen_q * g - m_block * self.tile_m  # packed GQA: rows of G heads
            if n_block_max <= n_block_min:
                self.store_empty(mO_cur, mLSE_cur, m_block, rows_left, copy_r2g, tidx)
            else:
                smem = cutlass.memory.SmemAllocator()
                storage = smem.allocate(SharedStorage)
                sQ = storage.sQ.get_tensor(sQ_layout)
                sK = storage.sK.get_tensor(sK_layout)
                sV = storage.sV.get_tensor(sV_layout)
                sO = cute.make_tensor(sQ.iterator, sO_layout)
                self.attend(
                    mQ_cur, mK_cur, mV_cur, mO_cur, mLSE_cur, sQ, sK, sV, sO,
                    m_block, rows_left, seqlen_q, seqlen_k,
                    n_block_min, n_block_max, n_block_no_right, n_block_no_left,
                    score_scale, scale_log2, window_left, window_right,
                    copy_g2s, copy_r2g, tiled_mma, tidx, pages,
                )  # fmt: skip

    @cute.jit
    def attend(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        m_block: Int32,
        rows_left: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        n_block_min: Int32,
        n_block_max: Int32,
        n_block_no_right: Int32,
        n_block_no_left: Int32,
        score_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        copy_g2s: cute.TiledCopy,
        copy_r2g: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        pages: cute.Tensor | None,
    ):
        """Main loop of one query block over its key blocks, then the epilogue. Paged K/V:
        mK / mV are the (num_pages, page_size, d) pages of this K/V head, ``pages`` the
        sequence's page-table row."""
        tile_m, tile_n, d, dv = self.tile_m, self.tile_n, self.tile_hdim, self.tile_hdimv
        barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_threads)
        gQ = cute.local_tile(mQ, (tile_m, d), (m_block, 0))
        gK, gV = mK, mV  # paged: rows are gathered one at a time (``load_kv``)
        if cutlass.const_expr(not self.page_size):
            gK = cute.local_tile(mK, (tile_n, d), (None, 0))  # (tile_n, d, n_blocks)
            gV = cute.local_tile(mV, (tile_n, dv), (None, 0))
        # V^T view of sV for the B operand of P @ V (read with ldmatrix.trans).
        sVt = cute.composition(sV, cute.make_layout((dv, tile_n), stride=(tile_n, 1)))

        thr_g2s = copy_g2s.get_slice(tidx)
        tQgQ = thr_g2s.partition_S(gQ)
        tQsQ = thr_g2s.partition_D(sQ)
        tQcQ = thr_g2s.partition_S(cute.make_identity_tensor((tile_m, d)))
        tKgK, tVgV = gK, gV
        if cutlass.const_expr(not self.page_size):
            tKgK = thr_g2s.partition_S(gK)
            tVgV = thr_g2s.partition_S(gV)
        tKsK = thr_g2s.partition_D(sK)
        tVsV = thr_g2s.partition_D(sV)
        tKcK = thr_g2s.partition_S(cute.make_identity_tensor((tile_n, d)))
        tVcV = thr_g2s.partition_S(cute.make_identity_tensor((tile_n, dv)))
        # The padded columns of a rounded head dim: zero once, no load writes them (Note
        # [rounded head dims]); the prologue's barrier orders these stores before any read.
        if cutlass.const_expr(self.cols_qk is not None):
            zero_tile_cols(copy_g2s, sQ, self.cols_qk, tidx)
            zero_tile_cols(copy_g2s, sK, self.cols_qk, tidx)
        if cutlass.const_expr(self.cols_vo is not None):
            zero_tile_cols(copy_g2s, sV, self.cols_vo, tidx)

        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((tile_m, dv)), Float32)
        acc_O.fill(0.0)
        tScS = mn_view(thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n))))

        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        s2r_Q = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, self.dtype), tiled_mma)
        s2r_K = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, self.dtype), tiled_mma)
        s2r_V = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, self.dtype), tiled_mma)
        thr_s2r_Q = s2r_Q.get_slice(tidx)
        thr_s2r_K = s2r_K.get_slice(tidx)
        thr_s2r_V = s2r_V.get_slice(tidx)
        tSsQ = thr_s2r_Q.partition_S(sQ)
        tSrQ_view = thr_s2r_Q.retile(tSrQ)
        tSsK = thr_s2r_K.partition_S(sK)
        tSrK_view = thr_s2r_K.retile(tSrK)
        tOsVt = thr_s2r_V.partition_S(sVt)
        tOrVt_view = thr_s2r_V.retile(tOrVt)

        # Prologue: Q (rows past seqlen_q skipped) and the first key block (rows past seqlen_k
        # skipped: they are masked to -inf).
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if tQcQ[0, m, 0][0] < rows_left:
                copy_cols(copy_g2s, tQgQ, tQsQ, tQcQ, m, self.cols_qk)
        g2s = KVLoads(copy_g2s, tKgK, tKsK, tVgV, tVsV, tKcK, tVcV, thr_g2s, pages)
        self.load_kv(g2s, False, n_block_max - 1, seqlen_k, True, False)
        cute.arch.cp_async_commit_group()

        softmax = OnlineSoftmax(scale_log2, cute.size(tScS.shape[0]))
        softmax.reset()
        mma = MmaFragments(tiled_mma, thr_mma, tSrQ, tSrK, tOrVt, acc_O, tScS)
        s2r = SmemToReg(s2r_Q, s2r_K, s2r_V, tSsQ, tSrQ_view, tSsK, tSrK_view, tOsVt, tOrVt_view)
        mask_args = BlockRows(m_block, seqlen_q, seqlen_k, Window(window_left, window_right))

        # Key blocks from n_block_max - 1 down: [start_unmasked, n_block_max) cut the seqlen tail
        # or the right edge (the first block is always treated as such), [start_left_masked,
        # start_unmasked) need no mask, [n_block_min, start_left_masked) cut the left edge.
        start_unmasked = cutlass.max(cutlass.min(n_block_no_right, n_block_max - 1), n_block_min)
        start_left_masked = cutlass.min(cutlass.max(n_block_no_left, n_block_min), start_unmasked)
        self.step(n_block_max - 1, n_block_min, softmax, score_scale, mma, s2r, g2s, mask_args,
                  barrier, True, True)  # fmt: skip
        for i in cutlass.range(n_block_max - 1 - start_unmasked, unroll=1):
            self.step(n_block_max - 2 - i, n_block_min, softmax, score_scale, mma, s2r, g2s,
                      mask_args, barrier, False, True)  # fmt: skip
        for i in cutlass.range(start_unmasked - start_left_masked, unroll=1):
            self.step(start_unmasked - 1 - i, n_block_min, softmax, score_scale, mma, s2r, g2s,
                      mask_args, barrier, False, False)  # fmt: skip
        if cutlass.const_expr(self.local):
            for i in cutlass.range(start_left_masked - n_block_min, unroll=1):
                self.step(start_left_masked - 1 - i, n_block_min, softmax, score_scale, mma, s2r,
                          g2s, mask_args, barrier, False, True)  # fmt: skip

        # Epilogue: normalise once, stage O through sQ (every warp finished reading sQ before the
        # last block's V barrier), store 16 bytes a thread.
        lse = cute.make_rmem_tensor(cute.size(tScS.shape[0]), Float32)
        softmax.finalize(acc_O, lse)
        if cutlass.const_expr(not self.split_kv):
            acc_to_smem(acc_O, tiled_mma, sO, tidx)
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tScS[r, 0][0]
                if row < rows_left:
                    mLSE[m_block * tile_m + row] = lse[r]
        gO = cute.local_tile(mO, (tile_m, dv), (m_block, 0))
        if cutlass.const_expr(self.split_kv):
            # fp32 partial O straight from the accumulator (no 16-bit staging in sQ).
            # One row predicate a thread's row (tScS's rows are O's rows); a rounded head dim
            # predicates the columns too.
            tOgO = mn_view(thr_mma.partition_C(gO))
            tOcO = mn_view(thr_mma.partition_C(cute.make_identity_tensor((tile_m, dv))))
            acc_mn = mn_view(acc_O)
            for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                if tScS[r, 0][0] < rows_left:
                    for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                        if cutlass.const_expr(self.cols_vo is None):
                            tOgO[r, c] = acc_mn[r, c]
                        elif tOcO[0, c][1] < self.cols_vo:
                            tOgO[r, c] = acc_mn[r, c]
        else:
            barrier.arrive_and_wait()
            store_rows(sO, gO, rows_left, copy_r2g, tidx, self.cols_vo)

    @cute.jit
    def step(
        self,
        n_block: Int32,
        n_block_min: Int32,
        softmax: OnlineSoftmax,
        score_scale: Float32,
        mma: MmaFragments,
        s2r: SmemToReg,
        g2s: KVLoads,
        mask_args: BlockRows,
        barrier: pipeline.NamedBarrier,
        is_first: cutlass.Constexpr[bool],
        masked: cutlass.Constexpr[bool],
    ):
        """One key block: S = Q K^T, mask, online softmax, O += P V, with the next K in flight."""
        seqlen_k = mask_args.seqlen_k

        cute.arch.cp_async_wait_group(0)
        barrier.arrive_and_wait()
        self.load_kv(g2s, True, n_block, seqlen_k, is_first, True)
        cute.arch.cp_async_commit_group()

        acc_shape_S = mma.thr_mma.partition_shape_C((self.tile_m, self.tile_n))
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        acc_S.fill(0.0)
        gemm(mma.tiled_mma, acc_S, mma.tSrQ, mma.tSrK, s2r.tSsQ, s2r.tSrQ_view, s2r.tSsK,
             s2r.tSrK_view, s2r.s2r_Q, s2r.s2r_K)  # fmt: skip
        if cutlass.const_expr(self.has_softcap):
            softcap_scores(acc_S, score_scale)

        cute.arch.cp_async_wait_group(0)
        barrier.arrive_and_wait()
        if n_block > n_block_min:
            self.load_kv(g2s, False, n_block - 1, seqlen_k, False, False)
            cute.arch.cp_async_commit_group()

        if cutlass.const_expr(masked):
            apply_mask(
                mn_view(acc_S), mma.tScS, mask_args.m_block * self.tile_m, n_block * self.tile_n,
                mask_args.seqlen_q, seqlen_k, mask_args.window.left, mask_args.window.right,
                self.causal, self.local, self.packed_heads, self.positions_from_first,
            )  # fmt: skip
        softmax.step(acc_S, mma.acc_O, is_first, masked and (self.causal or self.local))

        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        gemm(mma.tiled_mma, mma.acc_O, acc_as_A_operand(rP), mma.tOrVt, None, None, s2r.tOsVt,
             s2r.tOrVt_view, None, s2r.s2r_V)  # fmt: skip

    @cute.jit
    def load_kv(
        self,
        g2s: KVLoads,
        is_v: cutlass.Constexpr[bool],
        n_block: Int32,
        seqlen_k: Int32,
        predicate: cutlass.Constexpr[bool],
        zero_fill: cutlass.Constexpr[bool],
    ):
        """cp.async one K (or, ``is_v``, V) tile; with ``predicate`` rows past seqlen_k are
        skipped (and zero-filled with ``zero_fill``). Only the first visited block can hold such
        rows. Paged K/V: each of this thread's rows is gathered from its page (key j: page
        ``pages[j // page_size]``, row ``j % page_size``), 16 bytes a copy as the dense tile."""
        tXgX, tXsX = (g2s.tVgV, g2s.tVsV) if cutlass.const_expr(is_v) else (g2s.tKgK, g2s.tKsK)
        tXcX = g2s.tVcV if cutlass.const_expr(is_v) else g2s.tKcK
        cols = self.cols_vo if cutlass.const_expr(is_v) else self.cols_qk
        if cutlass.const_expr(not predicate and not self.page_size):
            # The dense unpredicated tile in one copy: one base address, the rows at constant
            # offsets (a copy a row here costs registers and spills at d64, see docs/log); a
            # rounded head dim's column tail by a predicate a 16-byte piece.
            pred = None if cutlass.const_expr(cols is None) else col_predicate(tXcX, cols)
            cute.copy(g2s.copy_g2s, tXgX[None, None, None, n_block], tXsX, pred=pred)
        else:
            rows_left = seqlen_k - n_block * self.tile_n
            for n in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
                row = tXcX[0, n, 0][0]
                if cutlass.const_expr(predicate):
                    if row < rows_left:
                        self.copy_kv_row(g2s, tXgX, tXsX, tXcX, n, n_block, row, cols)
                    elif cutlass.const_expr(zero_fill):
                        tXsX[None, n, None].fill(0)
                else:
                    self.copy_kv_row(g2s, tXgX, tXsX, tXcX, n, n_block, row, cols)

    @cute.jit
    def copy_kv_row(self, g2s: KVLoads, tXgX: cute.Tensor, tXsX: cute.Tensor, tXcX: cute.Tensor,
                    n, n_block: Int32, row, cols: cutlass.Constexpr[int | None]):  # fmt: skip
        """This thread's part of tile row ``row`` (its row index ``n``) of key block
        ``n_block``: from the dense tile, or paged, from the key's page (a (tile_n, d) view of
        that one global row, row stride 0, partitioned as the dense tile is); with ``cols``
        (a rounded head dim) only the pieces of columns below it."""
        if cutlass.const_expr(self.page_size):
            key = n_block * self.tile_n + row
            src = tXgX[g2s.pages[key // self.page_size], key % self.page_size, None]
            rows = cute.make_tensor(
                src.iterator, cute.make_layout((self.tile_n, cute.size(src.shape)), stride=(0, 1))
            )
            copy_cols(g2s.copy_g2s, g2s.thr_g2s.partition_S(rows), tXsX, tXcX, n, cols)
        else:
            copy_cols(g2s.copy_g2s, tXgX[None, None, None, n_block], tXsX, tXcX, n, cols)

    @cute.jit
    def store_empty(
        self,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        m_block: Int32,
        rows_left: Int32,
        copy_r2g: cute.TiledCopy,
        tidx: Int32,
    ):
        """A query block that sees no key: O = 0 and LSE = -inf for its rows (split-KV: fp32 O
        of a split with no key block, a thread an element at a time)."""
        gO = cute.local_tile(mO, (self.tile_m, self.tile_hdimv), (m_block, 0))
        if cutlass.const_expr(self.split_kv):
            dv = self.head_dim_v  # O's own columns (the view is tile_hdimv wide)
            for i in cutlass.range(cute.ceil_div(self.tile_m * dv, self.num_threads), unroll=1):
                idx = tidx + i * self.num_threads
                if idx // dv < cutlass.min(rows_left, self.tile_m):
                    gO[idx // dv, idx % dv] = Float32(0.0)
        else:
            store_zeros(gO, rows_left, copy_r2g, tidx, self.cols_vo)
        for i in cutlass.range_constexpr(cute.ceil_div(self.tile_m, self.num_threads)):
            row = tidx + i * self.num_threads
            if row < cutlass.min(rows_left, self.tile_m):
                mLSE[m_block * self.tile_m + row] = -Float32.inf
