"""sm90 forward kernel: FlashAttention-3 design on TMA, WGMMA and warp-specialized warpgroups."""

from __future__ import annotations

import enum
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils.layout import LayoutEnum

from cute_fa.config import FwdConfig
from cute_fa.dsl.copy import (
    acc_to_smem,
    row_store_copy,
    store_rows,
    tma_views,
    transposed,
    zero_rows_from,
)
from cute_fa.dsl.kernel import AttentionKernel
from cute_fa.dsl.mask import BlockRange, Window, apply_mask, block_range, split_block_range
from cute_fa.dsl.pack_gqa import packed_row_views
from cute_fa.dsl.scheduler import TileScheduler, for_each_tile, unit_count
from cute_fa.dsl.seqlen import seqlen_info
from cute_fa.dsl.softmax import (
    OnlineSoftmax,
    ScoreScales,
    mn_view_wgmma,
    score_scales,
    softcap_scores,
)

from .fragments import (
    acc_as_rs_operand,
    convert_in_chunks,
    gemm_over_k,
)
from .support import (
    SM90_FWD_REGS,
    SM90_FWD_WG_M,
    fwd_can_implement,
    fwd_kv_stages,
    fwd_num_consumers,
    fwd_page_box,
    fwd_q_stages,
)
from .sync import tma_pipeline

WARPGROUP = 128  # threads


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads); consumer c uses EPILOGUE_WG1 + c and
    SCHEDULER_WG1 + c (c < 3; with two consumers the WG3 ids are unused)."""

    EPILOGUE_WG1 = 1  # 128 threads: consumer 0 staged its O tile in smem
    EPILOGUE_WG2 = 2  # 128 threads: consumer 1 staged its O tile in smem
    EPILOGUE_WG3 = 3  # 128 threads: consumer 2 staged its O tile in smem
    SCHEDULER_WG1 = 4  # 256 threads: consumer 0 may issue its GEMMs (pingpong)
    SCHEDULER_WG2 = 5  # 256 threads: consumer 1 may issue its GEMMs
    SCHEDULER_WG3 = 6  # 256 threads: consumer 2 may issue its GEMMs


class GlobalTensors(NamedTuple):
    """The kernel's global tensors: TMA coordinate views of Q, K, V^T (and O with tma_store),
    the protocol's Q and K (their shapes), O and LSE, and the varlen / seqused vectors."""

    mQ_tma: cute.Tensor
    mK_tma: cute.Tensor
    mV_tma: cute.Tensor
    mQ: cute.Tensor
    mK: cute.Tensor
    mO: cute.Tensor
    mLSE: cute.Tensor
    mO_tma: cute.Tensor | None
    cu_seqlens_q: cute.Tensor | None
    cu_seqlens_k: cute.Tensor | None
    seqused_q: cute.Tensor | None
    seqused_k: cute.Tensor | None
    page_table: cute.Tensor | None


class SmemTiles(NamedTuple):
    """The Q stages (O staged in them), the K and the V^T rings."""

    sQ: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor


class Pipelines(NamedTuple):
    """pipeline_q, pipeline_k, pipeline_v (class docstring: Pipelines)."""

    q: pipeline.PipelineTmaAsync
    k: pipeline.PipelineTmaAsync
    v: pipeline.PipelineTmaAsync


class TmaLoads(NamedTuple):
    """The producer's TMA load atoms."""

    q: cute.CopyAtom
    k: cute.CopyAtom
    v: cute.CopyAtom


class ProducerStates(NamedTuple):
    """The producer warp's pipeline states (K and V stages advance together)."""

    q: pipeline.PipelineState
    kv: pipeline.PipelineState


class ConsumerStates(NamedTuple):
    """A consumer's pipeline states (V is released one step after K)."""

    q: pipeline.PipelineState
    k: pipeline.PipelineState
    v: pipeline.PipelineState


class ConsumerOps(NamedTuple):
    """What every consumer issues with: the two tiled MMAs, the 16-byte O store and (with
    tma_store) the TMA store atom of O."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    copy_r2g: cute.TiledCopy
    tma_o: cute.CopyAtom | None


class TileViews(NamedTuple):
    """One tile's (head, batch) slices, shifted to the sequence start for varlen: TMA
    coordinates of Q (seqlen, d), K (seqlen, d), V^T (dv, seqlen) and O (tma_store, else None),
    and O (seqlen, dv), LSE (seqlen,)."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mO: cute.Tensor
    mLSE: cute.Tensor
    mO_tma: cute.Tensor | None
    pages: cute.Tensor | None  # paged K/V: this sequence's row of the page table


class TileWork(NamedTuple):
    """One tile: its query block, its sequence's lengths, its views and its key blocks."""

    m_block: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    views: TileViews
    blocks: BlockRange


class ConsumerMma(NamedTuple):
    """A consumer's MMA state for one tile: the S = Q K^T thread slice, the operand fragments,
    O, P (16-bit), the identity of S, and (defer_rescale, else None) S / P in fp32 and the O
    rescale factors kept across steps."""

    thr_qk: cute.ThrMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrV: cute.Tensor
    acc_O: cute.Tensor
    rP: cute.Tensor
    tScS: cute.Tensor
    acc_S: cute.Tensor | None
    corr: cute.Tensor | None


class ScoreRows(NamedTuple):
    """What softcap and the mask of a consumer's scores need: the softcap scale, its first
    query row and its sequence's lengths, and the window."""

    score_scale: Float32
    row_start: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    window: Window


