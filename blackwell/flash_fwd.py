"""sm100 forward kernel: FlashAttention-4 design on tcgen05 MMA, tensor memory and warp roles."""

from __future__ import annotations

import dataclasses
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

from cute_fa.config import FwdConfig
from cute_fa.dsl.copy import row_store_copy, store_rows, tma_views
from cute_fa.dsl.fastmath import exp2_row
from cute_fa.dsl.kernel import AttentionKernel
from cute_fa.dsl.mask import apply_mask, block_range
from cute_fa.dsl.pack_gqa import packed_row_views
from cute_fa.dsl.ring import ring_state, slot_state
from cute_fa.dsl.row_softmax import row_view
from cute_fa.dsl.seqlen import seqlen_info
from cute_fa.dsl.softmax import (
    ScoreScales,
    finalize_row,
    score_scales,
    softcap_scores,
    update_max,
)

from .support import (
    SM100_FWD_EPI_ROWS,
    SM100_FWD_TILE_Q,
    TMEM_COLUMNS,
    fwd_can_implement,
    fwd_ctas,
    fwd_kv_stages,
    fwd_q_tiles,
    fwd_regs,
    fwd_tmem_columns,
)

WARP = 32
WARPGROUP = 128
# Columns of O one correction thread moves per tcgen05.ld / st (32 fp32 registers).
O_CHUNK = 32
# Rows of the O tile the epilogue warp stores per pass (support.py).
EPI_ROWS = SM100_FWD_EPI_ROWS


