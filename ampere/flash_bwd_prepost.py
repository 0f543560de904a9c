"""sm80 backward pre- and postprocess kernels: delta = rowsum(dO * O) with the dQ accumulator's
zero-fill, and the scaled cast of the dQ accumulator to the input dtype.

Both are memory-bound elementwise passes: every global access is 128 bits a thread, rows are
predicated against the tensor's own row count (the packed total for varlen), so neither kernel
needs sequence metadata. Their compile keys (``BwdPreConfig``, ``BwdPostConfig``) and fake
arguments live here, next to the kernels they describe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_stream

from cute_fa.config import DTYPES
from cute_fa.dsl.copy import widen_cols
from cute_fa.dsl.fake import DTYPE, fake_accum, fake_int32_vector, fake_lse, fake_qkv
from cute_fa.dsl.seqlen import seqlen_info

from .copy import smem_layout, store_acc
from .flash_bwd import dq_tiled_mma
from .support import dq_accum_offset

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class BwdPreConfig:
    """Compile key of the backward preprocess kernel (delta and the dQ accumulator zero-fill)."""

    arch: int
    target: str
    dtype: str
    # The dQ accumulator's columns: Q's head dim, or for the sm80 backward its tile head dim
    # (Note [rounded head dims] in cute_fa/config.py).
    head_dim: int
    head_dim_v: int  # of O and dO: the rows delta sums
    has_dlse: bool = False  # delta -= dLSE (the gradient flowing into the returned LSE)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"BwdPreConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")

    def replace(self, **changes) -> BwdPreConfig:
        return dataclasses.replace(self, **changes)

    @property
    def name(self) -> str:
        dv = "" if self.head_dim_v == self.head_dim else f"x{self.head_dim_v}"
        dlse = "_dlse" if self.has_dlse else ""
        return f"bwdpre_sm{self.arch}_{self.target}_{self.dtype}_d{self.head_dim}{dv}{dlse}"


@dataclass(frozen=True)
class BwdPostConfig:
    """Compile key of the backward postprocess kernel (dQ = dQaccum * scale, cast).

    ``tile_m`` = 0: dQaccum is row-major (the sm90 backward's). ``tile_m`` > 0: it is in the
    fragment order of the sm80 backward's dQ MMA for (tile_m, num_warps), and ``varlen_q`` says
    whether sequences are packed (Note [dQ accumulator in fragment order] in
    ``ampere/support.py``); ``acc_head_dim`` is then its columns, the main kernel's tile head
    dim when that rounds ``head_dim`` up (Note [rounded head dims] in cute_fa/config.py; 0:
    ``head_dim``)."""

    arch: int
    target: str
    dtype: str
    head_dim: int  # of dQ
    tile_m: int = 0
    num_warps: int = 0
    varlen_q: bool = False
    acc_head_dim: int = 0

    @property
    def acc_cols(self) -> int:
        """Columns of dQaccum."""
        return self.acc_head_dim or self.head_dim

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"BwdPostConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")

    def replace(self, **changes) -> BwdPostConfig:
        return dataclasses.replace(self, **changes)

    @property
    def name(self) -> str:
        order = f"_frag{self.tile_m}w{self.num_warps}" if self.tile_m else ""
        acc = f"_acc{self.acc_cols}" if self.acc_cols != self.head_dim else ""
        varlen = "_varlen" if self.varlen_q else ""
        return (f"bwdpost_sm{self.arch}_{self.target}_{self.dtype}_d{self.head_dim}{order}{acc}"
                f"{varlen}")  # fmt: skip


def _check_dim(dim: int, what: str) -> str:
    if dim <= 0 or dim % 8 != 0 or dim > MAX_HEAD_DIM:
        return f"{what} {dim} is not a positive multiple of 8 up to {MAX_HEAD_DIM}"
    return ""


def _threads_per_row(num_chunks: int, cap: int) -> int:
    """Threads sharing one row: the largest power of two up to ``cap`` dividing ``num_chunks``
    (the row's count of 128-bit chunks), so every thread of a row holds whole chunks."""
    tpr = 1
    while tpr < cap and num_chunks % (2 * tpr) == 0:
        tpr *= 2
    return tpr


def _row_copy(dtype, num_threads: int, width: int, chunk: int, cap: int) -> cute.TiledCopy:
    """Tiled copy of rows ``width`` elements wide, ``chunk`` consecutive elements (128 bits of
    ``dtype``, or several 128-bit accesses) a thread at a time, a row spread over up to ``cap``
    neighbouring lanes."""
    tpr = _threads_per_row(width // chunk, cap)
    thr_layout = cute.make_layout((num_threads // tpr, tpr), stride=(tpr, 1))
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, chunk)))


class FlashAttentionBackwardPreprocessSm80:
    """delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] (fp32), minus dLSE[b, h, i] when
    given, and dQaccum[b, h, i, :] = 0: everything the main backward kernel needs zeroed or
    precomputed per query row.

    Grid: (ceil(rows / tile_m), heads, batch), with rows = dQaccum.shape[2] (at least O's rows,
    the packed total for varlen, whose batch dim is 1; more where the sm80 backward pads it).
    One CTA of 128 threads handles tile_m rows of one (head, batch): a row of O / dO is read as
    128-bit chunks by ``tpr`` neighbouring lanes (tpr a power of two up to 8), each lane sums
    its products in fp32 and ``log2(tpr)`` butterfly shuffles finish the row; the row's first
    lane stores delta. The same CTA writes zeros over its rows of dQaccum with 128-bit stores.
    Rows past a tensor's end are neither read nor written.
    """

    arch = 80
    num_threads = 128
    tile_m = 64

    def __init__(self, config: BwdPreConfig):
        ok, reason = self.can_implement(config)
        if not ok:
            raise NotImplementedError(f"FlashAttentionBackwardPreprocessSm80: {reason}")
        self.config = config
        self.dtype = DTYPE[config.dtype]
        self.head_dim = config.head_dim
        self.head_dim_v = config.head_dim_v
        self.has_dlse = config.has_dlse
        self.elems = 128 // self.dtype.width  # 16-bit elements in 128 bits
        self.tpr = _threads_per_row(config.head_dim_v // self.elems, 8)

    @staticmethod
    def can_implement(config: BwdPreConfig) -> tuple[bool, str]:
        if config.arch != 80:
            return False, f"config is for sm{config.arch}, this kernel is sm80"
        for dim, what in ((config.head_dim, "head_dim"), (config.head_dim_v, "head_dim_v")):
            reason = _check_dim(dim, what)
            if reason:
                return False, reason
        return True, ""

    @staticmethod
    def fake_args(config: BwdPreConfig) -> tuple:
        """Arguments of ``__call__`` for ``cute.compile`` (dynamic extents and strides):
        mO, mdO (b, s, h, dv), mdLSE (b, h, s) fp32 or None, mdPsum (b, h, s) fp32,
        mdQaccum (b, h, s, d) fp32, stream. Varlen: b = 1, s = total_q."""
        dtype = DTYPE[config.dtype]
        return (
            fake_qkv(dtype, config.head_dim_v),
            fake_qkv(dtype, config.head_dim_v),
            fake_lse() if config.has_dlse else None,
            fake_lse(),
            fake_accum(config.head_dim),
            make_fake_stream(),
        )

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mdLSE: cute.Tensor | None,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        stream: cuda.CUstream,
    ):
        copy_o = _row_copy(self.dtype, self.num_threads, self.head_dim_v, self.elems, 8)
        copy_acc = _row_copy(Float32, self.num_threads, self.head_dim, 4, 16)
        # dQaccum has at least O's rows (more when padded: Note [dQ accumulator in fragment
        # order]); the grid covers all of them.
        grid = (cute.ceil_div(mdQaccum.shape[2], self.tile_m), cute.size(mO.shape[2]), mO.shape[0])
        self.kernel(mO, mdO, mdLSE, mdPsum, mdQaccum, copy_o, copy_acc).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mdLSE: cute.Tensor | None,
        mdPsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        copy_o: cute.TiledCopy,
        copy_acc: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        tile_m, dv = self.tile_m, self.head_dim_v
        row0 = m_block * tile_m
        rows_left = mO.shape[1] - row0

        gO = cute.local_tile(mO[batch, None, head, None], (tile_m, dv), (m_block, 0))
        gdO = cute.local_tile(mdO[batch, None, head, None], (tile_m, dv), (m_block, 0))
        thr_o = copy_o.get_slice(tidx)
        tOgO = thr_o.partition_S(gO)
        tOgdO = thr_o.partition_S(gdO)
        tOcO = thr_o.partition_S(cute.make_identity_tensor((tile_m, dv)))
        mdPsum_cur = mdPsum[batch, head, None]

        for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            row = tOcO[0, m, 0][0]
            acc = Float32(0.0)
            if row < rows_left:
                rO = cute.make_fragment_like(tOgO[None, m, None], self.dtype)
                rdO = cute.make_fragment_like(tOgdO[None, m, None], self.dtype)
                cute.copy(copy_o, tOgO[None, m, None], rO)
                cute.copy(copy_o, tOgdO[None, m, None], rdO)
                prod = rO.load().to(Float32) * rdO.load().to(Float32)
                acc = prod.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            # Every lane shuffles (rows past the end hold 0): the butterfly covers a row's lanes.
            for i in cutlass.range_constexpr(self.tpr.bit_length() - 1):
                acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=self.tpr >> (i + 1))
            if tOcO[0, m, 0][1] == 0 and row < rows_left:
                if cutlass.const_expr(mdLSE is not None):
                    acc = acc - mdLSE[batch, head, row0 + row]
                mdPsum_cur[row0 + row] = acc

        d = self.head_dim
        gdQ = cute.local_tile(mdQaccum[batch, head, None, None], (tile_m, d), (m_block, 0))
        thr_acc = copy_acc.get_slice(tidx)
        tQgQ = thr_acc.partition_D(gdQ)
        tQcQ = thr_acc.partition_D(cute.make_identity_tensor((tile_m, d)))
        zeros = cute.make_fragment_like(tQgQ[None, 0, None], Float32)
        zeros.fill(0.0)
        acc_rows_left = mdQaccum.shape[2] - row0
        for m in cutlass.range_constexpr(cute.size(tQgQ.shape[1])):
            if tQcQ[0, m, 0][0] < acc_rows_left:
                cute.copy(copy_acc, zeros, tQgQ[None, m, None])


class FlashAttentionBackwardPostprocessSm80:
    """dQ[b, i, h, :] = (dQaccum[b, h, i', :] * softmax_scale).to(dtype).

    Rows (config.tile_m = 0, the sm90 backward's accumulator): i' = i. Grid: (ceil(rows / 64),
      heads, batch), rows = dQ.shape[1]. One CTA of 128 threads converts 64 rows of one (head,
      batch); each thread takes 8 consecutive elements at a time: two 128-bit fp32 loads and one
      128-bit 16-bit store. Rows past the end are skipped.
    Fragment order (config.tile_m > 0, the sm80 backward's): each tile_m x d block holds the dQ
      MMA's C fragments, value j of thread t at j * threads + t (Note [dQ accumulator in fragment
      order] in ``support``). Grid: (ceil(max_seqlen_q / tile_m), heads, batch or sequences), one
      CTA of the main kernel's num_warps warps per block: thread t loads its values (each load
      instruction of a warp reads 128 consecutive bytes), scales them, stages them in shared
      memory in the MMA's C layout and writes the block's rows below the sequence's length
      (from cu_seqlens: rows past seqused_q get the zeros that no key block added to) with
      128-bit stores. With varlen and seqused_q, max_seqlen_q may count only the used rows, so
      the caller zero-fills dQ for the blocks past it (``run_backward``).
    """

    arch = 80
    rows_threads = 128
    rows_tile_m = 64

    def __init__(self, config: BwdPostConfig):
        ok, reason = self.can_implement(config)
        if not ok:
            raise NotImplementedError(f"FlashAttentionBackwardPostprocessSm80: {reason}")
        self.config = config
        self.dtype = DTYPE[config.dtype]
        self.head_dim = config.head_dim
        self.acc_cols = config.acc_cols
        # dQ's column limit where the accumulator is wider (None: as wide).
        self.cols = None if self.acc_cols == self.head_dim else self.head_dim
        self.fragments = config.tile_m > 0
        if self.fragments:
            self.tile_m, self.num_threads = config.tile_m, 32 * config.num_warps
        else:
            self.tile_m, self.num_threads = self.rows_tile_m, self.rows_threads

    @staticmethod
    def can_implement(config: BwdPostConfig) -> tuple[bool, str]:
        if config.arch != 80:
            return False, f"config is for sm{config.arch}, this kernel is sm80"
        reason = _check_dim(config.head_dim, "head_dim")
        if reason:
            return False, reason
        if config.tile_m == 0 and (config.num_warps or config.varlen_q or config.acc_head_dim):
            return False, (
                "num_warps, varlen_q and acc_head_dim only go with a fragment order (tile_m > 0)"
            )
        acc = config.acc_cols
        if config.tile_m and (acc % 16 or config.tile_m % 16 or config.num_warps <= 0):
            return False, (
                f"fragment order needs head_dim and tile_m multiples of 16 and warps, got "
                f"{acc}, {config.tile_m}, {config.num_warps} warps"
            )
        if acc < config.head_dim or acc > MAX_HEAD_DIM:
            return False, f"acc_head_dim {acc} must hold head_dim {config.head_dim}, up to 256"
        return True, ""

    @staticmethod
    def fake_args(config: BwdPostConfig) -> tuple:
        """Arguments of ``__call__`` for ``cute.compile``: mdQaccum (b, h, s_acc, d) fp32,
        mdQ (b, s, h, d), softmax_scale: Float32, mCuSeqlensQ (sequences + 1,) int32 or None,
        max_seqlen_q: Int32, stream. Varlen: b = 1, s = total_q."""
        return (
            fake_accum(config.acc_cols),
            fake_qkv(DTYPE[config.dtype], config.head_dim),
            Float32(1.0),
            fake_int32_vector() if config.varlen_q else None,
            Int32(0),
            make_fake_stream(),
        )

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor | None,
        max_seqlen_q: Int32,
        stream: cuda.CUstream,
    ):
        copy_dq = _row_copy(self.dtype, self.num_threads, self.acc_cols, 8, 8)
        if cutlass.const_expr(self.fragments):
            mma_dq = dq_tiled_mma(self.dtype, self.tile_m, self.acc_cols, self.num_threads // 32)
            sdQ_layout = smem_layout(self.dtype, self.tile_m, self.acc_cols)
            batch = mdQ.shape[0]
            rows = mdQ.shape[1]
            if cutlass.const_expr(mCuSeqlensQ is not None):
                batch = mCuSeqlensQ.shape[0] - 1
                rows = max_seqlen_q
            grid = (cute.ceil_div(rows, self.tile_m), cute.size(mdQ.shape[2]), batch)
            self.kernel_fragments(
                mdQaccum, mdQ, softmax_scale, mCuSeqlensQ, mma_dq, sdQ_layout, copy_dq
            ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)
        else:
            copy_acc = _row_copy(Float32, self.num_threads, self.head_dim, 8, 8)
            grid = (cute.ceil_div(mdQ.shape[1], self.tile_m), cute.size(mdQ.shape[2]), mdQ.shape[0])
            self.kernel(mdQaccum, mdQ, softmax_scale, copy_acc, copy_dq).launch(
                grid=grid, block=[self.num_threads, 1, 1], stream=stream
            )

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        softmax_scale: Float32,
        copy_acc: cute.TiledCopy,
        copy_dq: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        tile_m, d = self.tile_m, self.head_dim
        rows_left = mdQ.shape[1] - m_block * tile_m

        gdQaccum = cute.local_tile(mdQaccum[batch, head, None, None], (tile_m, d), (m_block, 0))
        gdQ = cute.local_tile(mdQ[batch, None, head, None], (tile_m, d), (m_block, 0))
        thr_acc = copy_acc.get_slice(tidx)
        thr_dq = copy_dq.get_slice(tidx)
        tAgA = thr_acc.partition_S(gdQaccum)
        tQgQ = thr_dq.partition_D(gdQ)
        tQcQ = thr_dq.partition_D(cute.make_identity_tensor((tile_m, d)))
        for m in cutlass.range_constexpr(cute.size(tQgQ.shape[1])):
            if tQcQ[0, m, 0][0] < rows_left:
                rA = cute.make_fragment_like(tAgA[None, m, None], Float32)
                cute.copy(copy_acc, tAgA[None, m, None], rA)
                rQ = cute.make_fragment_like(tQgQ[None, m, None], self.dtype)
                rQ.store((rA.load() * softmax_scale).to(self.dtype))
                cute.copy(copy_dq, rQ, tQgQ[None, m, None])

    @cute.kernel
    def kernel_fragments(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor | None,
        mma_dq: cute.TiledMma,
        sdQ_layout: cute.ComposedLayout,
        copy_dq: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        tile_m, d = self.tile_m, self.acc_cols
        varlen = mCuSeqlensQ is not None
        # The sequence's rows from cu_seqlens alone (no seqused: the rows past it get zeros).
        offset_q, seqlen_q, _, _ = seqlen_info(batch, mdQ, mdQ, mCuSeqlensQ, None, None, None)
        rows_left = seqlen_q - m_block * tile_m
        if rows_left > 0:
            qb = 0 if cutlass.const_expr(varlen) else batch
            offset_acc = dq_accum_offset(offset_q, batch, tile_m, varlen)
            gAcc = cute.local_tile(
                cute.domain_offset((offset_acc, 0), mdQaccum[qb, head, None, None]),
                (tile_m, d), (m_block, 0),
            )  # fmt: skip
            thr_dq = mma_dq.get_slice(tidx)
            acc = cute.make_rmem_tensor(thr_dq.partition_shape_C((tile_m, d)), Float32)
            # This thread's values: the j-th (acc's linear index j) at j * threads + tidx.
            values = cute.size(acc)
            mine = cute.make_tensor(
                gAcc.iterator + tidx, cute.make_layout(values, stride=self.num_threads)
            )
            cute.autovec_copy(mine, cute.make_tensor(acc.iterator, cute.make_layout(values)))
            acc.store(acc.load() * softmax_scale)
            # dQ viewed as wide as the accumulator; only its own columns are stored.
            gdQ = cute.local_tile(
                cute.domain_offset((offset_q, 0), widen_cols(mdQ, d)[qb, None, head, None]),
                (tile_m, d), (m_block, 0),
            )  # fmt: skip
            smem = cutlass.memory.SmemAllocator()
            sdQ = smem.allocate_tensor(self.dtype, sdQ_layout, byte_alignment=1024)
            barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_threads)
            store_acc(acc, mma_dq, sdQ, gdQ, rows_left, copy_dq, barrier, tidx, self.cols)
