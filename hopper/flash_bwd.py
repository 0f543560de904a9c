"""sm90 backward main kernel: FlashAttention-3 design on TMA, WGMMA and warp-specialized
warpgroups; the backward on Hopper for what it implements (see the class docstring)."""

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
from cutlass.cute.nvgpu.warp import LdMatrix8x8x16bOp, StMatrix8x8x16bOp
from cutlass.tensor_utils.layout import LayoutEnum

from cute_fa.config import SMEM_CAPACITY, BwdConfig
from cute_fa.dsl.copy import (
    acc_to_smem,
    row_store_copy,
    store_rows,
    transposed,
    zero_rows_from,
)
from cute_fa.dsl.kernel import AttentionKernel
from cute_fa.dsl.mask import (
    Window,
    apply_mask,
    query_block_range,
    rotated_query_block,
    visited_query_block,
)
from cute_fa.dsl.scheduler import bwd_block_coords, bwd_grid
from cute_fa.dsl.seqlen import seqlen_info
from cute_fa.dsl.softmax import (
    ScoreScales,
    lse_for_recompute,
    mn_view_wgmma,
    score_scales,
    softcap_scores,
)
from cute_fa.dsl.turns import dq_turn, pass_dq_turn, wait_dq_turn

from .fragments import (
    acc_as_rs_operand,
    convert_in_chunks,
    gemm_over_k,
)
from .support import (
    SM90_BWD_DS_BUFFERS,
    bwd_can_implement,
    bwd_dq_transposed,
    bwd_q_stages,
    bwd_smem_bytes,
    bwd_split_d,
)
from .sync import thread_pipeline, tma_pipeline