class Role(enum.IntEnum):
    """First warp of each role (warps 0-15, 512 threads)."""

    SOFTMAX0 = 0  # warps 0-3: Q tile 0 (rows 0-127 of the CTA)
    SOFTMAX1 = 4  # warps 4-7: Q tile 1 (rows 128-255)
    CORRECTION = 8  # warps 8-11
    MMA = 12
    LOAD = 13
    EPILOGUE = 14
    IDLE = 15


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads)."""

    TMEM_ALLOC = 1  # MMA + softmax + correction warps (416 threads): TMEM address published
    TMEM_FREE = 2  # correction warps (128 threads): every TMEM read done, warp 8 frees


# The CTA pair (Sm100FwdTuning.cta_pair): a cluster of two CTAs along the grid's x. The cluster
# is the pair, so the multicast masks of the pair's commits (both CTAs: 0b11) and the rank whose
# barriers the consumers release (the even CTA: 0) are constants (the DSL's pipelines compute
# them at run time, values that lived through every role and went to local memory).
PAIR_CLUSTER = (2, 1, 1)
PAIR_MASK = 0b11
PAIR_LEADER = 0


class FlashAttentionForwardSm100(AttentionKernel):
    """Exact attention forward, FA4 design (sm_100a / sm_103a; cross-compiled only).

    Nothing of this kernel has run on a Blackwell GPU. It compiles for sm_100a and sm_103a, and
    tests/test_compile_sm100.py checks its SASS (UTCHMMA, LDTM / STTM, TMEM alloc / dealloc,
    USETMAXREG, UTMALDG, no local memory); docs/blackwell.md has the counts beside FA4's.

    Scope: bf16 / fp16; (d, dv) in (64, 64), (96, 96), (128, 128), (192, 128), and with one
    Q tile a CTA (192, 192), (256, 256); dense or varlen
    (cu_seqlens_q / cu_seqlens_k), seqused_q, seqused_k; no mask, causal or a sliding window;
    softcap; GQA/MQA (K/V head = head // (heads / kv heads)). ``blackwell/support.py`` rejects
    the rest with its reason.

    One Q tile (``Sm100FwdTuning.tile_m`` 128; the default where two tiles' S and O exceed the
    512 TMEM columns: d 256, (192, 192)): the same roles and protocol with q_tiles = 1, so
    every "for each Q tile i" below runs once: the CTA's 128 rows are Q tile 0, warps 4-7
    (softmax1) set their registers to the other warps' budget and leave, the TMEM plan is
    S0 [0, 128) and O0 [128, 128 + dv) (384 columns at d 256), pipeline_q / _s / _o / _stats /
    _epi have one stage, and the correction warpgroup takes 128 registers (80 spilled its
    final pass over dv 256). Shared memory at d 256: Q 64 KiB + 2 K/V stages of 64 KiB (O over
    Q); (192, 192): 48 KiB + 3 x 48 KiB. No ping-pong: while the softmax works on S the tensor
    cores only have the previous block's O += P V.

    Grid and work split
      One CTA a tile of tile_m = 256 query rows of one (head, batch): two Q tiles of 128 rows
      (the M of a tcgen05 MMA, and the 128 lanes of TMEM; the CTA pair: below); grid =
      (ceil(max_seqlen_q / 256), heads, batch), causal grids in reverse (longest rows first).
      Key blocks of tile_n = 128 from the last one the CTA sees down to the first
      (``block_range`` over the 256 rows).
    Warp roles (16 warps; setmaxnreg per role, ``support.fwd_regs``: 128 * (2 * 192 + 80 + 48)
    = 65536; with softcap at dv 128 the correction warps take 88 and the rest 40)
      warps 0-3   softmax0: Q tile 0; thread t owns query row t (TMEM lane t).  192 registers
      warps 4-7   softmax1: Q tile 1, the same for rows 128-255.                 192
      warps 8-11  correction: rescales O0 / O1 in TMEM when a row max moved, then O / l, LSE,
                  O -> smem (16-bit); warp 8 allocates and frees TMEM.            80
      warp 12     mma: one elected thread issues every tcgen05.mma and commit.    48
      warp 13     load: one thread issues every TMA load (Q0, Q1, K and V).       48
      warp 14     epilogue: O tiles smem -> global, 16-byte row-predicated stores. 48
      warp 15     idle.                                                          48
    Tensor memory (512 columns allocated; the plan, asserted at trace time to fit):
      S0 [0, 128)   S1 [128, 256)   O0 [256, 256 + dv)   O1 [256 + dv, 256 + 2 dv)
      P_i (tile_n 16-bit values a row = 64 columns) overwrites the first half of S_i: the
      softmax thread has its whole row of S in registers before it writes any P.
    MMA order (one thread; tcgen05 MMAs of one thread run in issue order):
      S0 = Q0 K[0]^T, S1 = Q1 K[0]^T; then for each further block j:
      O0 (+)= P0 V[j-1], S0 = Q0 K[j]^T, O1 (+)= P1 V[j-1], S1 = Q1 K[j]^T;
      last: O0 (+)= P0 V[n-1], O1 (+)= P1 V[n-1]. (Blocks counted in visiting order.)
      While softmax0 works on S0 the tensor cores run tile 1's GEMMs and the other way round.
      S_i = Q_i K^T is SS (both operands in smem), O_i += P_i V is TS (P from TMEM).
    Pipelines (producer -> consumer, stages, arrivals on full / empty):
      pipeline_q   (PipelineTmaUmma)  load -> mma, 2 stages (Q0, Q1; each used once),
                   full: 1 arrive + TMA bytes (128 x d x 2), empty: 1 (tcgen05.commit).
      pipeline_kv  (PipelineTmaUmma)  load -> mma, kv_stages (4 at d 64 and 128),
                   K[j] and V[j] in successive stages (K, V, K, V, ...; V's expected bytes
                   passed at its acquire), full: 1 + TMA bytes, empty: 1 (tcgen05.commit
                   once the GEMMs that read the stage are done). seqused_k: V[0]'s TMA
                   completes on mbar_v_tail (1 + bytes, phase 0, the load warp waits on it),
                   and its full arrival (no bytes) follows the zeroing (``load_v_tail``).
      pipeline_s, pipeline_o, pipeline_stats: one slot per Q tile (slot i belongs to tile i and
      keeps its own phase, ``cute_fa/dsl/ring.py slot_state``); "pipeline_s_i" is slot i.
      pipeline_s_i (PipelineUmmaAsync)  mma -> softmax_i, full: 1 (tcgen05.commit after S_i =
                   Q_i K^T), empty: 128 (softmax_i threads, once P_i is in TMEM: tcgen05.wait::st,
                   then arrive). The MMA's acquire before O_i += P_i V waits for P_i.
      pipeline_o_i (PipelineUmmaAsync)  mma -> correction, full: 1 (commit after O_i += P_i V[j]),
                   empty: 128 (correction threads, once O_i is rescaled for block j + 1, or read
                   by the final step). The MMA's acquire before the next O_i += P_i V waits for
                   the rescale.
      pipeline_stats_i (PipelineAsync)  softmax_i -> correction, 128 / 128 arrivals: per block
                   j >= 1 the factor 2^((m_old - m_new) scale_log2) of each row (smem, one fp32 a
                   row), after the last block the row's sum and max.
      pipeline_epi (PipelineAsync)  correction -> epilogue, 2 stages (O0, O1), 128 / 32:
                   O_i / l in 16 bits staged in Q_i's smem (every S_i GEMM has completed by
                   then: the commit of the last O_i GEMM follows them).
      Uses are counted, not carried: block j (visiting order) is use j of slot i of pipeline_s
      and pipeline_o, K[j] / V[j] are uses 2 j / 2 j + 1 of the K/V ring (``ring_state``).
      Arrival counts are asserted while tracing (``_pipelines``, ``self.protocol``).
    Softmax step (thread = row): wait S_i; tcgen05.ld the row (tile_n fp32); mask (blocks that
      cut the seqlen_k tail or the causal diagonal only: ``apply_mask`` on a (1, tile_n) view);
      row max; ``update_max`` (rescale threshold: the tuning's ``rescale_threshold``, 8 log2
      units by default: the max moves only by more than that, Note [rescale threshold]);
      factor -> correction
      (blocks after the first); p = 2^(s scale_log2 - m) with the argument by packed FFMA2 and
      every ``exp2_poly``-th pair (the tuning's; 8 by default, 0: none) of an unmasked block
      by the packed polynomial
      (``cute_fa/dsl/fastmath.py``); row sum; P -> 16 bits -> tcgen05.st into S_i's columns;
      wait::st; release S_i (= P_i ready).
    Correction: block 0 needs nothing; for each later block j of tile i: wait factor_i(j),
      wait O_i (O_i += P_i V[j-1] complete), and if any row of the warp has a factor other
      than 1, O_i *= factor in chunks of 32 columns (tcgen05.ld, FMUL2, tcgen05.st); release.
      Final: row sum and max -> 1 / l and LSE (written by the thread of the row if the row <
      seqlen_q); O_i / l -> 16 bits -> smem; arrive on pipeline_epi.
    Out of range: TMA zero-fills rows past the tensor's end; keys past seqlen_k are masked to
      -inf; query rows past seqlen_q are computed and never stored. Varlen: the TMA coordinate
      tensors are shifted to each sequence's first row (as in the sm90 kernel). A CTA that sees
      no key (causal with seqlen_q > seqlen_k, or a varlen tile past its sequence) loads and
      multiplies nothing; its correction warps store O = 0, LSE = -inf for its rows.
    Packed GQA (config.pack_gqa = G, a power of two; Note [packed GQA] in
      cute_fa/dsl/pack_gqa.py): Q, O and LSE are viewed with (G, seqlen) rows over the K/V heads
      (Q by 5-D TMA boxes); the grid has ceil(max_seqlen_q * G / 256) query blocks of nheads_kv
      heads; masks take positions, row // G; stores and LSE compare packed rows with
      seqlen_q * G.
    Sliding window: ``block_range`` for the CTA's 256 rows (both Q tiles' edges inside it);
      the blocks that may cut the left edge come last in the visiting order, so one loop picks
      the masked or the unmasked step per block (three loops spilled the row max at d 128).
    softcap: tanh(S * score_scale) on the loaded row before the mask (the softcap factor is in
      scale_log2), ``softcap_scores`` shared with the sm80 / sm90 kernels.
    seqused_k: rows between seqused_k and the end of the tensor (or sequence) may hold NaN;
      their scores are masked by select (NaN in K does no harm), and the load warp zeroes
      their V rows in the first visited block's stage before the MMA warp can read it
      (``load_v_tail``: 0 * NaN in P V would reach O).
    d > 128 ((192, 128): 2 K/V stages): S = Q K^T issues its K phases after the first from a
      runtime loop (``gemm``), so each phase's descriptor is formed at issue from the tile's
      base: unrolled, ptxas hoisted the 2 x 12 descriptors out of the key loop and the
      48-register MMA warp spilled them (43 LDL / 23 STL).
    The CTA pair (``Sm100FwdTuning.cta_pair``; FA4's 2-CTA forward, ``use_2cta_instrs``):
      a cluster of two CTAs (grid x: 2 CTAs per 512 query rows; rank = x % 2) runs every
      GEMM as one cta_group::2 tcgen05 MMA of M = 256 issued by the even CTA's MMA thread
      (the odd CTA's MMA warp idles). The pair's MMA i covers rows [(2 m + i) 256, + 256):
      the even CTA's Q tile i is the first 128 of them, the odd CTA's the rest
      (``q_row0``); each CTA's smem holds its 128 rows of Q_i, half of each K tile's keys
      (64) and half of each V tile's columns (dv / 2), so a K/V stage costs half (6 stages at
      d 128, 5 at (192, 128): FA4's). Each CTA's TMEM holds its 128 rows of S_i, P_i and O_i
      in the plan above (the 2-CTA accumulator's half is a CTA's 128 lanes), so the softmax,
      correction and epilogue warps work as in one CTA on their own rows. Both CTAs see the
      key blocks of the pair's 512 rows (``tile_work``). Changes to the protocol:
      - pipeline_q / pipeline_kv: each CTA's load warp waits on its own empty barrier and
        issues 2-CTA TMA loads of its halves; the bytes of both complete on the even CTA's
        full barrier, which only the even CTA's load warp arms (1 arrival + both CTAs'
        bytes); the MMA's release is a tcgen05.commit multicast to both CTAs' empty barriers.
      - pipeline_s_i / pipeline_o_i: the commit is multicast to both CTAs' full barriers; the
        softmax / correction threads of both CTAs release on the even CTA's empty barrier:
        2 x 128 arrivals. The correction's final O release (no MMA waits for it) is left
        out, so no arrival is left in flight to the other CTA.
      - pipeline_stats_i, pipeline_epi: within each CTA, as above.
      - the multicast masks (0b11) and the release target (rank 0) are constants: the cluster
        is the pair.
      - barrier init: a cluster barrier (arrive relaxed + wait) instead of __syncthreads.
      - TMEM: warp 8 of each CTA allocates with cta_group::2; the release waits for the
        other CTA's warp 8 (``mbar_tmem_dealloc``, the DSL's TmemAllocator handshake).
      - the load warp of each CTA waits, last, for the release of every K/V stage's last use
        (the MMA's commits arrive on its smem; the CTA stays until they have).
      Declined (``support.fwd_pair_can_implement``): head dims other than (128, 128) and
      (192, 128); seqused_k (the V-tail zeroing waits on a barrier of the load warp's own CTA,
      and the pair's TMA completes on the even CTA's); softcap (the softmax warps spill).
    Not yet: a persistent scheduler, TMA store of O, the order tuning of
      FA4 (S load in chunks, the correction's rescale overlapping its epilogue).
    """

    arch = 100

    def __init__(self, config: FwdConfig):
        super().__init__(config)
        self.tile_q = SM100_FWD_TILE_Q  # rows of one Q tile (TMEM lanes)
        self.q_tiles = fwd_q_tiles(config)  # 2, or 1 (tile_m 128: d 256, (192, 192))
        # CTAs of one MMA (2: the CTA pair, cta_group::2), the MMA's M (both CTAs' Q tile i),
        # and the query rows of one grid step along x (a CTA, or a pair).
        self.ctas = fwd_ctas(config)
        self.mma_m = self.ctas * self.tile_q
        self.pair_rows = self.ctas * self.tile_m
        self.num_threads = WARP * 16
        self.kv_stages = fwd_kv_stages(config)
        self.regs_softmax, self.regs_correction, self.regs_other = fwd_regs(config)
        # The softmax's numerics (Sm100FwdTuning): rescale threshold in log2 units, and every
        # exp2_poly-th pair of an unmasked block's exponentials by polynomial (0: none).
        self.rescale_threshold = float(config.tuning.rescale_threshold)
        self.exp2_poly_every = config.tuning.exp2_poly
        # Packed GQA (Note [packed GQA] in cute_fa/dsl/pack_gqa.py): query heads whose rows
        # share a tile; 1: one head a tile.
        self.packed_heads = config.pack_gqa or 1
        # TMEM plan (columns of 32 bits): S_i of every Q tile, then O_i.
        self.tmem_s = [i * self.tile_n for i in range(self.q_tiles)]
        self.tmem_o = [self.q_tiles * self.tile_n + i * self.tile_hdimv
                       for i in range(self.q_tiles)]  # fmt: skip
        self.tmem_p = list(self.tmem_s)  # P_i over the first tile_n / 2 columns of S_i
        self.tmem_total = fwd_tmem_columns(self.tile_n, self.tile_hdimv, self.q_tiles)
        assert self.tmem_total == self.tmem_o[-1] + self.tile_hdimv
        assert self.tmem_total <= TMEM_COLUMNS, f"TMEM plan of {self.tmem_total} columns"

    can_implement = staticmethod(fwd_can_implement)

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
        d, dv, tile_n, tile_q = self.tile_hdim, self.tile_hdimv, self.tile_n, self.tile_q
        # Packed GQA: Q, O and LSE with (G, seqlen) rows over the K/V heads (mQ keeps the
        # call's shapes for the sequence lengths).
        mQ_rows, mO_rows, mLSE_rows = packed_row_views(mQ, mO, mLSE, self.packed_heads)
        mQ_t, mK_t, mVt = tma_views(mQ_rows, mK, mV)

        tiled_mma_qk, tiled_mma_pv = self.make_tiled_mmas()
        # The MMA's M: a CTA's Q tile, or the pair's two (each CTA's smem holds its half of
        # every operand: its 128 rows of Q, half of K's keys, half of V's columns).
        mma_tiler_qk = (self.mma_m, tile_n, d)
        mma_tiler_pv = (self.mma_m, dv, tile_n)
        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, mma_tiler_qk, self.dtype,
                                                   self.q_tiles)  # fmt: skip
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, mma_tiler_qk, self.dtype,
                                                   self.kv_stages)  # fmt: skip
        sV_layout0 = sm100_utils.make_smem_layout_b(tiled_mma_pv, mma_tiler_pv, self.dtype,
                                                    self.kv_stages)  # fmt: skip
        # K[j] and V[j] share the ring: V's stages take K's stage stride (a K tile is at least a
        # V tile: dv <= d).
        k_tile = cute.cosize(cute.select(sK_layout.outer, mode=[0, 1, 2]))
        assert cute.cosize(cute.select(sV_layout0.outer, mode=[0, 1, 2])) <= k_tile
        sV_layout = cute.make_composed_layout(
            sV_layout0.inner, 0,
            cute.append(cute.select(sV_layout0.outer, mode=[0, 1, 2]),
                        cute.make_layout(self.kv_stages, stride=k_tile)),
        )  # fmt: skip
        # P in TMEM, read as the A operand of O += P V (the layout of a K-major A tile).
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, mma_tiler_pv, self.dtype, 1)
        # O staged in smem (16-bit, row-major tiles of (128, dv)), over the Q tiles' memory.
        sO_layout = sm100_utils.make_smem_layout_epi(
            self.dtype, LayoutEnum.ROW_MAJOR, (tile_q, dv), self.q_tiles
        )
        assert cute.cosize(sO_layout) <= cute.cosize(sQ_layout)

        # The pair: 2-CTA TMA loads (each CTA's half lands in its own smem, the bytes complete
        # on the even CTA's full barrier), the cluster's shape for the atoms.
        load = cpasync.CopyBulkTensorTileG2SOp(self.cta_group)
        cluster = () if cutlass.const_expr(self.ctas == 1) else (
            self.cta_layout_vmnk(tiled_mma_qk).shape,)  # fmt: skip
        tma_q, mQ_tma = cute.nvgpu.make_tiled_tma_atom_A(
            load, mQ_t, cute.select(sQ_layout, mode=[0, 1, 2]), mma_tiler_qk, tiled_mma_qk,
            *cluster,
        )  # fmt: skip
        tma_k, mK_tma = cute.nvgpu.make_tiled_tma_atom_B(
            load, mK_t, cute.select(sK_layout, mode=[0, 1, 2]), mma_tiler_qk, tiled_mma_qk,
            *cluster,
        )  # fmt: skip
        tma_v, mV_tma = cute.nvgpu.make_tiled_tma_atom_B(
            load, mVt, cute.select(sV_layout, mode=[0, 1, 2]), mma_tiler_pv, tiled_mma_pv,
            *cluster,
        )  # fmt: skip
        # Bytes a full barrier expects: one CTA's tile, or both halves of the pair's.
        self.tx_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
        self.tx_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2]))
        self.tx_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1, 2]))
        if cutlass.const_expr(self.ctas == 2):
            self.tx_q, self.tx_k, self.tx_v = (2 * self.tx_q, 2 * self.tx_k, 2 * self.tx_v)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_tiles]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2 * self.q_tiles]
            mbar_o: cute.struct.MemRange[cutlass.Int64, 2 * self.q_tiles]
            mbar_stats: cute.struct.MemRange[cutlass.Int64, 2 * self.q_tiles]
            mbar_epi: cute.struct.MemRange[cutlass.Int64, 2 * self.q_tiles]
            # seqused_k: the load warp's own barrier for the first visited V tile (load).
            mbar_v_tail: cutlass.Int64
            if cutlass.const_expr(self.ctas == 2):
                # The pair's TMEM release: each CTA's allocator warp arrives on the other's.
                mbar_tmem_dealloc: cutlass.Int64
            tmem_addr: Int32
            # Row statistics softmax -> correction: (row, field, Q tile); field 0: the rescale
            # factor of a block, or the final row sum; field 1: the final row max.
            stats: cute.struct.MemRange[Float32, 2 * self.q_tiles * tile_q]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]

        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)
        batch = cute.size(mQ.shape[0])
        if cutlass.const_expr(mCuSeqlensQ is not None):
            batch = cute.size(mCuSeqlensQ.shape[0]) - 1
        grid = (cute.ceil_div(max_seqlen_q * self.packed_heads, self.tile_m),
                cute.size(mQ_rows.shape[2]), batch)  # fmt: skip
        launch = {}
        if cutlass.const_expr(self.ctas == 2):
            # Two CTAs (a cluster) per pair_rows query rows.
            grid = (cute.ceil_div(max_seqlen_q * self.packed_heads, self.pair_rows) * self.ctas,
                    cute.size(mQ_rows.shape[2]), batch)  # fmt: skip
            launch = {"cluster": PAIR_CLUSTER}
        self.kernel(
            mQ_tma, mK_tma, mV_tma, mQ, mK, mO_rows, mLSE_rows, tma_q, tma_k, tma_v, scale_log2,
            score_scale, window_left, window_right, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
            sQ_layout, sK_layout, sV_layout, tP_layout, sO_layout, tiled_mma_qk, tiled_mma_pv,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1, **launch)  # fmt: skip

    @property
    def cta_group(self) -> tcgen05.CtaGroup:
        return tcgen05.CtaGroup.TWO if self.ctas == 2 else tcgen05.CtaGroup.ONE

    def make_tiled_mmas(self, ctas: int | None = None) -> tuple[cute.TiledMma, cute.TiledMma]:
        """(S = Q K^T: both operands K-major in smem; O = P V: P K-major from TMEM, V^T
        MN-major in smem), fp32 accumulators in TMEM; of ``ctas`` CTAs (default: the kernel's;
        1 for the per-CTA TMEM views of the softmax and correction warps: a CTA's half of a
        2-CTA accumulator of M = 256 is its 128 lanes, the layout of a 1-CTA M = 128 one)."""
        ctas = self.ctas if ctas is None else ctas
        group = tcgen05.CtaGroup.TWO if ctas == 2 else tcgen05.CtaGroup.ONE
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, group, (ctas * self.tile_q, self.tile_n),
        )  # fmt: skip
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, group, (ctas * self.tile_q, self.tile_hdimv),
            tcgen05.OperandSource.TMEM,
        )  # fmt: skip
        return tiled_mma_qk, tiled_mma_pv

    def cta_layout_vmnk(self, tiled_mma_qk: cute.TiledMma) -> cute.Layout:
        """The pair's cluster as (CTA in the MMA, m, n, k)."""
        return cute.tiled_divide(cute.make_layout(PAIR_CLUSTER), (tiled_mma_qk.thr_id.shape,))

    def pair_rank(self):
        """This CTA's rank in its pair (0: the even CTA, which issues the pair's MMAs); 0
        without the pair."""
        if cutlass.const_expr(self.ctas == 1):
            return 0
        return cute.arch.block_idx()[0] % self.ctas

    def q_row0(self, m_block, i, cta):
        """First query row of this CTA's Q tile ``i``: the pair's MMA i covers rows
        [(m_block q_tiles + i) 256, + 256), the even CTA the first 128 of them (FA4's order)."""
        if cutlass.const_expr(self.ctas == 1):
            return m_block * self.tile_m + i * self.tile_q
        return ((m_block * self.q_tiles + i) * self.ctas + cta) * self.tile_q

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ_tma: cute.Tensor,
        mK_tma: cute.Tensor,
        mV_tma: cute.Tensor,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        scale_log2: Float32,
        score_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        pipes = self._pipelines(storage, tiled_mma_qk)
        if cutlass.const_expr(self.config.seqused_k):
            if warp_idx == Role.LOAD:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(storage.mbar_v_tail.ptr, 1)
        pair = {}
        if cutlass.const_expr(self.ctas == 2):
            # cta_group::2 allocation: warp 8 of each CTA allocates; the release waits for the
            # other CTA's warp 8 (mbar_tmem_dealloc, initialized here).
            pair = dict(is_two_cta=True,
                        two_cta_tmem_dealloc_mbar_ptr=storage.mbar_tmem_dealloc.ptr)  # fmt: skip
        tmem = TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=int(Barrier.TMEM_ALLOC), num_threads=WARP * (5 + 4 * self.q_tiles)
            ),
            allocator_warp_id=int(Role.CORRECTION),
            **pair,
        )
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.ctas == 2):
            # The other CTA's barriers are initialized before anything arrives on them.
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        # The softmax and correction warps' TMEM views: a CTA's own 128 lanes.
        view_qk, view_pv = tiled_mma_qk, tiled_mma_pv
        if cutlass.const_expr(self.ctas == 2):
            view_qk, view_pv = self.make_tiled_mmas(1)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sO_ptr = cute.recast_ptr(storage.sQ.data_ptr(), sO_layout.inner)
        sO = cute.make_tensor(sO_ptr, sO_layout.outer)
        sStats = storage.stats.get_tensor(cute.make_layout((self.tile_q, 2, self.q_tiles)))

        gmem = (mQ, mK, mO, mLSE, mQ_tma, mK_tma, mV_tma, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ,
                mSeqUsedK, window_left, window_right)  # fmt: skip
        # Each role finds its tile's work itself, after its setmaxnreg (values computed before
        # the role split would live through the 48-register roles).
        if warp_idx == Role.LOAD:
            cute.arch.setmaxregister_decrease(self.regs_other)
            self.load(self.tile_work(*gmem), tma_q, tma_k, tma_v, sQ, sK, sV, tiled_mma_qk,
                      tiled_mma_pv, pipes, storage.mbar_v_tail.ptr)  # fmt: skip
        if warp_idx == Role.MMA:
            cute.arch.setmaxregister_decrease(self.regs_other)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            if cutlass.const_expr(self.ctas == 2):
                if self.pair_rank() == 0:  # the even CTA issues the pair's MMAs
                    self.mma(self.tile_work(*gmem), sQ, sK, sV, tP_layout, tiled_mma_qk,
                             tiled_mma_pv, tmem_ptr, pipes)  # fmt: skip
            else:
                self.mma(self.tile_work(*gmem), sQ, sK, sV, tP_layout, tiled_mma_qk,
                         tiled_mma_pv, tmem_ptr, pipes)  # fmt: skip
        if warp_idx == Role.EPILOGUE:
            cute.arch.setmaxregister_decrease(self.regs_other)
            self.epilogue(self.tile_work(*gmem), sO, pipes)
        if warp_idx == Role.IDLE:
            cute.arch.setmaxregister_decrease(self.regs_other)
        if cutlass.const_expr(self.q_tiles == 1):
            # One Q tile: warps 4-7 (softmax1's) idle at the budget of the other warps.
            if warp_idx >= Role.SOFTMAX1 and warp_idx < Role.CORRECTION:
                cute.arch.setmaxregister_decrease(self.regs_other)
        if warp_idx < Role.SOFTMAX0 + 4 * self.q_tiles:
            cute.arch.setmaxregister_increase(self.regs_softmax)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            # One code path for both softmax warpgroups: the Q tile is a runtime value.
            self.softmax(warp_idx // 4, self.tile_work(*gmem), view_qk, tmem_ptr, sStats,
                         ScoreScales(score_scale, scale_log2), window_left, window_right,
                         pipes, tidx % WARPGROUP)  # fmt: skip
        if warp_idx >= Role.CORRECTION and warp_idx < Role.MMA:
            cute.arch.setmaxregister_decrease(self.regs_correction)
            tmem.allocate(TMEM_COLUMNS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.correction(self.tile_work(*gmem), view_pv, tmem_ptr, sStats, sO,
                            scale_log2, pipes, tidx % WARPGROUP)  # fmt: skip
            tmem.relinquish_alloc_permit()
            pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_FREE),
                                  num_threads=WARPGROUP).arrive_and_wait()  # fmt: skip
            tmem.free(tmem_ptr, TMEM_COLUMNS)

    def _pipelines(self, storage, tiled_mma_qk: cute.TiledMma) -> dict:
        """Every mbarrier pipeline of the class docstring; the stages and arrival counts each
        barrier was made with are asserted against the docstring's protocol."""
        softmax_threads = WARPGROUP  # one softmax warpgroup per Q tile
        correction_threads = WARPGROUP
        epilogue_threads = WARP * (Role.IDLE - Role.EPILOGUE)
        assert (Role.SOFTMAX1 - Role.SOFTMAX0) * WARP == softmax_threads
        assert (Role.MMA - Role.CORRECTION) * WARP == correction_threads
        assert self.kv_stages >= 2 and self.q_tiles in (1, 2)
        assert epilogue_threads == WARP
        # The pair: the tcgen05 sides span both CTAs. A TMA -> MMA full barrier is the even
        # CTA's (one arrival + both CTAs' bytes); the MMA's commits arrive on both CTAs'
        # barriers (multicast); the softmax / correction threads of both CTAs release S / O
        # on the even CTA's empty barrier, so it counts both CTAs' threads.
        cluster = {}
        if cutlass.const_expr(self.ctas == 2):
            cluster = {"cta_layout_vmnk": self.cta_layout_vmnk(tiled_mma_qk)}

        def group(n: int):
            return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)

        pipes = dict(
            q=pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_tiles,
                producer_group=group(1), consumer_group=group(1), tx_count=self.tx_q,
                defer_sync=True, **cluster,
            ),
            kv=pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.mbar_kv.data_ptr(), num_stages=self.kv_stages,
                producer_group=group(1), consumer_group=group(1), tx_count=self.tx_k,
                defer_sync=True, **cluster,
            ),
            epi=pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_epi.data_ptr(), num_stages=self.q_tiles,
                producer_group=group(correction_threads), consumer_group=group(epilogue_threads),
                defer_sync=True,
            ),
        )  # fmt: skip
        # One slot per Q tile (``slot_state``: slot i belongs to tile i, each keeps its phase).
        for name, mbar, kind, producers, consumers, extra in (
            ("s", storage.mbar_s, pipeline.PipelineUmmaAsync, 1,
             self.ctas * softmax_threads, cluster),
            ("o", storage.mbar_o, pipeline.PipelineUmmaAsync, 1,
             self.ctas * correction_threads, cluster),
            ("stats", storage.mbar_stats, pipeline.PipelineAsync, softmax_threads,
             correction_threads, {}),
        ):  # fmt: skip
            pipes[name] = kind.create(
                barrier_storage=mbar.data_ptr(), num_stages=self.q_tiles,
                producer_group=group(producers), consumer_group=group(consumers),
                defer_sync=True, **extra,
            )  # fmt: skip
        # The protocol the docstring states: (stages, full arrivals, empty arrivals) ...
        self.protocol = {
            "q": (self.q_tiles, 1, 1), "kv": (self.kv_stages, 1, 1),
            "s": (self.q_tiles, 1, self.ctas * softmax_threads),
            "o": (self.q_tiles, 1, self.ctas * correction_threads),
            "stats": (self.q_tiles, softmax_threads, correction_threads),
            "epi": (self.q_tiles, correction_threads, epilogue_threads),
        }  # fmt: skip
        # ... is what each barrier was initialized with.
        built = {name: (p.num_stages, p.sync_object_full.arrive_count,
                        p.sync_object_empty.arrive_count) for name, p in pipes.items()}  # fmt: skip
        assert built == self.protocol, (built, self.protocol)
        # TMA full barriers expect one CTA's tile, or both halves of the pair's (``__call__``).
        assert (pipes["q"].sync_object_full.tx_count, pipes["kv"].sync_object_full.tx_count) == (
            self.tx_q, self.tx_k)  # fmt: skip
        # Who commits / releases where (the pair: the DSL's masks; asserted by kind).
        assert all(isinstance(pipes[n], pipeline.PipelineTmaUmma) for n in ("q", "kv"))
        assert all(isinstance(pipes[n], pipeline.PipelineUmmaAsync) for n in ("s", "o"))
        assert all(pipes[n].cta_group == self.cta_group for n in ("q", "kv", "s", "o"))
        if cutlass.const_expr(self.ctas == 2):
            for name in ("q", "kv"):  # the MMA's release: a commit multicast to both CTAs
                pipes[name] = dataclasses.replace(pipes[name], producer_mask=PAIR_MASK,
                                                  consumer_mask=PAIR_MASK)  # fmt: skip
            for name in ("s", "o"):  # commit to both CTAs; release on the even CTA's barrier
                pipes[name] = dataclasses.replace(pipes[name], producer_mask=PAIR_MASK,
                                                  consumer_mask=PAIR_LEADER)  # fmt: skip
        return pipes

    @cute.jit
    def tile_work(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mQ_tma: cute.Tensor,
        mK_tma: cute.Tensor,
        mV_tma: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        window_left: Int32,
        window_right: Int32,
    ):
        """Where this CTA's tile lies: (m_block, seqlen_q, seqlen_k, n_block_min, n_block_max,
        n_block_no_right, n_block_no_left (``block_range``, for the CTA's tile_m rows: both Q
        tiles' bounds lie inside them), and the (head, batch) views of Q, K, V (TMA
        coordinates), O, LSE), the same in every role."""
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.ctas == 2):
            # The pair's block of pair_rows rows: both CTAs see the same key blocks (the even
            # CTA's MMAs read both CTAs' halves of them).
            m_block = m_block // self.ctas
            if cutlass.const_expr(self.causal):
                m_block = cute.arch.grid_dim()[0] // self.ctas - 1 - m_block
        elif cutlass.const_expr(self.causal):
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        offset_q, seqlen_q, offset_k, seqlen_k = seqlen_info(
            batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK
        )
        n_block_min, n_block_max, n_block_no_right, n_block_no_left = block_range(
            m_block, seqlen_q, seqlen_k, window_left, window_right, self.pair_rows, self.tile_n,
            self.causal, self.local, self.packed_heads,
        )  # fmt: skip
        if cutlass.const_expr(mCuSeqlensQ is not None or mSeqUsedQ is not None):
            if m_block * self.pair_rows >= seqlen_q * self.packed_heads:
                n_block_max = n_block_min  # no row of this CTA exists: load and store nothing
        head_kv = head  # packed GQA: the grid's heads are the K/V heads
        if cutlass.const_expr(self.packed_heads == 1):
            head_kv = head // (mQ.shape[2] // mK.shape[2])
        qb = 0 if cutlass.const_expr(mCuSeqlensQ is not None) else batch
        kb = 0 if cutlass.const_expr(mCuSeqlensK is not None) else batch
        mQ_cur = mQ_tma[None, None, head, qb]
        mO_cur = mO[qb, None, head, None]
        mLSE_cur = mLSE[qb, head, None]
        mK_cur = mK_tma[None, None, head_kv, kb]
        mV_cur = mV_tma[None, None, head_kv, kb]
        if cutlass.const_expr(mCuSeqlensQ is not None):
            row_offset = offset_q * self.packed_heads  # packed: (head 0, position offset_q)
            mQ_cur = cute.domain_offset((row_offset, 0), mQ_cur)
            mO_cur = cute.domain_offset((row_offset, 0), mO_cur)
            mLSE_cur = cute.domain_offset((row_offset,), mLSE_cur)
        if cutlass.const_expr(mCuSeqlensK is not None):
            mK_cur = cute.domain_offset((offset_k, 0), mK_cur)
            mV_cur = cute.domain_offset((0, offset_k), mV_cur)
        return (m_block, seqlen_q, seqlen_k, n_block_min, n_block_max, n_block_no_right,
                n_block_no_left, mQ_cur, mK_cur, mV_cur, mO_cur, mLSE_cur)  # fmt: skip

    @cute.jit
    def load(
        self,
        work: tuple,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        pipes: dict,
        mbar_v_tail: cute.Pointer,
    ):
        """Load warp: Q0, K[0], Q1, V[0], K[1], V[1], ... (blocks in visiting order, from
        n_block_max - 1 down; K[j] is use 2 j of the K/V ring, V[j] use 2 j + 1). seqused_k:
        V[0] through ``load_v_tail``."""
        (m_block, _, seqlen_k, n_block_min, n_block_max, _, _, mQ_cur, mK_cur, mV_cur, _,
         _) = work  # fmt: skip
        for atom in (tma_q, tma_k, tma_v):
            cpasync.prefetch_descriptor(atom)
        # The pair: this CTA's half of each tile (its Q rows, half of K's keys and of V's
        # columns).
        thr_qk = tiled_mma_qk.get_slice(self.pair_rank())
        thr_pv = tiled_mma_pv.get_slice(self.pair_rank())
        gQ = cute.flat_divide(mQ_cur, (self.mma_m, self.tile_hdim))
        gK = cute.flat_divide(mK_cur, (self.tile_n, self.tile_hdim))
        gV = cute.flat_divide(mV_cur, (self.tile_hdimv, self.tile_n))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
            cute.group_modes(thr_qk.partition_A(gQ), 0, 3),
        )  # fmt: skip
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
            cute.group_modes(thr_qk.partition_B(gK), 0, 3),
        )  # fmt: skip
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
            cute.group_modes(thr_pv.partition_B(gV), 0, 3),
        )  # fmt: skip
        pipeline_q, pipeline_kv = pipes["q"], pipes["kv"]
        if cutlass.const_expr(self.ctas == 2):
            # Only the even CTA's load warp arms the full barriers (one arrival + both CTAs'
            # bytes); the flag is computed here, not carried from before the role split.
            leader = self.pair_rank() == PAIR_LEADER
            pipeline_q = dataclasses.replace(pipeline_q, is_leader_cta=leader)
            pipeline_kv = dataclasses.replace(pipeline_kv, is_leader_cta=leader)
        n_blocks = n_block_max - n_block_min
        if n_blocks > 0:
            for i in cutlass.range_constexpr(self.q_tiles):
                q_state = ring_state(self.q_tiles, i, producer=True)
                pipeline_q.producer_acquire(q_state)
                cute.copy(tma_q, tQgQ[None, m_block * self.q_tiles + i, 0], tQsQ[None, i],
                          tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))  # fmt: skip
                if cutlass.const_expr(i == 0):
                    self.load_kv(tma_k, tKgK[None, n_block_max - 1, 0], tKsK, pipeline_kv, 0,
                                 self.tx_k)  # fmt: skip
            for j in cutlass.range(n_blocks - 1, unroll=1):
                n_block = n_block_max - 1 - j
                if cutlass.const_expr(self.config.seqused_k):
                    if j == 0:
                        self.load_v_tail(tma_v, tVgV[None, 0, n_block], tVsV, sV, pipeline_kv,
                                         seqlen_k - n_block * self.tile_n, mbar_v_tail)  # fmt: skip
                    else:
                        self.load_kv(tma_v, tVgV[None, 0, n_block], tVsV, pipeline_kv,
                                     2 * j + 1, self.tx_v)  # fmt: skip
                else:
                    self.load_kv(tma_v, tVgV[None, 0, n_block], tVsV, pipeline_kv, 2 * j + 1,
                                 self.tx_v)  # fmt: skip
                self.load_kv(tma_k, tKgK[None, n_block - 1, 0], tKsK, pipeline_kv, 2 * j + 2,
                             self.tx_k)  # fmt: skip
            if cutlass.const_expr(self.config.seqused_k):
                if n_blocks == 1:
                    self.load_v_tail(tma_v, tVgV[None, 0, n_block_min], tVsV, sV, pipeline_kv,
                                     seqlen_k - n_block_min * self.tile_n, mbar_v_tail)  # fmt: skip
                else:
                    self.load_kv(tma_v, tVgV[None, 0, n_block_min], tVsV, pipeline_kv,
                                 2 * n_blocks - 1, self.tx_v)  # fmt: skip
            else:
                self.load_kv(tma_v, tVgV[None, 0, n_block_min], tVsV, pipeline_kv,
                             2 * n_blocks - 1, self.tx_v)  # fmt: skip
        if cutlass.const_expr(self.ctas == 2):
            # The MMA's release of a K/V stage arrives on both CTAs' empty barriers; this CTA
            # stays until the last use of each stage is released (nothing may arrive on the
            # smem of a CTA that has exited). Use 2 n_blocks + s waits for use 2 n_blocks + s
            # - kv_stages (passes at once for a stage never used).
            for s in cutlass.range_constexpr(self.kv_stages):
                state = ring_state(self.kv_stages, 2 * n_blocks + s, producer=True)
                pipeline_kv.sync_object_empty.wait(state.index, state.phase)

    @cute.jit
    def load_v_tail(self, tma_v: cute.CopyAtom, src: cute.Tensor, tVsV: cute.Tensor,
                    sV: cute.Tensor, pipeline_kv, valid: Int32,
                    mbar_v_tail: cute.Pointer):  # fmt: skip
        """seqused_k: V[0], the first visited block (use 1 of the K/V ring), with its keys
        [valid, tile_n) zeroed before the MMA warp may read the stage.

        With seqused_k the rows between seqused_k and the end of the tensor (or sequence) are
        not inputs and may hold NaN: their P is 0, but 0 * NaN in O += P V would reach O. The
        first visited block is the only one holding such rows. The TMA completes on this
        warp's own barrier (``mbar_v_tail``, one arrival + the tile's bytes, used once per
        CTA: phase 0) instead of the stage's full barrier; the warp waits for it, zeroes the
        keys from ``valid`` on (lane l: keys valid + l, valid + l + 32, ...), fences the
        generic-proxy stores for the async proxy (the MMA reads smem through it) and only then
        arrives on the stage's full barrier with no bytes expected, which completes its phase.
        The stage's empty wait comes first, as in any acquire."""
        state = ring_state(self.kv_stages, 1, producer=True)
        pipeline_kv.sync_object_empty.wait(state.index, state.phase)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_v_tail, self.tx_v)
        cute.copy(tma_v, src, tVsV[None, state.index], tma_bar_ptr=mbar_v_tail)
        cute.arch.mbarrier_wait(mbar_v_tail, 0)
        # The stage as the MMA's B operand: (((dv atoms), 16 keys), 1, tile_n / 16 key groups);
        # key k of the tile is ((n, k % 16), 0, k // 16) for every column n.
        sV_stage = sV[None, None, None, state.index]
        assert cute.size(sV_stage.shape[0][1]) == 16 and cute.size(sV_stage.shape[1]) == 1
        assert cute.size(sV_stage.shape[2]) * 16 == self.tile_n
        assert cute.size(sV_stage.shape[0][0]) == self.tile_hdimv
        for k in cutlass.range(cutlass.max(valid, 0) + cute.arch.lane_idx(), self.tile_n, WARP,
                               unroll=1):  # fmt: skip
            for n in cutlass.range_constexpr(self.tile_hdimv):
                sV_stage[((n, k % 16), 0, k // 16)] = self.dtype(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        # The stage's full barrier: its one producer arrival, no bytes (the TMA went elsewhere).
        pipeline_kv.producer_acquire(state, try_acquire_token=cutlass.Boolean(True),
                                     expected_tx=0)  # fmt: skip

    @cute.jit
    def load_kv(self, tma: cute.CopyAtom, src: cute.Tensor, tXsX: cute.Tensor, pipeline_kv,
                count: Int32, tx_bytes: cutlass.Constexpr[int]):  # fmt: skip
        """Use ``count`` of the K/V ring: wait for its stage, expect ``tx_bytes``, TMA."""
        state = ring_state(self.kv_stages, count, producer=True)
        pipeline_kv.producer_acquire(state, expected_tx=tx_bytes)
        cute.copy(tma, src, tXsX[None, state.index],
                  tma_bar_ptr=pipeline_kv.producer_get_barrier(state))  # fmt: skip

    @cute.jit
    def mma(
        self,
        work: tuple,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tP_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tmem_ptr: cute.Pointer,
        pipes: dict,
    ):
        """MMA warp: the order of the class docstring. Block j (visiting order) is use j of
        pipeline_s_i and pipeline_o_i and uses 2 j, 2 j + 1 of the K/V ring."""
        (_, _, _, n_block_min, n_block_max, _, _, _, _, _, _, _) = work
        thr_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(0)
        tSrQ = thr_qk.make_fragment_A(sQ)
        tSrK = thr_qk.make_fragment_B(sK)
        tOrV = thr_pv.make_fragment_B(sV)
        tStS, tOtO, tOrP = self.tmem_tensors(thr_qk, thr_pv, tP_layout, tmem_ptr)
        pipeline_q, pipeline_kv = pipes["q"], pipes["kv"]
        pipeline_s, pipeline_o = pipes["s"], pipes["o"]
        n_blocks = n_block_max - n_block_min
        if n_blocks > 0:
            k_state = ring_state(self.kv_stages, 0, producer=False)
            for i in cutlass.range_constexpr(self.q_tiles):
                pipeline_q.consumer_wait(ring_state(self.q_tiles, i, producer=False))
                if cutlass.const_expr(i == 0):
                    pipeline_kv.consumer_wait(k_state)
                self.issue_s(tiled_mma_qk, tStS[i], tSrQ[None, None, None, i],
                             tSrK[None, None, None, k_state.index], pipeline_s, i, 0,
                             True)  # fmt: skip
            pipeline_kv.consumer_release(k_state)
            for j in cutlass.range(1, n_blocks, unroll=1):
                v_state = ring_state(self.kv_stages, 2 * j - 1, producer=False)
                k_state = ring_state(self.kv_stages, 2 * j, producer=False)
                pipeline_kv.consumer_wait(v_state)
                for i in cutlass.range_constexpr(self.q_tiles):
                    self.issue_pv(tiled_mma_pv, tOtO[i], tOrP[i],
                                  tOrV[None, None, None, v_state.index], pipeline_s,
                                  pipeline_o, i, j)  # fmt: skip
                    if cutlass.const_expr(i == 0):
                        pipeline_kv.consumer_wait(k_state)
                    self.issue_s(tiled_mma_qk, tStS[i], tSrQ[None, None, None, i],
                                 tSrK[None, None, None, k_state.index], pipeline_s, i,
                                 j, False)  # fmt: skip
                pipeline_kv.consumer_release(v_state)
                pipeline_kv.consumer_release(k_state)
            v_state = ring_state(self.kv_stages, 2 * n_blocks - 1, producer=False)
            pipeline_kv.consumer_wait(v_state)
            for i in cutlass.range_constexpr(self.q_tiles):
                self.issue_pv(tiled_mma_pv, tOtO[i], tOrP[i],
                              tOrV[None, None, None, v_state.index], pipeline_s,
                              pipeline_o, i, n_blocks)  # fmt: skip
            pipeline_kv.consumer_release(v_state)

    @cute.jit
    def issue_s(self, tiled_mma: cute.TiledMma, tStS: cute.Tensor, tSrQ: cute.Tensor,
                tSrK: cute.Tensor, pipeline_s, i: cutlass.Constexpr[int], j: Int32,
                first: cutlass.Constexpr[bool]):  # fmt: skip
        """S_i(j) = Q_i K[j]^T: use j of pipeline_s_i (its acquire, after the first block,
        waited for P_i of block j - 1 already, in ``issue_pv``), committed as S_i full."""
        state = slot_state(self.q_tiles, i, j, producer=True)
        if cutlass.const_expr(first):
            pipeline_s.producer_acquire(state)
        self.gemm(0, tStS, tSrQ, tSrK, False)
        pipeline_s.producer_commit(state)

    @cute.jit
    def issue_pv(self, tiled_mma: cute.TiledMma, tOtO: cute.Tensor, tOrP: cute.Tensor,
                 tOrV: cute.Tensor, pipeline_s, pipeline_o, i: cutlass.Constexpr[int],
                 j: Int32):  # fmt: skip
        """O_i (+)= P_i(j - 1) V[j - 1]: waits for P_i(j - 1) (pipeline_s_i, use j) and for the
        correction to be done with O_i (pipeline_o_i, use j - 1), then commits O_i full."""
        pipeline_s.producer_acquire(slot_state(self.q_tiles, i, j, producer=True))
        o_state = slot_state(self.q_tiles, i, j - 1, producer=True)
        pipeline_o.producer_acquire(o_state)
        self.gemm(1, tOtO, tOrP, tOrV, j > 1)
        pipeline_o.producer_commit(o_state)

    @cute.jit
    def gemm(
        self,
        which: cutlass.Constexpr[int],
        acc: cute.Tensor,
        tA: cute.Tensor,
        tB: cute.Tensor,
        accumulate,
    ):
        """acc (+)= A B over the K phases of one tile (``which``: 0 S = Q K^T, 1 O += P V);
        ``accumulate`` False overwrites acc. The TiledMma is built here, fresh: one whose
        ACCUMULATE field was set inside a staged loop or branch cannot be used outside it."""
        tiled_mma = self.make_tiled_mmas()[which]
        k_phases = cute.size(tA, mode=[2])
        if cutlass.const_expr(which == 0 and self.tile_hdim > 128):
            # A runtime loop over the K phases after the first: each phase's smem descriptors
            # come from the tile's base at issue, instead of d / 16 loop-invariant descriptors
            # per Q tile that ptxas hoists out of the key loop (beyond d 128 they went to local
            # memory in the 48-register MMA warp).
            tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
            cute.gemm(tiled_mma, acc, tA[None, None, 0], tB[None, None, 0], acc)
            rest = self.make_tiled_mmas()[which]
            rest.set(tcgen05.Field.ACCUMULATE, True)
            for k in cutlass.range(1, k_phases, unroll=1):
                cute.gemm(rest, acc, tA[None, None, k], tB[None, None, k], acc)
        else:
            for k in cutlass.range_constexpr(k_phases):
                if cutlass.const_expr(k == 0):
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
                else:
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, k], acc)

    def tmem_tensors(self, thr_qk, thr_pv, tP_layout, tmem_ptr: cute.Pointer):
        """([S_i], [O_i], [P_i]) views of the TMEM plan: fp32 S and O accumulators, and P_i
        as the 16-bit A operand of O_i += P_i V."""
        s_layout = thr_qk.make_fragment_C(
            thr_qk.partition_shape_C((self.mma_m, self.tile_n))).layout  # fmt: skip
        o_layout = thr_pv.make_fragment_C(
            thr_pv.partition_shape_C((self.mma_m, self.tile_hdimv))).layout  # fmt: skip
        tP = thr_pv.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))
        tP = tP[None, None, None, 0]
        tStS = [cute.make_tensor(tmem_ptr + self.tmem_s[i], s_layout)
                for i in range(self.q_tiles)]  # fmt: skip
        tOtO = [cute.make_tensor(tmem_ptr + self.tmem_o[i], o_layout)
                for i in range(self.q_tiles)]  # fmt: skip
        tOrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_p[i], dtype=self.dtype),
                                 tP.layout)
                for i in range(self.q_tiles)]  # fmt: skip
        return tStS, tOtO, tOrP

    @cute.jit
    def softmax(
        self,
        stage: Int32,
        work: tuple,
        tiled_mma_qk: cute.TiledMma,
        tmem_ptr: cute.Pointer,
        sStats: cute.Tensor,
        scales: ScoreScales,
        window_left: Int32,
        window_right: Int32,
        pipes: dict,
        tidx: Int32,
    ):
        """Softmax warpgroup of Q tile ``stage`` (0 or 1, a runtime value: both warpgroups run
        this one code path); thread ``tidx`` owns row ``tidx`` of the tile."""
        (m_block, seqlen_q, seqlen_k, n_block_min, n_block_max, n_block_no_right,
         n_block_no_left, _, _, _, _, _) = work  # fmt: skip
        thr_qk = tiled_mma_qk.get_slice(0)
        s_layout = thr_qk.make_fragment_C(
            thr_qk.partition_shape_C((self.tile_q, self.tile_n))).layout  # fmt: skip
        # S_i and P_i: the plan's columns for tile i are the tile's index times tile_n.
        assert self.tmem_s == [i * self.tile_n for i in range(self.q_tiles)]
        assert self.tmem_p == self.tmem_s
        tStS = cute.make_tensor(tmem_ptr + stage * self.tile_n, s_layout)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((self.tile_q, self.tile_n)))
        # S: the whole row, tile_n fp32, by 32x32b loads (lane = row).
        load_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tStS,
        )
        thr_load_s = load_s.get_slice(tidx)
        tStS_t = thr_load_s.partition_S(tStS)
        tScS_t = thr_load_s.partition_D(tScS)
        # P: tile_n 16-bit values a row, written as tile_n / 2 fp32 words over S's columns.
        p_cols = self.tile_n * self.dtype.width // 32
        p_view = cute.make_layout((self.tile_q, p_cols))
        tStP = cute.make_tensor(tmem_ptr + stage * self.tile_n,
                                cute.composition(tStS.layout, p_view))  # fmt: skip
        tScP = cute.composition(tScS, p_view)
        store_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tStP,
        )
        thr_store_p = store_p.get_slice(tidx)
        tStP_t = thr_store_p.partition_D(tStP)
        tSrP_shape = thr_store_p.partition_S(tScP).shape

        row_start = self.q_row0(m_block, stage, self.pair_rank())
        row_max = -Float32.inf
        row_sum = Float32(0.0)
        n_blocks = n_block_max - n_block_min
        # Visiting order j = 0, 1, ...: key block n_block_max - 1 - j. Blocks [0, n_masked)
        # may cut the seqlen_k tail or the causal / right window edge, [n_masked, n_left) are
        # whole, [n_left, n_blocks) may cut the left window edge (local only; none otherwise).
        n_masked = n_block_max - cutlass.max(n_block_no_right, n_block_min)
        first_unmasked = cutlass.max(n_masked, 1)
        n_left = n_blocks
        if cutlass.const_expr(self.local):
            n_left = cutlass.max(n_block_max - cutlass.max(n_block_no_left, n_block_min),
                                 first_unmasked)  # fmt: skip
        step = (tStS_t, tScS_t, load_s, store_p, tStP_t, tSrP_shape, pipes["s"],
                pipes["stats"], sStats, stage, tidx, row_start, seqlen_q, seqlen_k,
                window_left, window_right, scales)  # fmt: skip
        if n_blocks > 0:
            # Masked blocks first (the first one visited always: it may cut the seqlen_k tail
            # or the causal diagonal), then the unmasked ones, then (local) the ones that may
            # cut the left window edge.
            if cutlass.const_expr(self.local):
                # One loop, the step chosen per block (three loops kept more values live and
                # spilled the row max at d 128).
                for j in cutlass.range(n_blocks, unroll=1):
                    if j < first_unmasked or j >= n_left:
                        row_max, row_sum = self.softmax_step(step, j, n_block_max - 1 - j,
                                                             row_max, row_sum, True)  # fmt: skip
                    else:
                        row_max, row_sum = self.softmax_step(step, j, n_block_max - 1 - j,
                                                             row_max, row_sum, False)  # fmt: skip
            else:
                for j in cutlass.range(first_unmasked, unroll=1):
                    row_max, row_sum = self.softmax_step(step, j, n_block_max - 1 - j, row_max,
                                                         row_sum, True)  # fmt: skip
                for j in cutlass.range(first_unmasked, n_blocks, unroll=1):
                    row_max, row_sum = self.softmax_step(step, j, n_block_max - 1 - j, row_max,
                                                         row_sum, False)  # fmt: skip
            # Final statistics for the correction warps (use n_blocks - 1 of pipeline_stats).
            stats_state = slot_state(self.q_tiles, stage, n_blocks - 1, producer=True)
            pipes["stats"].producer_acquire(stats_state)
            sStats[tidx, 0, stage] = row_sum
            sStats[tidx, 1, stage] = row_max
            pipes["stats"].producer_commit(stats_state)

    @cute.jit
    def softmax_step(
        self,
        step: tuple,
        j: Int32,
        n_block: Int32,
        row_max: Float32,
        row_sum: Float32,
        masked: cutlass.Constexpr[bool],
    ):
        """Block ``j`` (visiting order; key block ``n_block``) of one row: S -> P in TMEM
        (use j of slot ``stage`` of pipeline_s; the rescale factor of blocks after the first is
        use j - 1 of pipeline_stats). Returns the new (row_max, row_sum). No special first
        block: a row max of -inf moves to any finite one with a factor of 2^-inf = 0."""
        (tStS_t, tScS_t, load_s, store_p, tStP_t, tSrP_shape, pipeline_s, pipeline_stats,
         sStats, stage, tidx, row_start, seqlen_q, seqlen_k, window_left, window_right,
         scales) = step  # fmt: skip
        score_scale, scale_log2 = scales
        s_state = slot_state(self.q_tiles, stage, j, producer=False)
        tSrS = cute.make_rmem_tensor(tScS_t.shape, Float32)
        pipeline_s.consumer_wait(s_state)
        cute.copy(load_s, tStS_t, tSrS)
        if cutlass.const_expr(self.has_softcap):  # before the mask: -inf stays -inf
            softcap_scores(tSrS, score_scale)
        if cutlass.const_expr(masked):
            apply_mask(row_view(tSrS), row_view(tScS_t), row_start, n_block * self.tile_n,
                       seqlen_q, seqlen_k, window_left, window_right, self.causal,
                       self.local, self.packed_heads)  # fmt: skip
        m_cur = tSrS.load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
        m_new, m_scaled, factor = update_max(
            row_max, m_cur, scale_log2, False, masked, self.rescale_threshold
        )
        if j > 0:
            stats_state = slot_state(self.q_tiles, stage, j - 1, producer=True)
            pipeline_stats.producer_acquire(stats_state)
            sStats[tidx, 0, stage] = factor
            pipeline_stats.producer_commit(stats_state)
        poly = 0 if cutlass.const_expr(masked) else self.exp2_poly_every
        block_sum = exp2_row(tSrS, scale_log2, m_scaled, poly)
        tSrP = cute.make_rmem_tensor(tSrP_shape, Float32)
        tSrP_16 = cute.make_tensor(cute.recast_ptr(tSrP.iterator, dtype=self.dtype),
                                   tSrS.layout)  # fmt: skip
        tSrP_16.store(tSrS.load().to(self.dtype))
        cute.copy(store_p, tSrP, tStP_t)
        cute.arch.fence_view_async_tmem_store()
        pipeline_s.consumer_release(s_state)
        return m_new, row_sum * factor + block_sum

    @cute.jit
    def correction(
        self,
        work: tuple,
        tiled_mma_pv: cute.TiledMma,
        tmem_ptr: cute.Pointer,
        sStats: cute.Tensor,
        sO: cute.Tensor,
        scale_log2: Float32,
        pipes: dict,
        tidx: Int32,
    ):
        """Correction warpgroup: O rescales per block, then O / l -> smem and LSE. Block j >= 1
        of tile i takes use j - 1 of pipeline_stats_i and of pipeline_o_i; the final step
        use n_blocks - 1 of both."""
        (m_block, seqlen_q, _, n_block_min, n_block_max, _, _, _, _, _, _, mLSE_cur) = work
        thr_pv = tiled_mma_pv.get_slice(0)
        o_layout = thr_pv.make_fragment_C(
            thr_pv.partition_shape_C((self.tile_q, self.tile_hdimv))).layout  # fmt: skip
        chunk = cute.make_layout((self.tile_q, O_CHUNK))
        atom_ld = cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32
        )
        atom_st = cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32
        )
        tOtO = [cute.make_tensor(tmem_ptr + self.tmem_o[i], o_layout)
                for i in range(self.q_tiles)]  # fmt: skip
        tOtO_c = [cute.logical_divide(t, chunk) for t in tOtO]
        tOsO_c = [cute.logical_divide(thr_pv.partition_C(sO[None, None, i]), chunk)
                  for i in range(self.q_tiles)]  # fmt: skip
        load_o = tcgen05.make_tmem_copy(atom_ld, tOtO_c[0][(None, None), 0])
        store_o = tcgen05.make_tmem_copy(atom_st, tOtO_c[0][(None, None), 0])
        thr_load_o = load_o.get_slice(tidx)
        thr_store_o = store_o.get_slice(tidx)
        n_chunks = self.tile_hdimv // O_CHUNK
        tOrO = cute.make_rmem_tensor(
            thr_load_o.partition_D(tOtO_c[0][(None, None), 0]).shape, Float32
        )
        tOrO_16 = cute.make_rmem_tensor(tOrO.shape, self.dtype)
        pipeline_o, pipeline_stats, pipeline_epi = pipes["o"], pipes["stats"], pipes["epi"]
        n_blocks = n_block_max - n_block_min
        for j in cutlass.range(1, n_blocks, unroll=1):
            for i in cutlass.range_constexpr(self.q_tiles):
                state = slot_state(self.q_tiles, i, j - 1, producer=False)
                pipeline_stats.consumer_wait(state)
                factor = sStats[tidx, 0, i]
                pipeline_stats.consumer_release(state)
                pipeline_o.consumer_wait(state)
                if cute.arch.vote_any_sync(factor != Float32(1.0)):
                    for c in cutlass.range_constexpr(n_chunks):
                        cute.copy(load_o, thr_load_o.partition_S(tOtO_c[i][(None, None), c]),
                                  tOrO)  # fmt: skip
                        self.scale_row(tOrO, factor)
                        cute.copy(store_o, tOrO,
                                  thr_store_o.partition_D(tOtO_c[i][(None, None), c]))  # fmt: skip
                    cute.arch.fence_view_async_tmem_store()
                pipeline_o.consumer_release(state)
        for i in cutlass.range_constexpr(self.q_tiles):
            state = slot_state(self.q_tiles, i, n_blocks - 1, producer=False)
            row = self.q_row0(m_block, i, self.pair_rank()) + tidx
            inv = Float32(0.0)
            lse = -Float32.inf
            if n_blocks > 0:
                pipeline_stats.consumer_wait(state)
                inv, lse = finalize_row(sStats[tidx, 1, i], sStats[tidx, 0, i], scale_log2)
                pipeline_stats.consumer_release(state)
                pipeline_o.consumer_wait(state)
            pipeline_epi.producer_acquire(ring_state(self.q_tiles, i, producer=True))
            for c in cutlass.range_constexpr(n_chunks):
                if n_blocks > 0:
                    cute.copy(load_o, thr_load_o.partition_S(tOtO_c[i][(None, None), c]), tOrO)
                else:
                    tOrO.fill(0.0)
                self.scale_row(tOrO, inv)
                tOrO_16.store(tOrO.load().to(self.dtype))
                cute.autovec_copy(tOrO_16, thr_load_o.partition_D(tOsO_c[i][(None, None), c]))
            if n_blocks > 0:
                cute.arch.fence_view_async_tmem_load()
                if cutlass.const_expr(self.ctas == 1):
                    # (No MMA waits for this release; the pair leaves it out: it would arrive
                    # on the even CTA's barrier, with no one there to wait for it.)
                    pipeline_o.consumer_release(state)
            if row < seqlen_q * self.packed_heads:  # packed GQA: rows of G heads
                mLSE_cur[row] = lse
            pipeline_epi.producer_commit(ring_state(self.q_tiles, i, producer=True))

    @cute.jit
    def scale_row(self, t: cute.Tensor, factor: Float32):
        """t *= factor, two elements per FMUL2."""
        for k in cutlass.range_constexpr(0, cute.size(t), 2):
            t[k], t[k + 1] = cute.arch.mul_packed_f32x2((t[k], t[k + 1]), (factor, factor))

    @cute.jit
    def epilogue(self, work: tuple, sO: cute.Tensor, pipes: dict):
        """Epilogue warp: each finished O tile from smem to global, EPI_ROWS rows a pass, rows
        past seqlen_q not written."""
        (m_block, seqlen_q, _, _, _, _, _, _, _, _, mO_cur, _) = work
        lane = cute.arch.lane_idx()
        copy_r2g = row_store_copy(self.dtype, WARP, self.tile_hdimv)
        pipeline_epi = pipes["epi"]
        gO = cute.local_tile(mO_cur, (EPI_ROWS, self.tile_hdimv), (None, 0))
        for i in cutlass.range_constexpr(self.q_tiles):
            state = ring_state(self.q_tiles, i, producer=False)
            pipeline_epi.consumer_wait(state)
            row0 = self.q_row0(m_block, i, self.pair_rank())
            sO_i = cute.flat_divide(sO[None, None, i], (EPI_ROWS, self.tile_hdimv))
            for r in cutlass.range(self.tile_q // EPI_ROWS, unroll=1):
                rows_left = seqlen_q * self.packed_heads - row0 - r * EPI_ROWS
                if rows_left > 0:
                    store_rows(sO_i[None, None, r, 0], gO[None, None, row0 // EPI_ROWS + r],
                               rows_left, copy_r2g, lane)  # fmt: skip
            pipeline_epi.consumer_release(state)