class FlashAttentionForwardSm90(AttentionKernel):
    """Exact attention forward, FA3 design (sm90a only).

    Planning routes an sm90 device here for what ``can_implement`` accepts (the rest runs the
    sm80 kernel; the setting ``CUTE_FA_FWD_ARCH=80`` forces that family). Checked on an sm90 GPU by
    tests/test_fwd_gpu.py and compute-sanitizer memcheck/racecheck; SASS facts on the CPU by
    tests/test_compile_sm90.py. Measurements of every tuning choice: docs/performance.md and
    hopper/support.py.

    Scope so far: bf16 or fp16; (head_dim, head_dim_v) in (64, 64), (96, 96), (128, 128),
    (192, 192), (192, 128), (128, 64), (256, 256); dense or varlen (cu_seqlens_q /
    cu_seqlens_k, each on its own, seqused_q / seqused_k); no mask, causal or sliding window
    (local); softcap or not; GQA/MQA (K/V head = head // (heads / kv heads));
    ``hopper/support.py`` rejects everything else with its reason.
    Tile: tile_m = 64 * num_consumers query rows, one 64-row slice per consumer warpgroup:
    192 (three consumers) for d 64 without a window or softcap, causal only from 4096 query
    rows (measured faster, ``support.SM90_FWD_3WG_DEFAULT``), 128 (two) otherwise;
    the tuning field ``tile_m`` picks 128 or 192 where it fits (``support.fwd_tile_ms``: what
    fits 160 registers a consumer thread; d 128 with 64 or 80 keys, field ``tile_n``).
    tile_n by default from ``support.SM90_FWD_TILE_N`` (128 for d <= 128, 112 for d 192, 64 for
    d 256: what fits Q plus two K/V stages in 227 KiB; the reasons are there).

    Grid and work split
      A tile is tile_m (128 or 192) query rows of one (head, batch); its CTA visits the tile's
      key blocks from the last to the first (the one that cuts the seqlen tail or the causal
      diagonal comes first).
      One CTA a tile (tuning.num_ctas == 0): grid = (ceil(max_seqlen_q / tile_m), num_heads,
      batch) (varlen q: batch = len(cu_seqlens_q) - 1). Causal grids run query blocks in
      reverse (longest rows first).
      Persistent (tuning.num_ctas = the device's SMs; planning picks it for dense calls without
      a window or seqused at d <= 128 up to 2k query rows, causal 8k (d 64: 128 rows below
      4k, 192 rows from 4k), and at d 192 / 256 for causal calls of 1k-8k rows,
      ``support.fwd_tuned``):
      grid = min(units, num_ctas) CTAs, CTA b takes work units b, b + grid, ... (a unit is a
      tile, query block fastest; causal: a pair of tiles of one head, query blocks n - 1 - j
      then j; cute_fa/dsl/scheduler.py, Note [persistent tiles]). Every tile of a persistent
      grid loads its Q stage, one that sees no key (causal, seqlen_q > seqlen_k) too. The
      producer and each consumer run the same tile loop (one ``TileScheduler``, created before
      the roles split, walked by ``for_each_tile``); pipeline states and the pingpong
      turns carry over from tile to tile, so the producer loads the next tile's Q, K and V
      while the consumers finish this one.
    Warp roles (1 + num_consumers warpgroups: 384 threads launched at <= 168 registers a
    thread with two consumers, 512 threads at <= 128 with three; ``support.SM90_FWD_REGS``)
      warpgroup 0: producer. Warp 0 issues every TMA load (Q once, then K[n] and V[n] of each
        key block); warps 1-3 idle. setmaxnreg.dec to 24 registers.
      warpgroups 1 .. num_consumers: consumers 0 .. num_consumers - 1. Consumer c owns query
        rows [64 c, 64 c + 64) of the tile. setmaxnreg.inc to 240 registers with two
        consumers (24 * 128 + 240 * 256 <= 65536), 160 with three (24 * 128 + 160 * 384).
    Consumer main loop (software-pipelined by one block, P kept in registers)
      step for the first block n_max - 1:  [turn] S = Q K^T [/turn]; wait; softcap; mask;
        softmax; P -> bf16/fp16 registers
      step for block n < n_max - 1:  [turn] S = Q K[n]^T, O += P V[n + 1] (two wgmma commit
        groups) [/turn]; wait_group 1 (S done); softcap; mask (only in the loops over blocks
        that may cut the seqlen tail, the causal diagonal or a window edge; see Masks); online
        softmax (cute_fa/dsl, base 2, scale folded in) with the O rescale factors held back;
        wait_group 0 (P V done); rescale O; P -> registers
      after the last block:  [turn] O += P V[n_min] [/turn]
      S = Q K^T is WGMMA SS (both operands in smem); O += P V is WGMMA RS (P from registers,
      the C fragment reinterpreted as the A fragment, no data movement).
      tuning.overlap = False: wait_group 0 instead of 1 after
      the issue, so the softmax of block n waits for O += P V[n + 1] too (no intra-warpgroup
      overlap). Default for d 64 causal calls of up to 1k rows on the persistent grid without
      turns (``support.SM90_FWD_OVERLAP_OFF_DEFAULT``), where a tile has so few key blocks
      that the overlap's prologue and drain outweigh it.
    Pingpong ([turn] ... [/turn]), round robin over the consumers: consumer c waits on named
      barrier SCHEDULER_WG1 + c (256 threads: its own 128, which wait, and the 128 of consumer
      c - 1 mod num_consumers, which arrive) before issuing its GEMMs, and arrives on the
      barrier of consumer c + 1 mod num_consumers once they are issued, so the other
      consumers' softmaxes overlap one consumer's GEMMs. The last consumer arrives on
      SCHEDULER_WG1 at the start: consumer 0 takes the first turn. Every consumer takes the
      same number of turns (one per visited block, plus the last P V), so the turns run 0, 1,
      (2,) 0, 1, ... and a barrier never sees a second arrival before its wait; the last
      consumer's last arrival on SCHEDULER_WG1 (and its first, when the CTA visits no block)
      is never waited for.
      tuning.pingpong = False (not with seqused_k, whose V-tail
      zeroing the turns order) drops the turns: each consumer issues as soon as its operands
      are ready. Default for d 64 causal calls on the persistent grid with two consumers
      (``support.SM90_FWD_PINGPONG_OFF_DEFAULT``), where a consumer's softmax outlasts the
      other's GEMMs and a turn mostly makes a ready consumer wait.
    Shared memory (swizzled WGMMA layouts written by TMA: 128-byte swizzle, 64-byte where the
    contiguous extent is 96 elements)
      sQ  (64, d, num_consumers * q_stages): one 64-row slice per consumer and Q stage (stage
                      s, consumer c: s * num_consumers + c); reused by that consumer for its O
                      tile (the first dv columns of it; dv <= d).
      sK  (tile_n, d, kv_stages)      K-major B operand of S = Q K^T.
      sV  (dv, tile_n, kv_stages)     V^T viewed MN-major: the B operand of O = P V.
    Pipelines (mbarriers, cutlass.pipeline.PipelineTmaAsync; producer = 1 warp whose TMA
    transaction bytes complete "full"; consumers arrive on "empty" with one thread per warp)
      pipeline_q:  producer -> every consumer, q_stages (1; 2 with a persistent grid where
                   they fit: d <= 128), 4 * num_consumers consumer-warp arrivals (8 or 12);
                   one stage a tile (num_consumers TMA boxes of 64 x d on one barrier),
                   released after the tile's epilogue, which stages O in it (a fence.proxy.async
                   orders those generic-proxy accesses before the next TMA write). With one CTA
                   a tile, a tile that visits no key block loads no Q and stages its zeros in
                   the unloaded stage; a persistent tile always loads its Q (``tile_has_q``),
                   so the stage its O takes is its own.
      pipeline_k:  producer -> every consumer, kv_stages, 4 * num_consumers arrivals;
                   K[n] is released once S = Q K[n]^T has completed.
      pipeline_v:  producer -> every consumer, kv_stages, 4 * num_consumers arrivals;
                   V[n] is released one step later, once O += P V[n] has completed.
      kv_stages = 2 (``support.fwd_kv_stages``).
    P -> 16-bit registers: converted 8 values at a time (``convert_in_chunks``), so the
      compiler emits packed pair conversions for every tile_n and ptxas keeps the P V WGMMAs
      in one batch (no C7519 serialization; tests/test_compile_sm90.py counts the fences).
    Epilogue (per consumer): O / l once, O -> 16-bit -> its slice of sQ, named barrier
      EPILOGUE_WG1 + c (128 threads), 16-byte stores of rows < seqlen_q (gcd(dv / 8, 128)
      threads a row; dv 96: 4 threads of 3 vectors); LSE from the quad leaders. Rows that see
      no key: O = 0, LSE = -inf. tuning.tma_store (dense query
      rows, dv == d; not a default): a fence.proxy.async after the smem writes, then
      thread 0 issues one TMA store of the (64, dv) box (rows past the tensor's end are
      clipped) and waits until it has read the slice (cp.async.bulk.wait_group.read 0)
      before its warp releases the Q stage.
    Out-of-range rows: TMA zero-fills rows past the tensor's sequence extent (Q, K and V);
      scores of keys past seqlen_k are masked to -inf; Q rows past seqlen_q are computed and
      never stored.
    Varlen (cute_fa/dsl/seqlen.py seqlen_info): packed tensors have a batch extent of 1. The
      TMA descriptors cover the whole packed tensor; each CTA shifts its TMA coordinate tensors
      (cute.domain_offset) to its sequence's first row, and its O and LSE views the same way.
      The last K/V block of a sequence (and the Q rows past its end) then reads the next
      sequence's rows, or zeros past the end of the tensor: those keys are masked to -inf (so
      their P is exactly 0 and their V rows, finite inputs, add nothing) and those query rows
      are never stored: O goes out with row-predicated 16-byte stores, never past seqlen_q.
      seqused_q caps seqlen_q the same way; a CTA whose first row is past seqlen_q loads and
      stores nothing. seqused_k caps seqlen_k; the rows between seqused_k and the sequence end
      are not inputs (they may hold NaN, and 0 * NaN in P V would reach O), so consumer 0
      zeroes those keys of the first visited block's V stage (``zero_v_tail``; its docstring
      has the ordering argument) before any consumer's P V GEMM reads it. Their scores are
      masked by select, so NaN in K does no harm.
    Intra-warpgroup overlap: between wgmma wait_group 1 and 0 sit the row max reductions, the
      scaling FFMAs and, as ptxas schedules them, some of the EX2; the rest run after the P V
      GEMM has completed. ptxas places the wait (WARPGROUP.DEPBAR) right after the last SHFL
      before it, and the P conversions, which write the registers the in-flight P V reads,
      need it early. tuning.defer_rescale changes the step:
      P stays fp32 in acc_S (kept across steps) and the rescale factors in ``corr``; the O
      rescale and the P conversion of block j run at the start of the next step (or of the
      last P V), before its turn; one shuffle of the row sums (``after_exponentials``) anchors
      the wait after every exponential under the DSL's CUDA 12 build (its CUDA 13 build's
      ptxas still moves the wait ahead of them; tests/test_compile_sm90.py counts the EX2 in
      the window). The wait itself stays in the step: a commit group still in flight at the
      loop's back edge makes ptxas serialize every WGMMA. Default at d 64 only
      (``support.SM90_FWD_DEFER_RESCALE_DEFAULT``).
    Exponentials on the FMA pipe (tuning.exp2_poly = k): in the
      unmasked loop every k-th exponential of a thread's row is a polynomial (Note [exp2 on the
      FMA pipe] in cute_fa/dsl/softmax.py) instead of MUFU.EX2, which at d 64 is as busy as
      the tensor cores (hopper/support.py); the unmasked loop has tile_n / 2 / k fewer
      MUFU.EX2 (the compile test counts them). Off by default.
    Rescale threshold (tuning.rescale_threshold = t): a
      row's max moves only by more than t (log2 units) and a warp skips the O rescale when none
      of its rows moved (Note [rescale threshold] in cute_fa/dsl/softmax.py). Default 8 at d 256,
      off elsewhere (``support.SM90_FWD_RESCALE_THRESHOLD_DEFAULT``).
    Masks (cute_fa/dsl/mask.py, Note [bottom-right aligned masks]; block_range per CTA of
      tile_m rows, apply_mask per consumer's 64 rows). Key blocks run in up to three loops, last to
      first: [start_unmasked, n_max) masked (seqlen_k tail, causal diagonal, right window
      edge; the first block is always here), [start_left_masked, start_unmasked) unmasked, and
      with a window [n_min, start_left_masked) masked again (left window edge). The producer
      loads exactly [n_min, n_max). An empty range (no row of the CTA sees a key) loads nothing
      and stores O = 0, LSE = -inf. Window sizes are runtime arguments (unbounded sides arrive
      as WINDOW_INF).
    Softcap (compile-time flag; the value is a runtime argument): right after S is complete,
      s -> tanh(s * softmax_scale / softcap) (MUFU.TANH), with the exponent's scale
      softcap * log2(e); both scales come from the shared ``score_scales`` (as in sm80).
    Split-KV (config.split_kv; cute_fa/ops.py Note [split-KV launches]): mO is fp32
      (num_splits * batch, seqlen, heads, dv) and mLSE (num_splits * batch, heads, seqlen),
      split slowest (packed q: batch 1), so num_splits = mO.shape[0] // mQ.shape[0]; the grid's
      z is batch * num_splits (z = batch index * num_splits + split). A tile's key blocks
      [n_min, n_max) (block_range, masks as above) are cut into num_splits ranges of
      ceil((n_max - n_min) / num_splits) blocks, the last shorter, and a split takes its range
      (empty past the end: O = 0, LSE = -inf, as any tile that sees no key). The mask loops
      work on any sub-range: a split's first block is peeled and masked, and the loops' bounds
      are clamped to the range. O, already divided by the split's own row sums, leaves from the
      accumulator registers as fp32 (8-byte pairs of columns, rows < seqlen_q), not through
      shared memory; the LSE as always. One CTA a tile (no persistent grid), no tma_store
      (hopper/support.py rejects both). The combine (ampere/flash_combine.py) merges the splits.
    Every tuning switch is a field of the compile key (FwdConfig); hopper/support.py has
      each with its measurements and defaults.
    Not yet: head_dim_v != head_dim other than 192 x 128 and 128 x 64, persistent
      scheduling of window and varlen calls (tiles of unequal cost).
    """

    arch = 90

    def __init__(self, config: FwdConfig):
        super().__init__(config)  # tile_m, tile_n, num_warps
        self.num_consumers = fwd_num_consumers(self.tile_m)
        self.wg_m = SM90_FWD_WG_M  # query rows of one consumer warpgroup
        self.num_threads = WARPGROUP * (1 + self.num_consumers)
        self.regs_producer, self.regs_consumer = SM90_FWD_REGS[self.num_consumers]
        # The tuning choices of the compile key (config.tuning), read here only.
        tuning = config.tuning
        self.kv_stages = fwd_kv_stages(config)  # two K/V stages
        self.q_stages = fwd_q_stages(config)  # 2 on a persistent grid where it fits, else 1
        self.num_ctas = tuning.num_ctas  # persistent grid; 0: one CTA a tile
        self.pingpong = tuning.pingpong  # consumers take turns issuing their GEMMs
        self.overlap = tuning.overlap  # softmax of block n while O += P V[n + 1] runs
        self.defer_rescale = bool(tuning.defer_rescale)  # O rescale, P conversion before P V
        self.exp2_poly = tuning.exp2_poly  # 0: every exponential on MUFU
        self.rescale_threshold = float(tuning.rescale_threshold)  # 0: O rescaled every block
        self.tma_store = tuning.tma_store  # O leaves by one TMA store a consumer
        self.split_kv = config.split_kv  # fp32 O and LSE of one key split (class docstring)
        # Packed GQA: query heads whose rows share a tile (1: one head a tile; class docstring)
        self.packed_heads = config.pack_gqa or 1
        # Paged K/V: keys a page, and a TMA box of keys (gcd(page_size, tile_n); class docstring)
        self.page_size = config.page_size
        self.page_box = fwd_page_box(config) if config.page_size else 0

    can_implement = staticmethod(fwd_can_implement)

    def make_tiled_mmas(self) -> tuple[cute.TiledMma, cute.TiledMma]:
        """(S = Q K^T: both operands in smem, O = P V: P from registers), one warpgroup each.

        The device code builds fresh ones in every step: a TiledMma whose ACCUMULATE field was
        set inside one staged region cannot be reused in another.
        """
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, (1, 1, 1), (self.wg_m, self.tile_n),
        )  # fmt: skip
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, (1, 1, 1), (self.wg_m, self.tile_hdimv), warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        return tiled_mma_qk, tiled_mma_pv

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
        d, dv, tile_n, wg_m = self.tile_hdim, self.tile_hdimv, self.tile_n, self.wg_m
        # Packed GQA: Q, O and LSE with (G, seqlen) rows and the K/V heads (mQ itself keeps the
        # call's shapes for the sequence lengths).
        mQ_rows, mO_rows, mLSE_rows = packed_row_views(mQ, mO, mLSE, self.packed_heads)
        mQ_t, mK_t, mVt = tma_views(mQ_rows, mK, mV)

        tiled_mma_qk, tiled_mma_pv = self.make_tiled_mmas()

        # Q stage s, consumer c: slice s * num_consumers + c.
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (wg_m, tile_n, d), self.dtype, self.num_consumers * self.q_stages
        )
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (wg_m, tile_n, d), self.dtype, self.kv_stages
        )
        sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (wg_m, dv, tile_n), self.dtype, self.kv_stages
        )
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(
            load, mQ_t, cute.slice_(sQ_layout, (None, None, 0)), (wg_m, d)
        )
        # K and V^T: one box a key block, or with paged K/V (num_pages, page_size, ...) boxes of
        # page_box keys, tile_n / page_box a block (each from its own page).
        kv_rows = self.page_box if cutlass.const_expr(self.page_size) else tile_n
        sK_box = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (wg_m, kv_rows, d), self.dtype, 1
        )
        sV_box = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (wg_m, dv, kv_rows), self.dtype, 1
        )
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(
            load, mK_t, cute.slice_(sK_box, (None, None, 0)), (kv_rows, d)
        )
        tma_v, mV_tma = cpasync.make_tiled_tma_atom(
            load, mVt, cute.slice_(sV_box, (None, None, 0)), (dv, kv_rows)
        )
        # O by TMA store (config.tuning.tma_store): from the consumer's Q slice, (wg_m, dv) boxes.
        tma_o, mO_tma = None, None
        if cutlass.const_expr(self.tma_store):
            mO_t = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
            tma_o, mO_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO_t, cute.slice_(sQ_layout, (None, None, 0)),
                (wg_m, dv),
            )  # fmt: skip
        self.tx_q = cute.size_in_bytes(self.dtype, sQ_layout) // self.q_stages
        self.tx_k = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        self.tx_v = cute.size_in_bytes(self.dtype, cute.slice_(sV_layout, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        # Global stores of O: 16 bytes a thread, one warpgroup over a (wg_m, dv) tile.
        copy_r2g = row_store_copy(self.dtype, WARPGROUP, dv)
        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)
        batch = cute.size(mQ.shape[0])
        if cutlass.const_expr(mCuSeqlensQ is not None):
            batch = cute.size(mCuSeqlensQ.shape[0]) - 1
        if cutlass.const_expr(self.split_kv):  # the split index goes with the batch index
            batch = batch * (cute.size(mO.shape[0]) // cute.size(mQ.shape[0]))
        grid = (cute.ceil_div(max_seqlen_q * self.packed_heads, self.tile_m),
                cute.size(mQ_rows.shape[2]), batch)  # fmt: skip
        if cutlass.const_expr(self.num_ctas > 0):  # dense only: max_seqlen_q is mQ's seqlen
            units = unit_count(
                max_seqlen_q, self.tile_m, cute.size(mQ.shape[2]), batch, self.causal
            )
            grid = (cutlass.min(units, self.num_ctas), 1, 1)
        self.kernel(
            mQ_tma, mK_tma, mV_tma, mQ, mK, mO_rows, mLSE_rows, tma_q, tma_k, tma_v,
            score_scale, scale_log2, window_left, window_right,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, tma_o, mO_tma,
            sQ_layout, sK_layout, sV_layout, tiled_mma_qk, tiled_mma_pv, copy_r2g,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)  # fmt: skip

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
        score_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        tma_o: cute.CopyAtom | None,
        mO_tma: cute.Tensor | None,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        copy_r2g: cute.TiledCopy,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        consumer_warps = self.num_consumers * WARPGROUP // 32
        pipes = Pipelines(
            q=tma_pipeline(storage.mbar_q, self.q_stages, self.tx_q, consumer_warps),
            k=tma_pipeline(storage.mbar_k, self.kv_stages, self.tx_k, consumer_warps),
            v=tma_pipeline(storage.mbar_v, self.kv_stages, self.tx_v, consumer_warps),
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        smem_tiles = SmemTiles(
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sK=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sV=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
        )
        gmem = GlobalTensors(mQ_tma, mK_tma, mV_tma, mQ, mK, mO, mLSE, mO_tma,
                             mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                             mPageTable)  # fmt: skip
        window = Window(window_left, window_right)
        # The tiles of this CTA (Note [persistent tiles]), walked by every role.
        scheduler = TileScheduler(mQ.shape[1], mQ.shape[2], mQ.shape[0], self.tile_m,
                                  self.causal, self.num_ctas > 0)  # fmt: skip
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if warp_idx == 0:
                for atom in (tma_q, tma_k, tma_v):
                    cpasync.prefetch_descriptor(atom)
                states = ProducerStates(
                    q=pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, self.q_stages
                    ),
                    kv=pipeline.make_pipeline_state(
                        pipeline.PipelineUserType.Producer, self.kv_stages
                    ),
                )
                tma = TmaLoads(q=tma_q, k=tma_k, v=tma_v)
                for_each_tile(scheduler, self.load_tile, states, gmem, tma, smem_tiles, pipes,
                              window)  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            consumer = wg_idx - 1
            ops = ConsumerOps(tiled_mma_qk, tiled_mma_pv, copy_r2g, tma_o)
            scales = ScoreScales(score_scale, scale_log2)
            states = ConsumerStates(
                q=pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages),
                k=pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages),
                v=pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages),
            )
            if consumer == self.num_consumers - 1:
                self.end_turn(consumer)  # the last consumer hands the first turn to consumer 0
            for_each_tile(scheduler, self.consume_tile, states, gmem, smem_tiles, pipes, ops,
                          consumer, tidx % WARPGROUP, scales, window)  # fmt: skip

    @cute.jit
    def tile_work(self, coords: tuple, gmem: GlobalTensors, window: Window) -> TileWork:
        """Where the tile of ``coords`` (m_block, head, batch; ``TileScheduler``) lies and which
        key blocks it visits."""
        mQ, mK = gmem.mQ, gmem.mK
        mCuSeqlensQ, mCuSeqlensK = gmem.cu_seqlens_q, gmem.cu_seqlens_k
        m_block, head, batch = coords
        if cutlass.const_expr(self.split_kv):
            num_splits = gmem.mO.shape[0] // mQ.shape[0]
            split = batch % num_splits
            batch = batch // num_splits
        seq = seqlen_info(batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, gmem.seqused_q, gmem.seqused_k)
        if cutlass.const_expr(self.page_size and gmem.seqused_k is None):
            # paged K/V without seqused_k: every page of the sequence's table row is full
            seq = seq._replace(seqlen_k=gmem.page_table.shape[1] * self.page_size)
        n_block_min, n_block_max, n_block_no_right, n_block_no_left = block_range(
            m_block, seq.seqlen_q, seq.seqlen_k, window.left, window.right,
            self.tile_m, self.tile_n, self.causal, self.local, self.packed_heads,
        )  # fmt: skip
        if cutlass.const_expr(mCuSeqlensQ is not None or gmem.seqused_q is not None):
            if m_block * self.tile_m >= seq.seqlen_q * self.packed_heads:
                n_block_max = n_block_min  # no row of this CTA exists: load and store nothing
        if cutlass.const_expr(self.split_kv):
            # This split's share of the key blocks: ceil(n / num_splits) of them, the last split
            # fewer; a split past the end visits none (it writes O = 0, LSE = -inf).
            n_block_min, n_block_max = split_block_range(n_block_min, n_block_max, split,
                                                         num_splits)  # fmt: skip
        # This (batch, head)'s slices. Varlen tensors have a batch extent of 1 and each sequence
        # starts at its cu_seqlens offset: the TMA coordinate tensors are shifted there, so the
        # TMA boxes of one sequence start at its first row (rows past its end read the next
        # sequence, or zeros past the tensor; Note in the class docstring).
        head_kv = head  # packed GQA: the grid's heads are the K/V heads
        if cutlass.const_expr(self.packed_heads == 1):
            head_kv = head // (mQ.shape[2] // mK.shape[2])
        qb = 0 if cutlass.const_expr(mCuSeqlensQ is not None) else batch
        kb = 0 if cutlass.const_expr(mCuSeqlensK is not None) else batch
        mQ_cur = gmem.mQ_tma[None, None, head, qb]
        ob = qb  # split-KV: O and LSE are (num_splits * batch, ...), split slowest
        if cutlass.const_expr(self.split_kv):
            ob = split * mQ.shape[0] + qb
        mO_cur = gmem.mO[ob, None, head, None]
        mLSE_cur = gmem.mLSE[ob, head, None]
        pages = None
        if cutlass.const_expr(self.page_size):  # (page_size, d / dv, num_pages) views
            mK_cur = gmem.mK_tma[None, None, head_kv, None]
            mV_cur = gmem.mV_tma[None, None, head_kv, None]
            pages = gmem.page_table[batch, None]
        else:
            mK_cur = gmem.mK_tma[None, None, head_kv, kb]
            mV_cur = gmem.mV_tma[None, None, head_kv, kb]
        if cutlass.const_expr(mCuSeqlensQ is not None):
            row_offset = seq.offset_q * self.packed_heads  # packed: (head 0, position offset_q)
            mQ_cur = cute.domain_offset((row_offset, 0), mQ_cur)
            mO_cur = cute.domain_offset((row_offset, 0), mO_cur)
            mLSE_cur = cute.domain_offset((row_offset,), mLSE_cur)
        if cutlass.const_expr(mCuSeqlensK is not None):
            mK_cur = cute.domain_offset((seq.offset_k, 0), mK_cur)
            mV_cur = cute.domain_offset((0, seq.offset_k), mV_cur)
        mO_tma_cur = None  # dense only (config.tuning.tma_store): no sequence offsets
        if cutlass.const_expr(self.tma_store):
            mO_tma_cur = gmem.mO_tma[None, None, head, batch]
        return TileWork(
            m_block=m_block,
            seqlen_q=seq.seqlen_q,
            seqlen_k=seq.seqlen_k,
            views=TileViews(mQ_cur, mK_cur, mV_cur, mO_cur, mLSE_cur, mO_tma_cur, pages),
            blocks=BlockRange(n_block_min, n_block_max, n_block_no_right, n_block_no_left),
        )

    @cute.jit
    def load_tile(
        self,
        coords: tuple,
        states: ProducerStates,
        gmem: GlobalTensors,
        tma: TmaLoads,
        smem_tiles: SmemTiles,
        pipes: Pipelines,
        window: Window,
    ) -> ProducerStates:
        """Producer warp, one tile (``for_each_tile``'s body): its Q, K and V loads; returns
        the advanced states."""
        work = self.tile_work(coords, gmem, window)
        return self.load(work, tma, smem_tiles, pipes, states)

    @cute.jit
    def consume_tile(
        self,
        coords: tuple,
        states: ConsumerStates,
        gmem: GlobalTensors,
        smem_tiles: SmemTiles,
        pipes: Pipelines,
        ops: ConsumerOps,
        consumer: Int32,
        tidx: Int32,
        scales: ScoreScales,
        window: Window,
    ) -> ConsumerStates:
        """Consumer warpgroup, one tile (``for_each_tile``'s body); returns the advanced
        states."""
        work = self.tile_work(coords, gmem, window)
        return self.consume(work, smem_tiles, pipes, states, ops, consumer, tidx, scales, window)

    @cute.jit
    def load(
        self,
        work: TileWork,
        tma: TmaLoads,
        smem_tiles: SmemTiles,
        pipes: Pipelines,
        states: ProducerStates,
    ) -> ProducerStates:
        """Producer warp, one tile: Q into the next Q stage, then K[n] and V[n] for n from
        n_max - 1 down; nothing when the tile visits no key block. Returns the advanced states.

        ``work.views``: (seqlen, d) TMA coordinate tensors of Q and K and (dv, seqlen) of V^T
        of this (head, batch), already shifted to the sequence start for varlen.
        """
        d, dv, tile_n, wg_m = self.tile_hdim, self.tile_hdimv, self.tile_n, self.wg_m
        sQ, sK, sV = smem_tiles
        q_state, kv_state = states
        m_block = work.m_block
        n_block_min, n_block_max = work.blocks.n_min, work.blocks.n_max
        gQ = cute.local_tile(work.views.mQ, (wg_m, d), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma.q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        if cutlass.const_expr(self.page_size):
            # (box, d, page_size / box, 1, num_pages) and (dv, box, 1, page_size / box,
            # num_pages) in global memory; (box, d, boxes, 1, stages) and (dv, box, 1, boxes,
            # stages) in shared memory (load_kv_paged)
            box = self.page_box
            gK = cute.flat_divide(work.views.mK, (box, d))
            gV = cute.flat_divide(work.views.mV, (dv, box))
            sK = cute.flat_divide(sK, (box, d))
            sV = cute.flat_divide(sV, (dv, box))
        else:
            gK = cute.local_tile(work.views.mK, (tile_n, d), (None, 0))
            gV = cute.local_tile(work.views.mV, (dv, tile_n), (0, None))
        tKsK, tKgK = cpasync.tma_partition(
            tma.k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma.v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        if self.tile_has_q(n_block_min, n_block_max):
            pipes.q.producer_acquire(q_state)
            for c in cutlass.range_constexpr(self.num_consumers):
                cute.copy(tma.q, tQgQ[None, m_block * self.num_consumers + c],
                          tQsQ[None, q_state.index * self.num_consumers + c],
                          tma_bar_ptr=pipes.q.producer_get_barrier(q_state))  # fmt: skip
            q_state.advance()
            for i in cutlass.range(n_block_max - n_block_min, unroll=1):
                n_block = n_block_max - 1 - i
                if cutlass.const_expr(self.page_size):
                    self.load_kv_paged(work, n_block, tma, pipes, kv_state, tKsK, tKgK, tVsV,
                                       tVgV)  # fmt: skip
                else:
                    pipes.k.producer_acquire(kv_state)
                    cute.copy(tma.k, tKgK[None, n_block], tKsK[None, kv_state.index],
                              tma_bar_ptr=pipes.k.producer_get_barrier(kv_state))  # fmt: skip
                    pipes.v.producer_acquire(kv_state)
                    cute.copy(tma.v, tVgV[None, n_block], tVsV[None, kv_state.index],
                              tma_bar_ptr=pipes.v.producer_get_barrier(kv_state))  # fmt: skip
                kv_state.advance()
        return ProducerStates(q_state, kv_state)

    @cute.jit
    def load_kv_paged(
        self,
        work: TileWork,
        n_block: Int32,
        tma: TmaLoads,
        pipes: Pipelines,
        kv_state: pipeline.PipelineState,
        tKsK: cute.Tensor,
        tKgK: cute.Tensor,
        tVsV: cute.Tensor,
        tVgV: cute.Tensor,
    ):
        """Paged K/V, key block ``n_block``: tile_n / page_box TMA boxes of page_box keys each
        for K and for V, box i from page ``pages[(n_block * tile_n + i * page_box) //
        page_size]`` at row ``(n_block * tile_n + i * page_box) % page_size``, all on the
        stage's one barrier (the same transaction bytes as one whole block). Lane i of the
        producer warp reads the page of box i before the stage wait and the box loops take the
        pages by shuffle (one page-table latency a block; the producer runs on 24 registers,
        so no per-box arrays). A box past the sequence's last page (the tail block) reads the
        last page again instead of the page table past its end: those keys are masked and,
        with seqused_k, their V rows zeroed (``zero_v_tail``)."""
        tile_n, box, page_size = self.tile_n, self.page_box, self.page_size
        boxes = tile_n // box
        last_slot = cute.ceil_div(work.seqlen_k, page_size) - 1
        lane = cute.arch.lane_idx()
        my_page = Int32(0)
        if lane < boxes:
            my_key = n_block * tile_n + lane * box
            my_page = work.views.pages[cutlass.min(my_key // page_size, last_slot)]
        pipes.k.producer_acquire(kv_state)
        for i in cutlass.range(boxes, unroll=1):
            key = n_block * tile_n + i * box
            page = cute.arch.shuffle_sync(my_page, i)
            cute.copy(tma.k, tKgK[None, (key % page_size) // box, 0, page],
                      tKsK[None, i, 0, kv_state.index],
                      tma_bar_ptr=pipes.k.producer_get_barrier(kv_state))  # fmt: skip
        pipes.v.producer_acquire(kv_state)
        for i in cutlass.range(boxes, unroll=1):
            key = n_block * tile_n + i * box
            page = cute.arch.shuffle_sync(my_page, i)
            cute.copy(tma.v, tVgV[None, 0, (key % page_size) // box, page],
                      tVsV[None, 0, i, kv_state.index],
                      tma_bar_ptr=pipes.v.producer_get_barrier(kv_state))  # fmt: skip

    @cute.jit
    def consume(
        self,
        work: TileWork,
        smem_tiles: SmemTiles,
        pipes: Pipelines,
        states: ConsumerStates,
        ops: ConsumerOps,
        consumer: Int32,
        tidx: Int32,
        scales: ScoreScales,
        window: Window,
    ) -> ConsumerStates:
        """Consumer warpgroup, one tile: its 64 query rows against every visited key block,
        then store; returns the advanced states. ``work.views.mO_tma``: this (head, batch)'s
        TMA coordinates of O with tuning.tma_store, else None."""
        wg_m, tile_n, dv = self.wg_m, self.tile_n, self.tile_hdimv
        sQ, sK, sV = smem_tiles
        q_state, k_state, v_state = states
        m_block, seqlen_q, seqlen_k = work.m_block, work.seqlen_q, work.seqlen_k
        n_block_min, n_block_max, n_block_no_right, n_block_no_left = work.blocks
        row_start = m_block * self.tile_m + consumer * self.wg_m
        sQ_c = sQ[None, None, q_state.index * self.num_consumers + consumer]
        thr_qk = ops.tiled_mma_qk.get_slice(tidx)
        thr_pv = ops.tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ_c))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((wg_m, dv)))
        acc_O.fill(0.0)
        tScS = mn_view_wgmma(thr_qk.partition_C(cute.make_identity_tensor((wg_m, tile_n))))
        softmax = OnlineSoftmax(scales.scale_log2, cute.size(tScS.shape[0]), view=mn_view_wgmma,
                                rescale_threshold=self.rescale_threshold)  # fmt: skip
        softmax.reset()
        rows_left = seqlen_q * self.packed_heads - row_start  # packed GQA: rows of G heads

        # Key blocks from n_block_max - 1 down. Step j issues, in this consumer's turn,
        # S_j = Q K_j^T and O += P_{j-1} V_{j-1}, then runs the softmax of S_j while the other
        # consumers take their turns; one last turn issues O += P V of the final block.
        n_blocks = n_block_max - n_block_min
        rP = cute.make_rmem_tensor(thr_qk.partition_shape_C((wg_m, tile_n)), self.dtype)
        # With defer_rescale, S/P of the last softmaxed block (fp32) and its O rescale factors
        # live across steps: P goes to 16 bits, and O is rescaled, right before its P V issue.
        acc_S, corr = None, None
        if cutlass.const_expr(self.defer_rescale):
            acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((wg_m, tile_n)))
            corr = cute.make_rmem_tensor(softmax.num_rows, Float32)
        mma = ConsumerMma(thr_qk, tSrQ, tSrK, tOrV, acc_O, rP, tScS, acc_S, corr)
        rows = ScoreRows(scales.score_scale, row_start, seqlen_q, seqlen_k, window)
        # Blocks [start_unmasked, n_block_max) may cut the seqlen tail, the causal diagonal or
        # the right window edge (the first visited block always counts as such);
        # [start_left_masked, start_unmasked) need no mask; [n_block_min, start_left_masked)
        # cut the left window edge (local only; otherwise the range is empty).
        start_unmasked = cutlass.max(cutlass.min(n_block_no_right, n_block_max - 1), n_block_min)
        start_left_masked = n_block_min
        if cutlass.const_expr(self.local):
            start_left_masked = cutlass.min(
                cutlass.max(n_block_no_left, n_block_min), start_unmasked
            )
        has_q = self.tile_has_q(n_block_min, n_block_max)
        if has_q:
            pipes.q.consumer_wait(q_state)
        if n_blocks > 0:
            self.step(n_block_max - 1, k_state, v_state, softmax, consumer, mma, pipes, rows,
                      True, True)  # fmt: skip
            k_state.advance()
            if cutlass.const_expr(self.config.seqused_k):
                if consumer == 0:
                    valid = seqlen_k - (n_block_max - 1) * tile_n
                    if valid < tile_n:
                        self.zero_v_tail(sV, pipes.v, v_state, valid, tidx)
        for i in cutlass.range(n_block_max - 1 - start_unmasked, unroll=1):
            self.step(n_block_max - 2 - i, k_state, v_state, softmax, consumer, mma, pipes,
                      rows, False, True)  # fmt: skip
            k_state.advance()
            v_state.advance()
        for i in cutlass.range(start_unmasked - start_left_masked, unroll=1):
            self.step(start_unmasked - 1 - i, k_state, v_state, softmax, consumer, mma, pipes,
                      rows, False, False)  # fmt: skip
            k_state.advance()
            v_state.advance()
        if cutlass.const_expr(self.local):
            for i in cutlass.range(start_left_masked - n_block_min, unroll=1):
                self.step(start_left_masked - 1 - i, k_state, v_state, softmax, consumer, mma,
                          pipes, rows, False, True)  # fmt: skip
                k_state.advance()
                v_state.advance()
        if n_blocks > 0:
            self.last_pv(v_state, softmax, consumer, mma, pipes)
            v_state.advance()

        # Epilogue: O / l once (rows that saw no key: O = 0, LSE = -inf), O -> this consumer's
        # slice of sQ (its WGMMAs have all completed) -> 16-byte global stores; split-KV: fp32
        # O from the registers to the partial buffer.
        lse = cute.make_rmem_tensor(cute.size(tScS.shape[0]), Float32)
        softmax.finalize(acc_O, lse)
        if cutlass.const_expr(self.split_kv):
            self.store_partial(acc_O, lse, work, thr_pv, tScS, row_start, rows_left, tidx)
        else:
            self.store_o(acc_O, lse, work, sQ, sQ_c, ops, q_state, consumer, tScS, row_start,
                         rows_left, tidx)  # fmt: skip
        if has_q:
            # The Q stage (O staged in it) goes back to the producer for a later tile's Q: the
            # generic-proxy reads and writes of O above come before that TMA write.
            cute.arch.fence_proxy("async.shared", space="cta")
            pipes.q.consumer_release(q_state)
            q_state.advance()
        return ConsumerStates(q_state, k_state, v_state)

    @cute.jit
    def store_partial(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        work: TileWork,
        thr_pv: cute.ThrMma,
        tScS: cute.Tensor,
        row_start: Int32,
        rows_left: Int32,
        tidx: Int32,
    ):
        """Split-KV epilogue: this consumer's fp32 O (already divided by its own row sums)
        straight from the accumulator registers to the partial O (each thread's pairs of
        neighbouring columns; a warp's store covers whole 32-byte sectors), rows below
        ``rows_left`` only, and its LSE (natural log; -inf for rows that saw no key)."""
        wg_m, dv = self.wg_m, self.tile_hdimv
        gO = cute.local_tile(cute.domain_offset((row_start, 0), work.views.mO), (wg_m, dv),
                             (0, 0))  # fmt: skip
        tOgO = thr_pv.partition_C(gO)
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((wg_m, dv)))
        # Unrolled at trace time (ptxas then pairs neighbouring columns into 8-byte stores,
        # which cutlass.range(unroll_full=True) does not get), in chunks of 32 elements so that
        # no static loop is long enough for the DSL's warning.
        n = cute.size(acc_O)
        for chunk in cutlass.range_constexpr((n + 31) // 32):
            for j in cutlass.range_constexpr(min(32, n - 32 * chunk)):
                i = 32 * chunk + j
                if tOcO[i][0] < rows_left:
                    tOgO[i] = acc_O[i]
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tScS[r, 0][0]
                if row < rows_left:
                    work.views.mLSE[row_start + row] = lse[r]

    @cute.jit
    def store_o(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        work: TileWork,
        sQ: cute.Tensor,
        sQ_c: cute.Tensor,
        ops: ConsumerOps,
        q_state: pipeline.PipelineState,
        consumer: Int32,
        tScS: cute.Tensor,
        row_start: Int32,
        rows_left: Int32,
        tidx: Int32,
    ):
        """Epilogue of one consumer: O -> 16 bits -> its slice of sQ -> global memory (16-byte
        row-predicated stores, or one TMA store with tuning.tma_store), and its LSE."""
        wg_m, dv, m_block = self.wg_m, self.tile_hdimv, work.m_block
        # O (wg_m x dv) takes the first dv columns of the consumer's Q slice (dv <= d).
        sO = sQ_c
        if cutlass.const_expr(dv != self.tile_hdim):
            sO = cute.local_tile(sQ_c, (wg_m, dv), (0, 0))
        acc_to_smem(acc_O, ops.tiled_mma_pv, sO, tidx)
        if cutlass.const_expr(self.tma_store):
            cute.arch.fence_proxy("async.shared", space="cta")  # the TMA store reads them
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tScS[r, 0][0]
                if row < rows_left:
                    work.views.mLSE[row_start + row] = lse[r]
        pipeline.NamedBarrier(
            barrier_id=int(Barrier.EPILOGUE_WG1) + consumer, num_threads=WARPGROUP
        ).arrive_and_wait()
        if cutlass.const_expr(self.tma_store):
            # One TMA store of the consumer's (wg_m, dv) box (rows past seqlen_q are clipped
            # at the tensor's end); warp 0 releases the Q stage below only after the store has
            # read it, and the stage needs every warp's release before its next load.
            if tidx < 32:
                gO = cute.local_tile(work.views.mO_tma, (wg_m, dv), (None, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    ops.tma_o, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                    cute.group_modes(gO, 0, 2),
                )  # fmt: skip
                if tidx == 0:
                    cute.copy(ops.tma_o, tOsO[None, q_state.index * self.num_consumers + consumer],
                              tOgO[None, m_block * self.num_consumers + consumer])  # fmt: skip
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            gO = cute.local_tile(cute.domain_offset((row_start, 0), work.views.mO), (wg_m, dv),
                                 (0, 0))  # fmt: skip
            store_rows(sO, gO, rows_left, ops.copy_r2g, tidx)

    @cute.jit
    def tile_has_q(self, n_block_min: Int32, n_block_max: Int32):
        """Whether a tile loads (and its consumers wait for and release) a Q stage: every tile
        of a persistent grid, whose next tile's Q may take the stage this one's O is staged in;
        otherwise those that visit a key block."""
        if cutlass.const_expr(self.num_ctas > 0):
            return True
        return n_block_max > n_block_min

    @cute.jit
    def zero_v_tail(
        self,
        sV: cute.Tensor,
        pipeline_v: pipeline.PipelineTmaAsync,
        v_state: pipeline.PipelineState,
        valid: Int32,
        tidx: Int32,
    ):
        """Consumer 0: zero the keys [valid, tile_n) of the V stage of the first visited block.

        With seqused_k, the rows between seqused_k and the end of the tensor (or sequence) are
        not inputs and may hold NaN; their P is 0, but 0 * NaN in P V would reach O. The first
        visited block is the only one that holds such rows. Consumer 0 writes the zeros after
        its first step, before its second turn; every other consumer reads this stage in its
        own second turn, which starts after consumer 0's second turn has been issued (round
        robin: consumer c's turn waits on consumer c - 1's arrival, so transitively on
        consumer 0's end of its second turn). The pingpong barriers order the writes,
        fence.proxy.async makes them visible to the WGMMA's async proxy, and consumer 0's own
        next turn starts with a 256-thread barrier over its 128 threads.
        """
        pipeline_v.consumer_wait(v_state)  # the TMA write of this stage has landed
        sV_stage = sV[None, None, v_state.index]  # (dv, tile_n), dv contiguous
        zero_rows_from(transposed(sV_stage), valid, tidx, WARPGROUP)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def start_turn(self, consumer: Int32):
        """Wait until the previous consumer (round robin) has issued its GEMMs (pingpong;
        nothing with tuning.pingpong off)."""
        if cutlass.const_expr(self.pingpong):
            pipeline.NamedBarrier(
                barrier_id=int(Barrier.SCHEDULER_WG1) + consumer, num_threads=2 * WARPGROUP
            ).arrive_and_wait()

    @cute.jit
    def end_turn(self, consumer: Int32):
        """Hand the tensor cores to the next consumer, (consumer + 1) % num_consumers
        (nothing with tuning.pingpong off)."""
        if cutlass.const_expr(self.pingpong):
            next_consumer = consumer + 1
            if next_consumer == self.num_consumers:
                next_consumer = 0
            pipeline.NamedBarrier(
                barrier_id=int(Barrier.SCHEDULER_WG1) + next_consumer, num_threads=2 * WARPGROUP
            ).arrive()

    @cute.jit
    def prepare_pv(self, softmax: OnlineSoftmax, mma: ConsumerMma):
        """defer_rescale, before O += P V of the last softmaxed block is issued: O *= the
        factors of its softmax, P (fp32, in acc_S) -> 16-bit registers (rP). The P V GEMM
        before has completed (wait_group 0 at the end of the previous step): no WGMMA reads rP
        or accumulates into O any more."""
        softmax.rescale(mma.acc_O, mma.corr)
        convert_in_chunks(mma.rP, mma.acc_S)

    @cute.jit
    def after_exponentials(self, softmax: OnlineSoftmax):
        """Scheduling anchor for the wgmma wait_group 0 that follows (defer_rescale).

        ptxas places a WARPGROUP.DEPBAR no earlier than the last SHFL before it in program
        order, and otherwise as early as it can (without this, most MUFU.EX2 of a step come
        after the wait). One butterfly shuffle of each row's partial sum, which depends on
        every exponential of the row, added times 0, puts all of them before the wait (CUDA 12
        build's ptxas). x + a * 0 is x: a is the partial sum of the same row in the
        neighbouring lane of the quad, finite and >= 0 (sums of exp2 of values <= 0); the
        compiler cannot fold it (a * 0 is NaN for an infinite a).
        """
        for r in cutlass.range_constexpr(softmax.num_rows):
            other = cute.arch.shuffle_sync_bfly(softmax.row_sum[r], offset=1)
            softmax.row_sum[r] = softmax.row_sum[r] + other * 0.0

    @cute.jit
    def gemm_pv(self, mma: ConsumerMma, v_stage: Int32):
        """O += P V with P from registers; issue only."""
        _, tiled_mma_pv = self.make_tiled_mmas()
        tOrP = acc_as_rs_operand(mma.rP)
        tOrV_stage = mma.tOrV[None, None, None, v_stage]  # sliced once: fewer address computations
        gemm_over_k(tiled_mma_pv, mma.acc_O, tOrP, tOrV_stage, zero_init=False)

    @cute.jit
    def step(
        self,
        n_block: Int32,
        k_state: pipeline.PipelineState,
        v_state: pipeline.PipelineState,
        softmax: OnlineSoftmax,
        consumer: Int32,
        mma: ConsumerMma,
        pipes: Pipelines,
        rows: ScoreRows,
        is_first: cutlass.Constexpr[bool],
        masked: cutlass.Constexpr[bool],
    ):
        """Key block n_block of one consumer: S = Q K^T (with O += P V of the previous block
        unless ``is_first``), softcap (when compiled in), mask (``masked``: the block may cut
        the seqlen tail, the causal diagonal or a window edge), online softmax, P -> registers
        (16-bit) for the next step."""
        acc_O, acc_S, corr = mma.acc_O, mma.acc_S, mma.corr
        tiled_mma_qk, _ = self.make_tiled_mmas()
        pipeline_k, pipeline_v = pipes.k, pipes.v
        if cutlass.const_expr(self.defer_rescale):
            if cutlass.const_expr(not is_first):
                self.prepare_pv(softmax, mma)  # of the previous block, before acc_S is reused
        else:
            acc_S = mma.thr_qk.make_fragment_C(
                mma.thr_qk.partition_shape_C((self.wg_m, self.tile_n))
            )
        pipeline_k.consumer_wait(k_state)
        if cutlass.const_expr(not is_first):
            pipeline_v.consumer_wait(v_state)
        self.start_turn(consumer)
        warpgroup.fence()
        tSrK_stage = mma.tSrK[None, None, None, k_state.index]  # sliced once, as in gemm_pv
        gemm_over_k(tiled_mma_qk, acc_S, mma.tSrQ, tSrK_stage, zero_init=True)
        warpgroup.commit_group()
        if cutlass.const_expr(not is_first):
            self.gemm_pv(mma, v_state.index)
            warpgroup.commit_group()
        self.end_turn(consumer)
        # S is complete after this wait; O += P V (when issued) may still run during the
        # softmax below, which leaves acc_O alone until it has completed (tuning.overlap off:
        # both have completed).
        warpgroup.wait_group(0 if is_first or not self.overlap else 1)
        pipeline_k.consumer_release(k_state)

        if cutlass.const_expr(self.has_softcap):
            softcap_scores(acc_S, rows.score_scale)
        if cutlass.const_expr(masked):
            apply_mask(
                mn_view_wgmma(acc_S), mma.tScS, rows.row_start, n_block * self.tile_n,
                rows.seqlen_q, rows.seqlen_k, rows.window.left, rows.window.right, self.causal,
                self.local, self.packed_heads,
            )  # fmt: skip
        check_inf = masked and (self.causal or self.local)
        # Polynomial exponentials take finite scores only: not on masked blocks (-inf).
        poly = 0 if masked else self.exp2_poly
        if cutlass.const_expr(self.defer_rescale):
            # P stays fp32 in acc_S and the factors in corr until the next P V issue
            # (prepare_pv): after wait_group 0 nothing in this step writes acc_O or rP. (The
            # wait stays in this step: ptxas serializes every WGMMA when a commit group is
            # still in flight at the loop's back edge.)
            softmax.step(acc_S, None, is_first, check_inf, corr, poly)
            if cutlass.const_expr(not is_first):
                self.after_exponentials(softmax)
                warpgroup.wait_group(0)
                pipeline_v.consumer_release(v_state)
        elif cutlass.const_expr(is_first):
            softmax.step(acc_S, acc_O, True, check_inf)
        else:
            corr = cute.make_rmem_tensor(softmax.num_rows, Float32)
            softmax.step(acc_S, None, False, check_inf, corr, poly)
            warpgroup.wait_group(0)
            pipeline_v.consumer_release(v_state)
            softmax.rescale(acc_O, corr)
        if cutlass.const_expr(not self.defer_rescale):
            convert_in_chunks(mma.rP, acc_S)

    @cute.jit
    def last_pv(
        self,
        v_state: pipeline.PipelineState,
        softmax: OnlineSoftmax,
        consumer: Int32,
        mma: ConsumerMma,
        pipes: Pipelines,
    ):
        """O += P V of the last visited key block, in this consumer's turn."""
        pipeline_v = pipes.v
        if cutlass.const_expr(self.defer_rescale):
            self.prepare_pv(softmax, mma)
        pipeline_v.consumer_wait(v_state)
        self.start_turn(consumer)
        warpgroup.fence()
        self.gemm_pv(mma, v_state.index)
        warpgroup.commit_group()
        self.end_turn(consumer)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