WARPGROUP = 128  # threads
WG_KEYS = 64  # keys of one consumer warpgroup (the M of its WGMMAs)


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads)."""

    EPILOGUE_WG1 = 1  # 128 threads: consumer 0 staged its dK / dV tiles in smem
    EPILOGUE_WG2 = 2  # 128 threads: consumer 1 the same
    DS_READY = 3  # 256 threads: both consumers wrote their dS columns of the block to smem
    DQ_FULL_WG1 = 4  # 160 threads: consumer 0's dQ half is in sdQ (it arrives, warp 1 waits)
    DQ_FULL_WG2 = 5  # 160 threads: consumer 1 the same
    DQ_EMPTY_WG1 = 6  # 160 threads: warp 1's reduce has read consumer 0's sdQ half (warp 1
    DQ_EMPTY_WG2 = 7  # arrives, the consumer waits); 7: the same for consumer 1
    KV_TAIL_WG1 = 8  # 128 threads, seqused_k: consumer 0 zeroed its K / V rows past seqlen_k
    KV_TAIL_WG2 = 9  # consumer 1 the same
    Q_TAIL = 10  # 256 threads, seqused_q: both consumers zeroed the Q / dO rows past seqlen_q
    P_READY = 11  # 256 threads, split d: consumer 0 wrote P^T to sP (it arrives, 1 waits)


class MaskArgs(NamedTuple):
    """The sequence lengths of this CTA's (batch, head) and the window: what the mask and the
    deterministic turns need."""

    seqlen_q: Int32
    seqlen_k: Int32
    window: Window


class ConsumerSmem(NamedTuple):
    """A consumer's view of shared memory: the Q / dO stages, its keys' rows of K and V (split
    d: all of them), the dS buffers, the columns of K its dQ GEMM reads, its sdQ half, the LSE /
    delta stages and (split d, else None) the P^T exchange tile."""

    sQ: cute.Tensor
    sdO: cute.Tensor
    sK_c: cute.Tensor
    sV_c: cute.Tensor
    sdS: cute.Tensor
    sK_dq: cute.Tensor
    sdQ_c: cute.Tensor
    sLSE: cute.Tensor
    sdPsum: cute.Tensor
    sP: cute.Tensor | None


class ConsumerPipelines(NamedTuple):
    """The per-query-block pipelines a consumer waits on and releases (class docstring)."""

    q: pipeline.PipelineTmaAsync
    do: pipeline.PipelineTmaAsync
    lse: pipeline.PipelineAsync


def k_major_layout(dtype, shape: tuple, cut_cols: int) -> cute.ComposedLayout:
    """K-major (rows, cols, stages) WGMMA smem layout of 16-bit ``dtype`` that can be cut into
    blocks of ``cut_cols`` columns: the widest swizzle atom (128, 64 or 32 bytes: 64, 32 or 16
    columns) that divides the columns (as ``make_smem_layout_a`` picks it) and that divides
    ``cut_cols`` or is divided by it (d 64: 64-column atoms cut in 32s; d 96: 48-column cuts
    need 16-column atoms; d 192: 96-column cuts need 32-column atoms)."""
    cols = shape[1]
    width = 64
    while cols % width or (cut_cols % width and width % cut_cols):
        width //= 2
    kinds = cute.nvgpu.warpgroup.SmemLayoutAtomKind
    kind = {64: kinds.K_SW128, 32: kinds.K_SW64, 16: kinds.K_SW32}[width]
    atom = sm90_utils.make_smem_layout_atom(kind, dtype)
    return cute.tile_to_shape(atom, shape, order=(0, 1, 2))


def dq_barrier(first: Barrier, consumer) -> pipeline.NamedBarrier:
    """The DQ_FULL / DQ_EMPTY barrier of a consumer: its 128 threads and producer warp 1."""
    return pipeline.NamedBarrier(barrier_id=int(first) + consumer, num_threads=WARPGROUP + 32)


class FlashAttentionBackwardSm90(AttentionKernel):
    """Exact attention backward (dQ, dK, dV), FA3 design (sm90a only).

    Planned on sm_90a wherever ``can_implement`` accepts the call (Note [backward dispatch]
    in cute_fa/backward.py); the sm80 backward runs the rest. tests/test_bwd_sm90_gpu.py and
    tests/test_bwd_gpu.py check its gradients on an H200 (d 64 to 256, bf16/fp16, causal,
    windows, softcap, MHA/GQA, varlen with empty sequences and NaN past seqused, lengths
    0..1000); its measurements are in docs/performance.md.
    tests/test_compile_sm90_bwd.py cross-compiles it for sm_90a and reads its SASS (HGMMA, no
    spills, no stack). It takes the backward protocol of ``bwd_fake_args`` and reuses
    the sm80 preprocess (delta, dQaccum zeroing) and postprocess (dQ conversion) kernels as they
    are.

    Scope: bf16 or fp16; head_dim = head_dim_v in (64, 96, 128, 192, 256); dense or varlen
    (cu_seqlens_q / cu_seqlens_k, each on its own; seqused_q / seqused_k); no mask, causal or
    sliding window (local; Note [bottom-right aligned masks] in cute_fa/dsl/mask.py); softcap;
    GQA (K/V head = head // (heads / kv heads)); deterministic dQ (``mdQsemaphore``, see
    "Deterministic dQ" below); (head_dim, head_dim_v) = (192, 128) and (128, 64) too.
    ``hopper/support.py bwd_can_implement`` rejects other head dims with its reason.
    Tile: tile_n = 128 keys a CTA (64 with split d), tile_m = 64 query rows a step (d 64
    without softcap: 128, so S^T / dP^T are N = 128 WGMMAs and dQ two M = 64 atoms)
    (``support.bwd_default_tuning``); tuning.tile_m = 80 at d 128 (no softcap, the base step
    order, two Q / dO stages): S^T / dP^T are N = 80 WGMMAs and dQ is computed transposed
    (below; ``support.bwd_dq_transposed``).

    Split d (d > 128, ``self.split_d``): dK and dV of 64 keys (2 * 64 * d / 128 fp32 a thread)
      no longer fit one consumer's registers (d 192 with dv 128 too: dK's 96 and dV's 64
      columns a consumer). tile_n = 64; both consumers take all 64 keys of
      the CTA (sK_c, sV_c are the whole tiles) and split the score GEMMs: consumer 0 computes
      S^T (and P^T), consumer 1 dP^T; they exchange through shared memory (consumer 0 stores
      P^T to sP by stmatrix and arrives on P_READY; consumer 1 waits, loads P^T by ldmatrix
      and forms dS^T = P^T (dP^T - delta) from it, stores dS^T to sdS (which the dQ GEMM reads
      anyway) and both meet at DS_READY after the branches join, after which both load dS^T
      by ldmatrix), so each holds 16-bit P^T and dS^T for its RS GEMMs. Every WGMMA is issued
      once (before, both consumers ran both score GEMMs: 7 / 5 of the useful work). dS is
      formed from the 16-bit P^T. No WGMMA is in flight across the two consumers' branches
      (ptxas would serialize every WGMMA), and P^T is defined on both paths where they join,
      dS^T after it (a dS^T defined by a branch serialized every WGMMA; d 256 spilled when a
      branch left P^T undefined). DS_READY, an aligned bar.sync, is one instruction that all
      256 threads reach (one DS_READY per branch: synccheck "divergent thread(s) in block").
      Consumer c owns columns [c d/2, c d/2 + d/2) of dK and dV (the B operands of dV / dK
      are those columns of sdO / sQ) and, as always, of dQ. dQ's accumulator (d / 4
      registers: 48 or 64) is allocated only after dV and dK completed (wait_group 0 before the
      dQ GEMM, which then runs alone). d 256 runs one Q / dO stage (two need 278 KiB). The
      epilogue stores each consumer's column half of dK / dV of the 64 keys. softcap keeps no
      1 - tanh^2 tile (no registers for it): tanh is recovered from P and the row's LSE when
      dS is formed. What follows
      says "consumer c's 64 keys"; with split d read "the CTA's 64 keys, columns of c".

    Grid and work split
      grid = (ceil(max_seqlen_k / tile_n), num_heads, batch) (varlen q: batch =
      len(cu_seqlens_q) - 1; deterministic causal: key blocks slowest, ``bwd_grid``): one CTA
      owns tile_n keys of one (query head, batch) and walks the
      query blocks that see them (``query_block_range``: causal skips the blocks above the
      diagonal, a window those outside its band), from the first to the last (deterministic
      mode: from the last to the first; without causal, window or determinism downward from
      block (n - 1) mod count for key block n, wrapping, so the CTAs of a head do not all
      reduce into the same dQ block at once; ``query_block``). P is recomputed from Q, K and the
      forward's LSE. dQ of each query block goes through smem and is added to the fp32
      dQaccum by TMA reduce-adds (cp.reduce.async.bulk.tensor .add.f32); the postprocess scales
      and casts it. GQA: the CTA of query head h reads K/V head h // (h / h_kv) and writes dK/dV
      of head h; the caller sums each group.
    Warp roles (3 warpgroups, 384 threads; launched at <= 168 registers a thread)
      warpgroup 0: producer. setmaxnreg.dec to 24 registers.
        warp 0 issues the TMA loads (K and V once; Q[m] and dO[m] of each query block) and
          writes LSE (log2 units) and delta rows of each block to smem with its 32 lanes
          (tile_m / 32 rows a lane, rounded up: at tile_m 80 lanes 0..15 write rows 64..79).
        warp 1 (dQ writer): per query block and consumer c, waits for DQ_FULL_WG1 + c, issues
          the TMA reduce-add of that consumer's half of sdQ into dQaccum (its column half of
          the block, or with dq_by_rows its 64 rows), waits until the TMA
          has read sdQ (cp.async.bulk.wait_group.read 0) and arrives on DQ_EMPTY_WG1 + c
          (not after the last block: nobody waits for it). At the end it waits for its
          reduce-adds to complete. Deterministic mode: it also waits for the block's turn
          before, and passes the turn on after (below).
        warps 2, 3 idle.
      warpgroups 1, 2: consumers 0, 1. Consumer c owns keys [64 c, 64 c + 64) of the tile: its
        dK and dV (64 x d fp32) stay in registers for the whole CTA. setmaxnreg.inc to 240.
    GEMMs of consumer c for query block m (WGMMA, M = its 64 keys except for dQ; "swapped AB":
    the score tiles are computed transposed, keys x queries, so P^T and dS^T come out of the
    accumulator in the register layout of the A operand of dV and dK)
      S^T  = K_c Q^T        SS   (64 x tile_m, k = d)       A: sK rows of c (K-major)
      dP^T = V_c dO^T       SS   (64 x tile_m, k = d)       B: sQ / sdO stage (K-major)
      dV  += P^T dO         RS   (64 x d, k = tile_m)       B: sdO viewed transposed (MN-major)
      dK  += dS^T Q         RS   (64 x d, k = tile_m)       B: sQ viewed transposed (MN-major)
      dQ_c = dS K[:, cols c] SS  (tile_m x d/2, k = tile_n) A: all of sdS (K-major); B: the
                                                            d/2 columns of c of sK, viewed
                                                            transposed (MN-major)
      dQ is split over the consumers along d: consumer c computes columns [c d/2, c d/2 + d/2)
      of the block's dQ over all tile_n keys, so each dQaccum element gets one reduce-add per
      CTA and block. This needs both consumers' dS columns in sdS (barrier DS_READY).
      tuning.dq_by_rows (tile_m = 128 without split d, i.e. d 64): dQ is split along the rows
      instead:
      dQ_c = dS[rows c] K   SS   (64 x d, k = tile_n)       A: rows [64 c, 64 c + 64) of sdS
                                                            (K-major); B: all of sK, viewed
                                                            transposed (MN-major)
      one M = 64 atom of N = d (d 64: 8 m64n64k16 WGMMAs, 32 KiB of smem operands a consumer)
      instead of two atoms of N = d / 2 (16 m64n32k16, 48 KiB); the same 32 fp32 registers a
      thread. Still one reduce-add per dQaccum element, CTA and block; rows [64 c, 64 c + 64)
      of each dS row hold both consumers' keys, so DS_READY stays.
      tile_m = 80 (``dq_transposed``; d 128): dQ's M would be the 80 query rows, not a
      multiple of the WGMMA's M = 64, so the consumer computes its columns of dQ transposed:
      dQ_c^T = K[:, cols c]^T dS^T
                            SS   (d/2 x tile_m, k = tile_n) A: the d/2 columns of c of sK,
                                                            viewed transposed (MN-major); B:
                                                            all of sdS (K-major)
      8 m64n80k16 WGMMAs a consumer and step (tile_m 64: 8 m64n64k16), a 64 x 80 fp32
      accumulator (40 registers a thread, allocated after S^T / dP^T are converted). The same
      columns of the same sdQ half as without it: a thread's accumulator pairs are two rows
      of one dQ column, 128 bytes apart in sdQ, so they leave by 4-byte stores (40 a thread;
      8 lanes of a store write 8 columns of 4 rows, 32 banks under the 128-byte swizzle: no
      conflict) instead of 8-byte ones. Registers a thread: dK + dV 128, S^T + dP^T 80
      (m64n80); the SASS peaks at R237 of 240 (causal), no spills.
    Per query block m (the i-th visited), consumer c (pipeline states advance in lockstep over
    the q stages; split d: the score GEMMs and the dS exchange as above, and dQ is issued only
    after wait_group 0)
      wait Q[m]; fence; issue S^T (commit); wait dO[m]; issue dP^T (commit)
      wait LSE/delta[m]; wgmma wait_group 1 (S^T complete)
      softcap: S^T = tanh(S^T * softmax_scale / softcap), keeping 1 - tanh^2 (fp32 registers)
      mask (causal / local: always; otherwise only when this consumer's keys cut seqlen_k);
        P^T = exp2(S^T * scale_log2 - LSE_log2[query]) (softcap: scale_log2 = softcap log2 e)
      wait_group 0 (dP^T complete); dS^T = P^T (dP^T - delta[query]) (softcap: times
        1 - tanh^2); release LSE/delta[m]
      P^T, dS^T -> 16-bit registers (convert_in_chunks); fence; issue dV += P^T dO and
        dK += dS^T Q (RS, commit)
      dS^T -> sdS[:, 64 c : 64 c + 64, i % 2] (stmatrix.trans: 16-byte rows of 8 keys);
        fence.proxy.async; named barrier DS_READY (256 threads: both consumers)
      fence; issue dQ_c (commit) behind dV and dK; wait_group 1 (dV, dK complete): release
        Q[m], dO[m]; wait_group 0 (dQ_c complete)
      i > 0: wait DQ_EMPTY_WG1 + c (warp 1 has read this consumer's sdQ half of block i - 1)
      dQ_c -> sdQ[:, :, c] (fp32, 8-byte stores; tile_m 80: 4-byte); fence.proxy.async; arrive
        DQ_FULL_WG1 + c
    tuning.dq_before_dk (not split d; FA4's order): dK is taken out of the dV commit group and
    issued behind dQ, so that dQ is written to smem while dK's WGMMA is in flight:
      P^T, dS^T -> 16-bit registers; fence; issue dV += P^T dO (commit)
      dS^T -> sdS (as above); fence.proxy.async; DS_READY
      fence; issue dQ_c (commit); wait_group 1 (dV complete); issue dK += dS^T Q (commit; no
        fence: neither dS^T nor acc_dK was touched since dQ's); release dO[m]; wait_group 1
        (dQ_c complete)
      i > 0: wait DQ_EMPTY_WG1 + c; dQ_c -> sdQ[:, :, c]; fence.proxy.async; arrive
        DQ_FULL_WG1 + c (dK in flight throughout)
      wait_group 0 (dK complete); release Q[m]
      dQ's accumulator never crosses the back edge (carrying it into the next step spilled:
      docs/log/sm90-backward.md); registers a thread peak at R231 (d 128; R217 by default).
      The two dS buffers: block i + 2 overwrites the buffer of block i only after the DS_READY
      barrier of block i + 1, which each consumer reaches after its dQ GEMM of block i (the
      only reader of that buffer) completed.
    Pipelines (mbarriers; producer warp 0 -> both consumers; ``pipeline_protocol`` builds them
    and checks stages, TMA bytes and arrivals against the tiles while tracing)
      pipeline_kv: PipelineTmaAsync, 1 stage, K and V tiles on one barrier, 8 consumer-warp
                   arrivals; loaded once, never released.
      pipeline_q, pipeline_do: PipelineTmaAsync, q_stages = 2, 8 consumer-warp arrivals; a stage
                   is released once the dK (Q) / dV (dO) GEMM of its block has completed;
                   tile_m * d * 2 bytes a stage (tile_m 80: 20 KiB, two 64-column boxes).
      pipeline_lse: PipelineAsync, q_stages = 2, 32 producer-lane arrivals (their st.shared of
                   LSE and delta come before their arrive), 256 consumer-thread arrivals.
    Named barriers (``Barrier``)
      EPILOGUE_WG1 + c (128): consumer c staged its dK / dV tiles in its rows of sK / sV.
      DS_READY (256): both consumers wrote their dS columns of the block (and, once after the
        last block, both finished reading sK, so the epilogue may overwrite it).
      DQ_FULL_WG1 + c (160): consumer c arrives (128) after writing its sdQ half; warp 1 waits.
      DQ_EMPTY_WG1 + c (160): warp 1 arrives once its reduce-add has read that half; consumer c
        waits before writing the next block's dQ. Each is used once per block (EMPTY: blocks
        1..n-1), in the same order on both sides, so an arrival never meets an older phase.
      KV_TAIL_WG1 + c (128), seqused_k: consumer c zeroed its K / V rows past seqlen_k.
      Q_TAIL (256), seqused_q: both consumers zeroed the tail block's Q / dO rows.
      P_READY (256), split d: consumer 0 arrives once P^T is in sP, consumer 1 waits. Once a
        block; consumer 0 rewrites sP (next block) only after this block's DS_READY, which
        consumer 1 reaches after its ldmatrix of sP.
    Shared memory (swizzled WGMMA layouts; ``k_major_layout`` picks the widest swizzle atom
    that the column halves read by the dQ GEMM (sK) or, split d, by dK / dV (sQ, sdO) can be
    cut at: 128-byte, except sK at d 96 (32-byte) and sK / sV / sQ / sdO at d 192 (64-byte);
    TMA writes K, V, Q, dO)
      sK (tile_n, d), sV (tile_n, dv)    loaded once; at the end consumer c stages its dK / dV
                                         (16-bit) in its own 64 rows of them (split d: its
                                         column half).
      sQ (tile_m, d, q_stages),          K-major B of S^T / dP^T; viewed (d, tile_m) MN-major as
      sdO (tile_m, dv, q_stages)         the B of dK / dV. q_stages = 2 (1 at d 256;
                                         tuning.q_stages = 3 where it fits).
      sLSE, sdPsum (tile_m, q_stages)    fp32: LSE * log2 e and delta of the block's rows.
      sdS (tile_m, tile_n, 2)            16-bit dS, K-major A of dQ.
      sP (tile_m, tile_n), split d       16-bit P^T of the block, laid out as an sdS buffer
                                         (8 bytes otherwise).
      sdQ (tile_m, d / 2, 2)             fp32 dQ, the last mode the consumer (each half one TMA
                                         reduce source: 128-byte swizzle, 32-column boxes;
                                         d 96: 64-byte, 16-column boxes). dq_by_rows:
                                         (tile_m / 2, d, 2), a consumer's rows; its TMA
                                         reduce-add goes to rows [64 (2 m + c), + 64) of
                                         dQaccum in two 32-column boxes (same bytes).
                                         tile_m 80: boxes of (80, 32), two a consumer; the
                                         TMA atom takes the first half's layout by
                                         cute.select (cute.slice_ of this swizzled fp32
                                         layout, a column stride of 2560, aborts the DSL).
      d 64: 195 KiB (tile_m 128; 114 at 64), d 96: 154, d 128: 194 (tile_m 80: 226.25, of
      the 227 an sm_90a CTA may use), d 192: 218, d 256: 217.5 (one Q / dO stage)
      (``support.bwd_smem_bytes``).
    Epilogue (per consumer): DS_READY (both consumers are done with sK); dK *= softmax_scale;
      dK, dV -> 16-bit -> its rows of sK / sV -> named barrier EPILOGUE_WG1 + c -> 16-byte
      global stores of keys < seqlen_k.
    Varlen: every TMA coordinate tensor (Q, dO, K, V, dQaccum) and the LSE, delta, dK, dV
      views are shifted (cute.domain_offset) to the sequence's first row; a CTA whose key block
      starts at or past seqlen_k (the grid covers the longest sequence) does nothing.
    Out-of-range rows: dense, TMA zero-fills Q and dO rows past seqlen_q and K, V rows past
      seqlen_k; packed varlen, those rows are the next sequence's (finite inputs). Either way
      the producer writes LSE = +inf and delta = 0 for rows past seqlen_q and LSE = +inf for
      rows whose forward LSE is -inf (they saw no key): P = 0 and dS = 0 there. Scores of keys
      past seqlen_k are masked to -inf by select (P = 0). The TMA reduce-add clips rows past
      the tensor (dense: seqlen_q); packed varlen, the tail block's rows past seqlen_q add
      exact zeros (dS = 0) to the next sequence's dQaccum rows, which changes no value (and no
      bit: dQaccum starts at +0 and x + 0 = x, so deterministic mode stays bitwise
      stable). dK and dV stores skip keys past seqlen_k. A CTA whose key block no query row
      sees (none with causal and seqlen_q > 0) loads K/V, visits no query block and stores
      zeros.
    seqused: rows between seqused and the end of the tensor (or sequence) are not inputs and
      may hold NaN, and 0 * NaN in a GEMM would spread. seqused_k: each consumer zeroes its K
      and V rows past seqlen_k in smem once (``zero_kv_tail``; every consumer of every CTA
      reaches its KV_TAIL barrier, with or without rows to zero); seqused_q: the two consumers
      zero the Q and dO rows past seqlen_q of the stage of the block holding seqlen_q
      (``zero_q_tail``) before either issues a GEMM on it.
    Deterministic dQ (config.deterministic; the sm80 kernel's protocol, Note [deterministic dQ]
    in ampere/flash_bwd.py: each dQaccum element gets its terms in ascending key block order)
      mdQsemaphore (batch, head, query block) int32, zeroed by the caller. Every CTA walks its
      query blocks downward (all four roles: ``query_block``). Only producer warp 1 touches the
      semaphores (``cute_fa/dsl/turns.py``, shared with the sm100 backward); for query block
      m, with turn = n_block - first_key_block(m) (= n_block without a window; with one, the
      first key block whose band reaches m), it
        1. before DQ_FULL of consumer 0 (so the spin overlaps the consumers' GEMMs of m): lane
           0 reads the semaphore (ld.acquire.gpu) until it equals turn; __syncwarp;
           fence.proxy.async.global (the reduce-adds below are async-proxy operations: ordered
           after the generic acquire);
        2. for c = 0, 1 as without determinism: wait DQ_FULL + c, reduce-add, wait_group.read 0,
           arrive DQ_EMPTY + c (the consumers are released as soon as sdQ was read, never held
           for the semaphore);
        3. cp.async.bulk.wait_group 0 (without .read: both reduce-adds' writes are complete and
           visible to the issuing thread); fence.proxy.async.global (those async-proxy writes
           ordered before the generic operations that follow); __syncwarp; lane 0:
           red.release.gpu.add 1. One increment a block, after both halves (acquire loads and
           a release increment: no fence.acq_rel.gpu, whose MEMBAR.ALL.GPU measured slower).
      A CTA of key block n waits only for the increments of key blocks first_key_block(m) ..
      n - 1 of the same (batch, head), CTAs of lower index that the hardware started first
      (causal: the grid is (heads, batch, key blocks), ``bwd_grid``), and their turns never
      depend on higher key blocks: no deadlock, even with more CTAs than fit the GPU. The
      consumers never wait on a semaphore; they wait for warp 1 only through DQ_EMPTY, i.e.
      when they are a whole block ahead of its turn (one sdQ buffer). Walking downward, every
      key block starts at the same last query blocks, so key block n waits for n - 1's
      reduce-adds (a wavefront), not for n - 1 to reach m.
    SASS (what tests/test_compile_sm90_bwd.py asserts): one warpgroup.arrive per GEMM group
      (S^T, dP^T, dV + dK, dQ; no ptxas serialization; dq_before_dk: S^T, dP^T, dV, dQ and dK
      behind dQ with no arrive of its own, the dQ stores between dK's WGMMAs and the wait for
      them: releasing dO before issuing dK gave every dK WGMMA its own arrive), the dQ
      WGMMAs' shape (dq_by_rows: m64nd; tile_m 80: m64n80 with A transposed), no spills and
      no stack (the exceptions are listed there); dQ leaves by UTMAREDG (no REDG atomics).
      With dQ split along d its accumulator is 64 x d/2 fp32 (d/4 registers a thread), so dQ
      is issued while dV and dK (and their 16-bit P^T / dS^T registers) are in flight without
      ptxas serializing the WGMMAs (C7512); with the full 64 x d accumulator d 128 did not
      fit. Deterministic mode adds only warp 1's handshake (acquire-load spin, release
      increment, async-proxy fences); the consumers' code is unchanged.
    A learnable sink needs nothing here: the torch layer applies it to the forward's (out,
      LSE) and hands this kernel the matching dO and dLSE (Note [learnable sink] in
      cute_fa/api.py).
    Not yet: pingpong between the consumers; a
      second sdQ buffer (deterministic mode would hold the consumers less). Tried and dropped
      (docs/performance.md Log): the next block's S^T / dP^T issued behind this block's dQ (a
      commit group in flight across the loop's back edge makes ptxas serialize every WGMMA);
      K_c / V_c as register operands at d 64; dQ of each consumer's own keys at d 64; dV
      issued before dS is computed.
    """

    arch = 90

    can_implement = staticmethod(bwd_can_implement)

    def __init__(self, config: BwdConfig):
        super().__init__(config)
        self.num_consumers = 2
        self.q_stages = bwd_q_stages(config)
        # d > 128 (split_d): both consumers share the CTA's 64 keys and each owns half of the
        # columns of dK / dV (docstring: split d).
        self.split_d = bwd_split_d(config.head_dim)
        parts = 2 if self.split_d else 1
        self.dk_cols = config.head_dim // parts  # this consumer's columns of dK
        self.dv_cols = config.head_dim_v // parts  # and of dV
        self.ds_buffers = SM90_BWD_DS_BUFFERS
        self.regs_producer = 24
        self.regs_consumer = 240
        self.deterministic = config.deterministic
        # The part of a block's dQ a consumer computes (docstring: GEMMs): by default its d / 2
        # columns of all tile_m rows; dq_by_rows (tile_m 128): its 64 rows of all d columns.
        self.dq_by_rows = config.tuning.dq_by_rows
        # tile_m 80 (not a multiple of 64): dQ^T = K^T dS^T, M = the consumer's d / 2 columns,
        # N = the query rows (docstring: GEMMs).
        self.dq_transposed = bwd_dq_transposed(config)
        self.dq_rows = self.tile_m // self.num_consumers if self.dq_by_rows else self.tile_m
        self.dq_cols = self.tile_hdim if self.dq_by_rows else self.tile_hdim // self.num_consumers
        # dq_before_dk: dV, dQ, dK issued in that order (docstring: per query block).
        self.dq_before_dk = config.tuning.dq_before_dk
        # Unmasked, non-deterministic: rotated walks (docstring: grid and work split). Measured
        # on the H200 (docs/performance.md, "rotated query-block walks"): d128 non-causal +3-6 %;
        # the sm80 kernel lost 1-3 % with the same change and keeps the plain walk.
        self.rotate = not (config.deterministic or config.causal or config.local)

    def pipeline_protocol(self) -> dict:
        """The mbarrier pipelines of the class docstring, as (stages, then the TMA bytes of a
        stage and the consumer-warp arrivals, or the producer-lane and consumer-thread
        arrivals), checked against the tiles while tracing (after ``__call__`` set the
        transaction bytes)."""
        consumer_threads = self.num_consumers * WARPGROUP
        consumer_warps = consumer_threads // 32
        tm, d, dv, tn = self.tile_m, self.tile_hdim, self.tile_hdimv, self.tile_n
        width = self.dtype.width // 8
        # A TMA stage completes on the bytes of its boxes: K and V of tile_n keys, Q / dO of
        # tile_m rows (tile_m 80: two (80, 64) boxes of 10 KiB each).
        assert self.tx_kv == tn * (d + dv) * width and self.tx_q == tm * d * width
        assert self.tx_do == tm * dv * width
        # One LSE / delta row a lane and pass: every row of the block has a lane.
        assert -(-tm // 32) * 32 >= tm and self.q_stages >= 1
        return {
            "kv": (1, self.tx_kv, consumer_warps),
            "q": (self.q_stages, self.tx_q, consumer_warps),
            "do": (self.q_stages, self.tx_do, consumer_warps),
            "lse": (self.q_stages, 32, consumer_threads),
        }

    def query_block(self, i: Int32, m_block_min: Int32, m_block_max: Int32) -> Int32:
        """The i-th query block a CTA visits (``visited_query_block``: downward in deterministic
        mode; ``self.rotate``: key block n's walk rotated by n blocks, ``rotated_query_block``).
        Producer warps 0 and 1 and both consumers walk the same order."""
        if cutlass.const_expr(self.rotate):
            n_block = bwd_block_coords(self.deterministic, self.causal)[0]
            count = m_block_max - m_block_min  # > 0: i < count
            return rotated_query_block(i, m_block_min, m_block_max, n_block % count)
        return visited_query_block(i, m_block_min, m_block_max, self.deterministic)

    def make_tiled_mmas(self) -> tuple[cute.TiledMma, cute.TiledMma, cute.TiledMma]:
        """(S^T and dP^T: SS; dV and dK: A from registers, B MN-major; dQ: SS, B MN-major), one
        warpgroup each. Fresh ones in every step (a TiledMma whose ACCUMULATE field was set in
        one staged region cannot be reused in another)."""
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        mma_sdp = self.make_mma_sdp()
        mma_dkv = self.make_mma_dkv(self.dk_cols)
        if cutlass.const_expr(self.dq_transposed):
            # dQ^T = K^T dS^T: A = the consumer's columns of sK viewed transposed (MN-major),
            # B = sdS as it is (K-major), N = tile_m (80).
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, mn_major, k_major, Float32, (1, 1, 1),
                (64, self.tile_m),
            )  # fmt: skip
            return mma_sdp, mma_dkv, mma_dq
        mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, mn_major, Float32, (1, 1, 1),
            (64, self.dq_cols),  # tile_m = 128 by columns: two M atoms a step
        )  # fmt: skip
        return mma_sdp, mma_dkv, mma_dq

    def make_mma_sdp(self) -> cute.TiledMma:
        """S^T / dP^T (64 keys x tile_m queries, both operands in smem, K-major)."""
        k_major = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, k_major, Float32, (1, 1, 1), (WG_KEYS, self.tile_m)
        )

    def make_mma_dkv(self, cols: int) -> cute.TiledMma:
        """dK (cols = dk_cols) or dV (cols = dv_cols) += (64 keys x tile_m) A from registers
        times a B operand MN-major in smem; dK's is the middle one of make_tiled_mmas."""
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, mn_major, Float32, (1, 1, 1), (WG_KEYS, cols),
            warpgroup.OperandSource.RMEM,
        )  # fmt: skip

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
        dq_rows, dq_cols = self.dq_rows, self.dq_cols
        # TMA views: (seqlen, d, heads, batch).
        mQ_t, mK_t, mV_t, mdO_t = (
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mV, mdO)
        )
        mdQ_t = cute.make_tensor(mdQaccum.iterator, cute.select(mdQaccum.layout, mode=[2, 3, 1, 0]))
        mma_sdp, mma_dkv, mma_dq = self.make_tiled_mmas()
        # sK / sV: the K-major A operand of S^T / dP^T (M = keys); sQ / sdO: the K-major B
        # operand of S^T / dP^T (N = query rows); sdS: the K-major A operand of dQ.
        # The dQ GEMM reads sK in column halves of d / 2 (and with split_d the dV / dK GEMMs
        # read sQ / sdO in halves): their swizzle atom must not be wider than a half (d 96: 48
        # columns, 32-byte atoms; d 192: 96 columns, 64-byte atoms).
        sK_layout = k_major_layout(self.dtype, (tn, d, 1), dq_cols)
        sV_layout = k_major_layout(self.dtype, (tn, dv, 1), self.dv_cols)
        sQ_layout = k_major_layout(self.dtype, (tm, d, self.q_stages), self.dk_cols)
        sdO_layout = k_major_layout(self.dtype, (tm, dv, self.q_stages), self.dv_cols)
        sdS_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (tm, d, tn), self.dtype, self.ds_buffers
        )
        # sP (split d): one 16-bit P^T tile, laid out as one sdS buffer; otherwise a token
        # field of 8 elements.
        sP_layout, sp_elems, sp_align = None, 8, 16
        if cutlass.const_expr(self.split_d):
            sP_layout = sm90_utils.make_smem_layout_a(
                LayoutEnum.ROW_MAJOR, (tm, d, tn), self.dtype, 1
            )
            sp_elems, sp_align = cute.cosize(sP_layout), 1024
        # sdQ: fp32 (tm, d / 2) per consumer (the last mode), the source of the TMA reduce-add;
        # dq_by_rows: (tm / 2, d). The TMA atom gets consumer 0's tile by cute.select: with
        # tm = 80 (a column-block stride of 2560 elements) cute.slice_ of this swizzled fp32
        # layout aborts the process inside the DSL (the offset of stage 0 is 0 either way).
        sdQ_layout = sm90_utils.make_smem_layout_epi(
            Float32, LayoutEnum.ROW_MAJOR, (dq_rows, dq_cols), self.num_consumers
        )
        sK_tile = cute.slice_(sK_layout, (None, None, 0))
        sV_tile = cute.slice_(sV_layout, (None, None, 0))
        sQ_tile = cute.slice_(sQ_layout, (None, None, 0))
        sdO_tile = cute.slice_(sdO_layout, (None, None, 0))
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(load, mK_t, sK_tile, (tn, d))
        tma_v, mV_tma = cpasync.make_tiled_tma_atom(load, mV_t, sV_tile, (tn, dv))
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(load, mQ_t, sQ_tile, (tm, d))
        tma_do, mdO_tma = cpasync.make_tiled_tma_atom(load, mdO_t, sdO_tile, (tm, dv))
        tma_dq, mdQ_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQ_t,
            cute.select(sdQ_layout, mode=[0, 1]), (dq_rows, dq_cols),
        )  # fmt: skip
        self.tx_kv = cute.size_in_bytes(self.dtype, sK_tile) + cute.size_in_bytes(
            self.dtype, sV_tile
        )
        self.tx_q = cute.size_in_bytes(self.dtype, sQ_tile)
        self.tx_do = cute.size_in_bytes(self.dtype, sdO_tile)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_lse: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.q_stages], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.q_stages], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, sp_elems], sp_align]

        # The CTA's shared memory fits the target (``bwd_smem_bytes``, what can_implement
        # counts, is this within the 1024-byte alignment of the tiles: the struct rounds up to
        # it). tile_m 80: 231,680 counted, a struct of 232,448 bytes, all 227 KiB of sm_90a
        # (as three Q / dO stages at d 128, which ran on the H200).
        assert SharedStorage.size_in_bytes() <= SMEM_CAPACITY[self.config.target]
        assert SharedStorage.size_in_bytes() <= bwd_smem_bytes(self.config) + 1024
        # dK / dV stores: 16 bytes a thread, one warpgroup over a (64, d) tile.
        copy_r2g = row_store_copy(self.dtype, WARPGROUP, self.dk_cols)  # dK; dV: consume
        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)
        batch = cute.size(mQ.shape[0])
        if cutlass.const_expr(mCuSeqlensQ is not None):
            batch = mCuSeqlensQ.shape[0] - 1
        grid = bwd_grid(cute.ceil_div(max_seqlen_k, tn), cute.size(mQ.shape[2]), batch,
                        self.deterministic, self.causal)  # fmt: skip
        self.kernel(
            mQ_tma, mK_tma, mV_tma, mdO_tma, mdQ_tma, mQ, mK, mLSE, mdPsum, mdK, mdV,
            mdQsemaphore, tma_q, tma_k, tma_v, tma_do, tma_dq, softmax_scale, score_scale,
            scale_log2, window_left, window_right, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ,
            mSeqUsedK, sK_layout, sV_layout, sQ_layout, sdO_layout, sdS_layout, sdQ_layout,
            sP_layout, mma_sdp, mma_dkv, mma_dq,
            copy_r2g, SharedStorage,
        ).launch(grid=grid, block=[WARPGROUP * (1 + self.num_consumers), 1, 1], stream=stream,
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
        mdO_tma: cute.Tensor,
        mdQ_tma: cute.Tensor,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdQsemaphore: cute.Tensor | None,
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
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout | None,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        copy_r2g: cute.TiledCopy,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        n_block, head, batch = bwd_block_coords(self.deterministic, self.causal)
        tm, tn = self.tile_m, self.tile_n

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        protocol = self.pipeline_protocol()
        pipeline_kv = tma_pipeline(storage.mbar_kv, *protocol["kv"])
        pipeline_q = tma_pipeline(storage.mbar_q, *protocol["q"])
        pipeline_do = tma_pipeline(storage.mbar_do, *protocol["do"])
        pipeline_lse = thread_pipeline(storage.mbar_lse, *protocol["lse"])
        pipes = {"kv": pipeline_kv, "q": pipeline_q, "do": pipeline_do, "lse": pipeline_lse}
        for name, (stages, *_) in protocol.items():
            assert pipes[name].num_stages == stages, name
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sP = None
        if cutlass.const_expr(self.split_d):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)[None, None, 0]
        lse_layout = cute.make_layout((tm, self.q_stages))
        sLSE = storage.sLSE.get_tensor(lse_layout)
        sdPsum = storage.sdPsum.get_tensor(lse_layout)

        offset_q, seqlen_q, offset_k, seqlen_k = seqlen_info(
            batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK
        )
        # A key block past this sequence's keys (varlen: the grid covers the longest): no work.
        if n_block * tn < seqlen_k:
            # Query blocks that see any key of this block (Note [bottom-right aligned masks]).
            m_block_min, m_block_max = query_block_range(
                n_block, seqlen_q, seqlen_k, window_left, window_right, tm, tn, self.causal,
                self.local,
            )  # fmt: skip
            head_kv = head // (mQ.shape[2] // mK.shape[2])
            # Varlen tensors have one batch entry; a sequence starts at its cu_seqlens row.
            qb = 0 if cutlass.const_expr(mCuSeqlensQ is not None) else batch
            kb = 0 if cutlass.const_expr(mCuSeqlensK is not None) else batch
            mask_args = MaskArgs(seqlen_q, seqlen_k, Window(window_left, window_right))
            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(self.regs_producer)
                if warp_idx == 0:
                    self.load(
                        cute.domain_offset((offset_q, 0), mQ_tma[None, None, head, qb]),
                        cute.domain_offset((offset_q, 0), mdO_tma[None, None, head, qb]),
                        cute.domain_offset((offset_k, 0), mK_tma[None, None, head_kv, kb]),
                        cute.domain_offset((offset_k, 0), mV_tma[None, None, head_kv, kb]),
                        cute.domain_offset((offset_q,), mLSE[qb, head, None]),
                        cute.domain_offset((offset_q,), mdPsum[qb, head, None]),
                        tma_q, tma_do, tma_k, tma_v, sQ, sdO, sK, sV, sLSE, sdPsum,
                        pipeline_kv, pipeline_q, pipeline_do, pipeline_lse,
                        n_block, m_block_min, m_block_max, seqlen_q,
                    )  # fmt: skip
                elif warp_idx == 1:
                    det = cutlass.const_expr(self.deterministic)
                    sem = mdQsemaphore[batch, head, None] if det else None
                    self.reduce_dq(
                        cute.domain_offset((offset_q, 0), mdQ_tma[None, None, head, qb]),
                        tma_dq, sdQ, sem, n_block, m_block_min, m_block_max, mask_args,
                    )  # fmt: skip
            else:
                cute.arch.setmaxregister_increase(self.regs_consumer)
                consumer = wg_idx - 1
                key_start = n_block * tn
                if cutlass.const_expr(not self.split_d):
                    key_start += consumer * WG_KEYS
                self.consume(
                    cute.domain_offset((offset_k, 0), mdK[kb, None, head, None]),
                    cute.domain_offset((offset_k, 0), mdV[kb, None, head, None]),
                    sQ, sdO, sK, sV, sdS, sdQ, sLSE, sdPsum, sP,
                    pipeline_kv, pipeline_q, pipeline_do, pipeline_lse,
                    mma_sdp, mma_dkv, mma_dq, copy_r2g,
                    consumer, tidx % WARPGROUP, key_start, mask_args,
                    m_block_min, m_block_max, softmax_scale,
                    ScoreScales(score_scale, scale_log2),
                )  # fmt: skip

    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,
        mdO: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        tma_q: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        sQ: cute.Tensor,
        sdO: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sLSE: cute.Tensor,
        sdPsum: cute.Tensor,
        pipeline_kv: pipeline.PipelineTmaAsync,
        pipeline_q: pipeline.PipelineTmaAsync,
        pipeline_do: pipeline.PipelineTmaAsync,
        pipeline_lse: pipeline.PipelineAsync,
        n_block: Int32,
        m_block_min: Int32,
        m_block_max: Int32,
        seqlen_q: Int32,
    ):
        """Producer warp: K and V once, then Q, dO (TMA) and LSE, delta (lanes) of every
        visited query block. mQ / mdO / mK / mV: (seqlen, d) TMA coordinate tensors of this
        (head, batch); mLSE / mdPsum: (seqlen_q,) fp32."""
        tm, tn, d = self.tile_m, self.tile_n, self.tile_hdim
        lane = cute.arch.lane_idx()

        def part(atom, s, g):
            return cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
            )

        tKsK, tKgK = part(tma_k, sK, cute.local_tile(mK, (tn, d), (None, 0)))
        dv = self.tile_hdimv
        tVsV, tVgV = part(tma_v, sV, cute.local_tile(mV, (tn, dv), (None, 0)))
        tQsQ, tQgQ = part(tma_q, sQ, cute.local_tile(mQ, (tm, d), (None, 0)))
        tdOsdO, tdOgdO = part(tma_do, sdO, cute.local_tile(mdO, (tm, dv), (None, 0)))
        for atom in (tma_q, tma_do, tma_k, tma_v):
            cpasync.prefetch_descriptor(atom)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipeline_kv.producer_acquire(kv_state)
        bar = pipeline_kv.producer_get_barrier(kv_state)
        cute.copy(tma_k, tKgK[None, n_block], tKsK[None, 0], tma_bar_ptr=bar)
        cute.copy(tma_v, tVgV[None, n_block], tVsV[None, 0], tma_bar_ptr=bar)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        for i in cutlass.range(m_block_max - m_block_min, unroll=1):
            m_block = self.query_block(i, m_block_min, m_block_max)
            pipeline_q.producer_acquire(state)
            cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, state.index],
                      tma_bar_ptr=pipeline_q.producer_get_barrier(state))  # fmt: skip
            pipeline_do.producer_acquire(state)
            cute.copy(tma_do, tdOgdO[None, m_block], tdOsdO[None, state.index],
                      tma_bar_ptr=pipeline_do.producer_get_barrier(state))  # fmt: skip
            # LSE in log2 units and delta of the block's rows, a row a lane (``stage_lse_row``).
            pipeline_lse.producer_acquire(state)
            for r in cutlass.range_constexpr(-(-tm // 32)):
                row = r * 32 + lane
                lse_args = (mLSE, mdPsum, sLSE, sdPsum, m_block, row, state.index, seqlen_q)
                if cutlass.const_expr((r + 1) * 32 > tm):  # tile_m 80: rows 64..79, lanes 0..15
                    if row < tm:
                        self.stage_lse_row(*lse_args)
                else:
                    self.stage_lse_row(*lse_args)
            pipeline_lse.producer_commit(state)
            state.advance()

    @cute.jit
    def stage_lse_row(
        self,
        mLSE: cute.Tensor,
        mdPsum: cute.Tensor,
        sLSE: cute.Tensor,
        sdPsum: cute.Tensor,
        m_block: Int32,
        row: Int32,
        stage: Int32,
        seqlen_q: Int32,
    ):
        """Producer warp 0: LSE in log2 units and delta of one row of the block into the stage;
        rows past seqlen_q and rows that saw no key in the forward (LSE = -inf) get +inf: P = 0
        there."""
        tm = self.tile_m
        lse_log2 = Float32.inf
        dpsum = Float32(0.0)
        if m_block * tm + row < seqlen_q:
            lse_log2 = lse_for_recompute(mLSE[m_block * tm + row])
            dpsum = mdPsum[m_block * tm + row]
        sLSE[row, stage] = lse_log2
        sdPsum[row, stage] = dpsum

    @cute.jit
    def reduce_dq(
        self,
        mdQ: cute.Tensor,
        tma_dq: cute.CopyAtom,
        sdQ: cute.Tensor,
        mdQsemaphore: cute.Tensor | None,
        n_block: Int32,
        m_block_min: Int32,
        m_block_max: Int32,
        mask_args: MaskArgs,
    ):
        """Producer warp 1: for every visited query block, each consumer's half of dQ from sdQ
        into dQaccum with a TMA reduce-add (docstring: warp roles, warp 1). mdQ: (seqlen_q, d) TMA
        coordinate tensor of this (head, batch); the TMA clips rows past seqlen_q.
        mdQsemaphore: (query blocks,) int32 of this (batch, head), deterministic mode only: the
        block's two reduce-adds wait for its turn and pass it on (docstring: deterministic)."""
        gdQ = cute.local_tile(mdQ, (self.dq_rows, self.dq_cols), (None, None))
        tdQsdQ, tdQgdQ = cpasync.tma_partition(
            tma_dq, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
            cute.group_modes(gdQ, 0, 2),
        )  # fmt: skip
        cpasync.prefetch_descriptor(tma_dq)
        n_blocks = m_block_max - m_block_min
        for i in cutlass.range(n_blocks, unroll=1):
            m_block = self.query_block(i, m_block_min, m_block_max)
            if cutlass.const_expr(self.deterministic):
                # Before the consumers' dQ is there: the spin overlaps their GEMMs.
                turn = dq_turn(m_block, n_block, mask_args.seqlen_q, mask_args.seqlen_k,
                               mask_args.window.left, self.tile_m, self.tile_n,
                               self.local)  # fmt: skip
                wait_dq_turn(mdQsemaphore, m_block, turn)
            for c in cutlass.range_constexpr(self.num_consumers):
                dq_barrier(Barrier.DQ_FULL_WG1, c).arrive_and_wait()
                # Consumer c's part: its column half of the block, or (dq_by_rows) its rows.
                if cutlass.const_expr(self.dq_by_rows):
                    gdQ_c = tdQgdQ[None, m_block * self.num_consumers + c, 0]
                else:
                    gdQ_c = tdQgdQ[None, m_block, c]
                cute.copy(tma_dq, tdQsdQ[None, c], gdQ_c)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()
                # The consumer waits for this only before its next block's dQ.
                if i < n_blocks - 1:
                    dq_barrier(Barrier.DQ_EMPTY_WG1, c).arrive()
            if cutlass.const_expr(self.deterministic):
                pass_dq_turn(mdQsemaphore, m_block)
        cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def consume(
        self,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        sQ: cute.Tensor,
        sdO: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sdS: cute.Tensor,
        sdQ: cute.Tensor,
        sLSE: cute.Tensor,
        sdPsum: cute.Tensor,
        sP: cute.Tensor | None,
        pipeline_kv: pipeline.PipelineTmaAsync,
        pipeline_q: pipeline.PipelineTmaAsync,
        pipeline_do: pipeline.PipelineTmaAsync,
        pipeline_lse: pipeline.PipelineAsync,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        copy_r2g: cute.TiledCopy,
        consumer: Int32,
        tidx: Int32,
        key_start: Int32,
        mask_args: MaskArgs,
        m_block_min: Int32,
        m_block_max: Int32,
        softmax_scale: Float32,
        scales: ScoreScales,
    ):
        """Consumer warpgroup: dK and dV of its 64 keys over every visited query block, its
        part of dQ of each block, then the dK / dV stores."""
        d, dv, kc, vc = self.tile_hdim, self.tile_hdimv, self.dk_cols, self.dv_cols
        # This consumer's keys: its 64 rows of sK / sV, or (split_d) all 64 of the CTA.
        key_slot = 0 if cutlass.const_expr(self.split_d) else consumer
        sK_c = cute.local_tile(sK[None, None, 0], (WG_KEYS, d), (key_slot, 0))
        sV_c = cute.local_tile(sV[None, None, 0], (WG_KEYS, dv), (key_slot, 0))
        mma_dv = self.make_mma_dkv(vc)
        thr_dk = mma_dkv.get_slice(tidx)
        thr_dv = mma_dv.get_slice(tidx)
        acc_dK = thr_dk.make_fragment_C(thr_dk.partition_shape_C((WG_KEYS, kc)))
        acc_dV = thr_dv.make_fragment_C(thr_dv.partition_shape_C((WG_KEYS, vc)))
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        keys_left = mask_args.seqlen_k - key_start
        cta_keys_left = keys_left + key_slot * WG_KEYS

        pipeline_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                               1))  # fmt: skip
        if cutlass.const_expr(self.config.seqused_k):
            # Not under ``if keys_left < WG_KEYS``: every thread of the consumer(s) reaches the
            # KV_TAIL barrier at one instruction (nothing to zero when all keys are valid).
            valid = cutlass.min(cutlass.max(keys_left, 0), WG_KEYS)
            self.zero_kv_tail(sK_c, sV_c, valid, consumer, tidx)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        # dQ: this consumer's d / 2 columns of K (dq_by_rows: all d; all tile_n keys), its half
        # of sdQ.
        dq_col_slot = 0 if cutlass.const_expr(self.dq_by_rows) else consumer
        sK_dq = cute.local_tile(sK[None, None, 0], (self.tile_n, self.dq_cols),
                                (0, dq_col_slot))  # fmt: skip
        smem = ConsumerSmem(sQ, sdO, sK_c, sV_c, sdS, sK_dq, sdQ[None, None, consumer], sLSE,
                            sdPsum, sP)  # fmt: skip
        pipes = ConsumerPipelines(pipeline_q, pipeline_do, pipeline_lse)
        for i in cutlass.range(m_block_max - m_block_min, unroll=1):
            m_block = self.query_block(i, m_block_min, m_block_max)
            args = (m_block, i, state, smem, pipes, acc_dK, acc_dV, consumer, tidx,
                    key_start, mask_args, scales)  # fmt: skip
            if cutlass.const_expr(self.causal or self.local):
                self.step(*args, True)
            else:
                # Without causal only keys past seqlen_k need the mask. The choice is the
                # CTA's (its tile_n keys), not this consumer's 64: both consumers then run the
                # same code to DS_READY, an aligned bar.sync that every thread of the CTA taking
                # part must reach at one instruction (per consumer, the consumer whose keys are
                # all valid reached another copy of it in the tail CTA: synccheck "divergent
                # thread(s) in block").
                if cta_keys_left < self.tile_n:
                    self.step(*args, True)
                else:
                    self.step(*args, False)
            state.advance()

        # Epilogue: dK carries the softmax scale (dS is w.r.t. the scaled scores). Only this
        # consumer reads its rows of sV, but both read all of sK (dQ): a DS_READY barrier,
        # which each consumer reaches after its last dQ GEMM completed, comes first.
        pipeline.NamedBarrier(
            barrier_id=int(Barrier.DS_READY), num_threads=self.num_consumers * WARPGROUP
        ).arrive_and_wait()
        acc_dK.store(acc_dK.load() * softmax_scale)
        # Its dK / dV columns (all d, or split_d its half) of its keys, staged in sK / sV.
        col_slot = consumer if cutlass.const_expr(self.split_d) else 0
        sdK = cute.local_tile(sK_c, (WG_KEYS, kc), (0, col_slot))
        sdV = cute.local_tile(sV_c, (WG_KEYS, vc), (0, col_slot))
        acc_to_smem(acc_dK, mma_dkv, sdK, tidx)
        acc_to_smem(acc_dV, mma_dv, sdV, tidx)
        pipeline.NamedBarrier(
            barrier_id=int(Barrier.EPILOGUE_WG1) + consumer, num_threads=WARPGROUP
        ).arrive_and_wait()
        copy_r2g_v = copy_r2g
        if cutlass.const_expr(vc != kc):
            copy_r2g_v = row_store_copy(self.dtype, WARPGROUP, vc)
        for m, s, cols, copy in ((mdK, sdK, kc, copy_r2g), (mdV, sdV, vc, copy_r2g_v)):
            g = cute.local_tile(cute.domain_offset((key_start, 0), m), (WG_KEYS, cols),
                                (0, col_slot))  # fmt: skip
            store_rows(s, g, keys_left, copy, tidx)

    @cute.jit
    def zero_kv_tail(
        self, sK_c: cute.Tensor, sV_c: cute.Tensor, valid: Int32, consumer: Int32, tidx: Int32
    ):
        """seqused_k: zero this consumer's K and V rows [valid, 64) (loaded, never released).
        Called by every consumer thread of every CTA (valid = 64: nothing to zero), never under
        a branch on seqlen_k: the KV_TAIL barrier is an aligned ``bar.sync``, which all of its
        threads must reach at the same instruction (before, only a consumer whose keys cut
        seqlen_k entered it, from a branch on the per-thread load of seqused_k[b]).

        Rows between seqused_k and the end of the tensor (or sequence) are not inputs and may
        hold NaN; their scores are masked (P = 0), but 0 * NaN in dP^T = V dO^T and in
        dQ = dS K would spread. S^T / dP^T read only this consumer's rows (its own barrier
        KV_TAIL_WG1 + c orders the zeros before them); the other consumer reads them in its dQ
        GEMM only after the block's DS_READY barrier, which this consumer reaches later.
        """
        # split_d: both consumers share the rows; they zero them together and both wait.
        threads = WARPGROUP * (self.num_consumers if cutlass.const_expr(self.split_d) else 1)
        first = consumer * WARPGROUP + tidx if cutlass.const_expr(self.split_d) else tidx
        zero_rows_from(sK_c, valid, first, threads)
        zero_rows_from(sV_c, valid, first, threads)
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes, WGMMA reads
        barrier = int(Barrier.KV_TAIL_WG1) + (0 if cutlass.const_expr(self.split_d) else consumer)
        pipeline.NamedBarrier(barrier_id=barrier, num_threads=threads).arrive_and_wait()

    @cute.jit
    def zero_q_tail(
        self,
        sQ: cute.Tensor,
        sdO: cute.Tensor,
        pipeline_q: pipeline.PipelineTmaAsync,
        pipeline_do: pipeline.PipelineTmaAsync,
        state: pipeline.PipelineState,
        valid: Int32,
        consumer: Int32,
        tidx: Int32,
    ):
        """seqused_q: zero the Q and dO rows [valid, tile_m) of this stage, half by each
        consumer, before either issues a GEMM on it (barrier Q_TAIL, both consumers: they
        visit the same blocks, and only the block holding seqlen_q takes this path). Rows past
        seqused_q may hold NaN; their P and dS are 0, but 0 * NaN in the GEMMs would spread.
        The TMA writes of the stage have landed (waited here; the step's own wait then passes
        at once)."""
        pipeline_q.consumer_wait(state)
        pipeline_do.consumer_wait(state)
        threads = self.num_consumers * WARPGROUP
        for s in (sQ, sdO):
            zero_rows_from(s[None, None, state.index], valid, consumer * WARPGROUP + tidx, threads)
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(barrier_id=int(Barrier.Q_TAIL), num_threads=threads).arrive_and_wait()

    @cute.jit
    def score_gemm(
        self,
        pipe: pipeline.PipelineTmaAsync,
        state: pipeline.PipelineState,
        acc: cute.Tensor,
        tA: cute.Tensor,
        tB: cute.Tensor,
    ):
        """Wait for ``pipe``'s stage of ``state``, then issue acc = A B^T (S^T = K_c Q^T or
        dP^T = V_c dO^T, zero-initialized) as one commit group. A fresh TiledMma each call: its
        ACCUMULATE field is set inside the staged region that issues it."""
        pipe.consumer_wait(state)
        warpgroup.fence()
        gemm_over_k(self.make_mma_sdp(), acc, tA, tB, zero_init=True, b_stage=state.index)
        warpgroup.commit_group()

    @cute.jit
    def probabilities(
        self,
        S: cute.Tensor,
        tScS: cute.Tensor,
        sLSE: cute.Tensor,
        stage: Int32,
        m_block: Int32,
        key_start: Int32,
        mask_args: MaskArgs,
        scale_log2: Float32,
        masked: cutlass.Constexpr[bool],
    ):
        """S (the (query, key) view of S^T, softcapped already) -> P in place: the mask where
        ``masked``, then P = exp2(S * scale_log2 - LSE_log2[query])."""
        if cutlass.const_expr(masked):
            apply_mask(S, tScS, m_block * self.tile_m, key_start, mask_args.seqlen_q,
                       mask_args.seqlen_k, mask_args.window.left, mask_args.window.right,
                       self.causal, self.local)  # fmt: skip
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            lse_log2 = sLSE[tScS[r, 0][0], stage]
            S[r, None].store(
                cute.math.exp2(S[r, None].load() * scale_log2 - lse_log2, fastmath=True)
            )

    @cute.jit
    def score_gradients(
        self,
        S: cute.Tensor,
        dP: cute.Tensor,
        tScS: cute.Tensor,
        sLSE: cute.Tensor,
        sdPsum: cute.Tensor,
        stage: Int32,
        scale_log2: Float32,
    ):
        """dP (the (query, key) view of dP^T) -> dS = P (dP - delta[query]) in place, P in S
        (fp32, or 16-bit: split d's P^T from sP); split d with softcap also times 1 - tanh^2,
        tanh recovered from P."""
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            dpsum = sdPsum[tScS[r, 0][0], stage]
            p = S[r, None].load().to(Float32)
            ds = p * (dP[r, None].load() - dpsum)
            if cutlass.const_expr(self.has_softcap and self.split_d):
                # Split d has no registers for a 1 - tanh^2 tile (d 256 spilled): tanh is
                # recovered from P = exp2(tanh * scale_log2 - LSE_log2) and clamped to [-1, 1]
                # (P = 0, masked or underflowed: -1, and dS = 0 anyway).
                lse_log2 = sLSE[tScS[r, 0][0], stage]
                # A row whose LSE is +inf (no key, or past seqlen_q) has P = 0: no inf - inf.
                lse_log2 = Float32(0.0) if lse_log2 == Float32.inf else lse_log2
                t = (cute.math.log2(p, fastmath=True) + lse_log2) * (1.0 / scale_log2)
                one = cute.full_like(t, 1.0)
                t = cute.clamp(t, -one, one)
                ds = ds * (1.0 - t * t)
            dP[r, None].store(ds)

    @cute.jit
    def step(
        self,
        m_block: Int32,
        i: Int32,
        state: pipeline.PipelineState,
        smem: ConsumerSmem,
        pipes: ConsumerPipelines,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        consumer: Int32,
        tidx: Int32,
        key_start: Int32,
        mask_args: MaskArgs,
        scales: ScoreScales,
        masked: cutlass.Constexpr[bool],
    ):
        """Query block m_block (the i-th visited) against this consumer's 64 keys (docstring:
        per query block)."""
        tm = self.tile_m
        sQ, sdO, sK_c, sV_c, sdS, sK_dq, sdQ_c, sLSE, sdPsum, sP = smem
        pipeline_q, pipeline_do, pipeline_lse = pipes
        mma_sdp, mma_dkv, mma_dq = self.make_tiled_mmas()
        stage = state.index
        ds_buffer = i % self.ds_buffers
        if cutlass.const_expr(self.config.seqused_q):
            rows_left = mask_args.seqlen_q - m_block * tm
            if rows_left < tm:
                self.zero_q_tail(sQ, sdO, pipeline_q, pipeline_do, state, rows_left, consumer,
                                 tidx)  # fmt: skip

        # S^T = K_c Q^T and dP^T = V_c dO^T (keys x queries). Split d: consumer 0 computes S^T
        # and consumer 1 dP^T of the CTA's 64 keys (docstring: split d).
        thr_sdp = mma_sdp.get_slice(tidx)
        tSrK = thr_sdp.make_fragment_A(thr_sdp.partition_A(sK_c))
        tSrV = thr_sdp.make_fragment_A(thr_sdp.partition_A(sV_c))
        tSrQ = thr_sdp.make_fragment_B(thr_sdp.partition_B(sQ))
        tSrdO = thr_sdp.make_fragment_B(thr_sdp.partition_B(sdO))
        acc_S = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((WG_KEYS, tm)))
        acc_dP = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C((WG_KEYS, tm)))
        if cutlass.const_expr(not self.split_d):
            self.score_gemm(pipeline_q, state, acc_S, tSrK, tSrQ)
            self.score_gemm(pipeline_do, state, acc_dP, tSrV, tSrdO)
            pipeline_lse.consumer_wait(state)

        # (query, key) views of the transposed tiles: rows are queries, columns keys, so the
        # shared apply_mask sees the usual orientation.
        def qk_view(t: cute.Tensor) -> cute.Tensor:
            return transposed(mn_view_wgmma(t))

        ident = cute.make_identity_tensor((tm, WG_KEYS))
        tScS = qk_view(thr_sdp.partition_C(transposed(ident)))
        S = qk_view(acc_S)
        dP = qk_view(acc_dP)
        score_scale, scale_log2 = scales

        # P^T and dS^T as 16-bit registers, the A operands of dV += P^T dO and dK += dS^T Q.
        rP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((WG_KEYS, tm)), self.dtype)
        rdS = cute.make_rmem_tensor(thr_sdp.partition_shape_C((WG_KEYS, tm)), self.dtype)
        mma_dv = self.make_mma_dkv(self.dv_cols)
        thr_dk, thr_dv = mma_dkv.get_slice(tidx), mma_dv.get_slice(tidx)
        sdO_c, sQ_c = sdO, sQ
        if cutlass.const_expr(self.split_d):  # this consumer's columns of dV / dK
            sdO_c = cute.local_tile(sdO, (tm, self.dv_cols, self.q_stages), (0, consumer, 0))
            sQ_c = cute.local_tile(sQ, (tm, self.dk_cols, self.q_stages), (0, consumer, 0))
        tdVrdO = thr_dv.make_fragment_B(thr_dv.partition_B(transposed(sdO_c)))
        tdKrQ = thr_dk.make_fragment_B(thr_dk.partition_B(transposed(sQ_c)))
        tdVrP = acc_as_rs_operand(rP)
        tdKrdS = acc_as_rs_operand(rdS)
        # dS^T goes to this consumer's columns of sdS (queries x keys, K-major for the dQ GEMM:
        # keys contiguous, so stmatrix transposes); split d, P^T to sP the same way.
        sdS_m = sdS[None, None, ds_buffer]
        key_slot = 0 if cutlass.const_expr(self.split_d) else consumer
        sdS_c = cute.local_tile(sdS_m, (tm, WG_KEYS), (0, key_slot))
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype),
            mma_sdp,
        )
        thr_r2s = r2s.get_slice(tidx)
        ds_ready = pipeline.NamedBarrier(
            barrier_id=int(Barrier.DS_READY), num_threads=self.num_consumers * WARPGROUP
        )
        if cutlass.const_expr(self.split_d):
            # Consumer 0: S^T -> P^T (registers and sP); consumer 1: dP^T, P^T from sP, dS^T
            # (registers and sdS); after DS_READY both read dS^T back; then both issue
            # dV and dK. No WGMMA is in flight across the branches (ptxas would serialize every
            # WGMMA). sP is rewritten (next block) only after this block's DS_READY, which
            # consumer 1 reaches after reading it.
            s2r = cute.make_tiled_copy_C(
                cute.make_copy_atom(LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                    self.dtype),
                mma_sdp,
            )  # fmt: skip
            thr_s2r = s2r.get_slice(tidx)
            p_ready = pipeline.NamedBarrier(
                barrier_id=int(Barrier.P_READY), num_threads=self.num_consumers * WARPGROUP
            )
            if consumer == 0:
                self.score_gemm(pipeline_q, state, acc_S, tSrK, tSrQ)
                pipeline_lse.consumer_wait(state)
                warpgroup.wait_group(0)
                if cutlass.const_expr(self.has_softcap):  # tanh is recovered from P for dS
                    softcap_scores(acc_S, score_scale, derivative=False)
                self.probabilities(S, tScS, sLSE, stage, m_block, key_start, mask_args,
                                   scale_log2, masked)  # fmt: skip
                convert_in_chunks(rP, acc_S)
                cute.copy(r2s, thr_r2s.retile(rP), thr_r2s.partition_D(transposed(sP)))
                p_ready.arrive()
                pipeline_lse.consumer_release(state)
            else:
                self.score_gemm(pipeline_do, state, acc_dP, tSrV, tSrdO)
                pipeline_lse.consumer_wait(state)
                p_ready.arrive_and_wait()
                cute.copy(s2r, thr_s2r.partition_S(transposed(sP)), thr_s2r.retile(rP))
                warpgroup.wait_group(0)
                self.score_gradients(qk_view(rP), dP, tScS, sLSE, sdPsum, stage, scale_log2)
                convert_in_chunks(rdS, acc_dP)
                cute.copy(r2s, thr_r2s.retile(rdS), thr_r2s.partition_D(transposed(sdS_c)))
                cute.arch.fence_view_async_shared()
                pipeline_lse.consumer_release(state)
            # One DS_READY for both consumers, after the branches join: an aligned bar.sync
            # is reached by all of its threads at one instruction (synccheck). Both read dS^T
            # back (consumer 1 its own stores): rdS is then defined on one path, not by a
            # branch (which made ptxas serialize every WGMMA).
            ds_ready.arrive_and_wait()
            cute.copy(s2r, thr_s2r.partition_S(transposed(sdS_c)), thr_s2r.retile(rdS))
            pipeline_q.consumer_wait(state)
            pipeline_do.consumer_wait(state)
            warpgroup.fence()
            gemm_over_k(mma_dv, acc_dV, tdVrP, tdVrdO, zero_init=False, b_stage=stage)
            gemm_over_k(mma_dkv, acc_dK, tdKrdS, tdKrQ, zero_init=False, b_stage=stage)
            warpgroup.commit_group()
        else:
            warpgroup.wait_group(1)
            dtanh = None
            if cutlass.const_expr(self.has_softcap):  # dS is multiplied by dtanh below
                dtanh = softcap_scores(acc_S, score_scale, derivative=True)
            self.probabilities(S, tScS, sLSE, stage, m_block, key_start, mask_args, scale_log2,
                               masked)  # fmt: skip
            warpgroup.wait_group(0)
            self.score_gradients(S, dP, tScS, sLSE, sdPsum, stage, scale_log2)
            pipeline_lse.consumer_release(state)
            if cutlass.const_expr(self.has_softcap):
                acc_dP.store(acc_dP.load() * dtanh.load())
            convert_in_chunks(rP, acc_S)
            convert_in_chunks(rdS, acc_dP)
            warpgroup.fence()
            gemm_over_k(mma_dv, acc_dV, tdVrP, tdVrdO, zero_init=False, b_stage=stage)
            if cutlass.const_expr(not self.dq_before_dk):  # else dK goes out behind dQ
                gemm_over_k(mma_dkv, acc_dK, tdKrdS, tdKrQ, zero_init=False, b_stage=stage)
            warpgroup.commit_group()
            cute.copy(r2s, thr_r2s.retile(rdS), thr_r2s.partition_D(transposed(sdS_c)))
            cute.arch.fence_view_async_shared()
            ds_ready.arrive_and_wait()

        # dQ[:, half c] = dS K[:, half c] (all tile_n keys), issued behind dV and dK (or, with
        # dq_before_dk, behind dV alone); dq_by_rows: dQ[rows c] = dS[rows c] K.
        thr_dq = mma_dq.get_slice(tidx)
        sdS_dq = sdS_m
        if cutlass.const_expr(self.dq_by_rows):
            sdS_dq = cute.local_tile(sdS_m, (self.dq_rows, self.tile_n), (consumer, 0))
        # dQ as (A, B, the tile its accumulator covers): dS K or, transposed, K^T dS^T.
        sdQ_acc = sdQ_c
        if cutlass.const_expr(self.dq_transposed):
            tdQrA = thr_dq.make_fragment_A(thr_dq.partition_A(transposed(sK_dq)))
            tdQrB = thr_dq.make_fragment_B(thr_dq.partition_B(sdS_dq))
            sdQ_acc = transposed(sdQ_c)
        else:
            tdQrA = thr_dq.make_fragment_A(thr_dq.partition_A(sdS_dq))
            tdQrB = thr_dq.make_fragment_B(thr_dq.partition_B(transposed(sK_dq)))
        acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C(sdQ_acc.shape))
        assert cute.size(acc_dQ) * WARPGROUP == cute.size(sdQ_c)  # its part, once
        if cutlass.const_expr(self.split_d):
            # dQ's accumulator (d / 4 registers a thread: 48 or 64) fits only once dV and dK
            # have completed and their 16-bit P^T / dS^T registers are free.
            warpgroup.wait_group(0)
            pipeline_q.consumer_release(state)
            pipeline_do.consumer_release(state)
        warpgroup.fence()
        gemm_over_k(mma_dq, acc_dQ, tdQrA, tdQrB, zero_init=True)
        warpgroup.commit_group()
        if cutlass.const_expr(self.dq_before_dk):
            # dV complete: dO released; dK behind dQ; once dQ is complete it goes to sdQ (below)
            # while dK runs.
            # No fence: dK's registers (dS^T, acc_dK) are untouched since dQ's. dO is released
            # after dK's issue: released before it (a predicated arrive), dK's WGMMAs each took
            # their own warpgroup.arrive.
            warpgroup.wait_group(1)
            gemm_over_k(mma_dkv, acc_dK, tdKrdS, tdKrQ, zero_init=False, b_stage=stage)
            warpgroup.commit_group()
            pipeline_do.consumer_release(state)
            warpgroup.wait_group(1)
        else:
            if cutlass.const_expr(not self.split_d):
                warpgroup.wait_group(1)
                pipeline_q.consumer_release(state)
                pipeline_do.consumer_release(state)
            warpgroup.wait_group(0)

        # dQ half -> sdQ once producer warp 1's reduce of the previous block has read it.
        if i > 0:
            dq_barrier(Barrier.DQ_EMPTY_WG1, consumer).arrive_and_wait()
        # A thread's accumulator pairs are adjacent columns of dQ (8-byte stores); transposed,
        # adjacent rows of dQ, 128 bytes apart in sdQ (4-byte stores, conflict-free under the
        # 128-byte swizzle: docstring).
        dq_store_bits = 32 if cutlass.const_expr(self.dq_transposed) else 64
        r2s_dq = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                num_bits_per_copy=dq_store_bits),
            mma_dq,
        )  # fmt: skip
        thr_r2s_dq = r2s_dq.get_slice(tidx)
        cute.copy(r2s_dq, thr_r2s_dq.retile(acc_dQ), thr_r2s_dq.partition_D(sdQ_acc))
        cute.arch.fence_view_async_shared()
        dq_barrier(Barrier.DQ_FULL_WG1, consumer).arrive()
        if cutlass.const_expr(self.dq_before_dk):
            warpgroup.wait_group(0)  # dK complete
            pipeline_q.consumer_release(state)
