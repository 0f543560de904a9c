"""The combine kernel of split-KV attention (sm80 and newer): merges the partial outputs and
LSEs of the key splits into one output and LSE, row by row. Memory-bound: plain vector loads,
no tensor cores, so one kernel serves every architecture from sm80 up (compiled for the
device's own target). Its compile key (``CombineConfig``) is in the DSL-free ``support.py``."""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from cute_fa.dsl.fake import fake_int32_vector

from .support import COMBINE_VEC, CombineConfig, combine_can_implement

# Element types of the partial outputs and of the output, by name (CombineConfig's dtypes).
COMBINE_DTYPES = {"fp32": cutlass.Float32, "bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def _threads_per_row(num_vecs: int, cap: int = 8) -> int:
    """The largest power of two up to ``cap`` dividing a row's count of vectors."""
    tpr = 1
    while tpr < cap and num_vecs % (2 * tpr) == 0:
        tpr *= 2
    return tpr


def _fake_rows(dtype, shape_rank: int, head_dim: int | None):
    """A fake tensor of ``shape_rank`` dynamic modes (then ``head_dim``, contiguous, when
    given): strides dynamic, multiples of COMBINE_VEC where a head dim follows."""
    shape = tuple(cute.sym_int() for _ in range(shape_rank))
    if head_dim is None:
        stride = tuple(cute.sym_int() for _ in range(shape_rank))
        return make_fake_tensor(dtype, shape, stride, assumed_align=4)
    stride = tuple(cute.sym_int(divisibility=COMBINE_VEC) for _ in range(shape_rank))
    return make_fake_tensor(dtype, (*shape, head_dim), (*stride, 1), assumed_align=16)


class FlashAttentionCombine:
    """out, lse of attention from the outputs and LSEs of key splits (split-KV).

    Protocol, per (batch b, row m, head h), with S splits, out_s = mO_partial[s, b, m, h, :]
    (each normalized by its own softmax sum) and lse_s = mLSE_partial[s, b, m, h] (natural log):
      lse = log(sum_s exp(lse_s)), computed max-shifted: M = max_s lse_s (M = 0 when every
        lse_s is -inf), lse = M + log(sum_s exp(lse_s - M)); splits with lse_s = -inf (no key)
        contribute 0; every lse_s = -inf gives lse = -inf and out = 0, never NaN.
      out = sum_s exp(lse_s - lse) * out_s, accumulated in fp32, written in mO's element type.
      The exponentials and the logarithm run in base 2 (MUFU.EX2 / MUG.LG2, scaled by log2 e).
      Splits with lse_s = -inf are not read at all (their out_s may hold anything).
    Rows past seqused[b] (seqused given) are neither read nor written: the caller decides
      what they hold. With cu_seqlens (varlen, only with seqused; the tensors' batch extent is 1),
      row m of the packed tensor belongs to the sequence b with cu_seqlens[b] <= m <
      cu_seqlens[b + 1] (a binary search) and counts when m - cu_seqlens[b] < seqused[b].
    Arguments (``fake_args``): mO_partial (S, B, Sq, H, D) of dtype_partial, mLSE_partial
      (S, B, Sq, H) fp32, mO (B, Sq, H, D), mLSE (B, Sq, H) fp32 or None, mCuSeqlens (B' + 1,)
      and mSeqused (B',) int32 or None, stream. D contiguous; every other stride of the D-wide
      tensors a multiple of 4 elements and their pointers 16-byte aligned; LSE strides free.
    Grid (ceil(Sq * H / rows_per_cta), B), 128 threads: a row (m, h), numbered heads fastest (so
      one CTA's rows are neighbours in a (b, m, h, d) tensor), is read in 4-element vectors by
      ``tpr`` neighbouring lanes (tpr the largest power of two up to 8 dividing D / 4; each lane
      takes D / (4 tpr) vectors), rows_per_cta = 128 / tpr. Every lane of a row reads the row's
      S LSEs itself (the same addresses: broadcast loads), so no lane waits on another.
    """

    arch = 80
    num_threads = 128

    def __init__(self, config: CombineConfig):
        ok, reason = combine_can_implement(config)
        if not ok:
            raise NotImplementedError(f"FlashAttentionCombine: {reason}")
        self.config = config
        self.dtype_partial = COMBINE_DTYPES[config.dtype_partial]
        self.dtype = COMBINE_DTYPES[config.dtype]
        self.head_dim = config.head_dim
        self.num_vecs = config.head_dim // COMBINE_VEC
        self.tpr = _threads_per_row(self.num_vecs)
        self.vecs_per_thread = self.num_vecs // self.tpr
        self.rows_per_cta = self.num_threads // self.tpr

    can_implement = staticmethod(combine_can_implement)

    @staticmethod
    def fake_args(config: CombineConfig) -> tuple:
        """Arguments of ``__call__`` for ``cute.compile`` (dynamic extents and strides)."""
        return (
            _fake_rows(COMBINE_DTYPES[config.dtype_partial], 4, config.head_dim),
            _fake_rows(Float32, 4, None),
            _fake_rows(COMBINE_DTYPES[config.dtype], 3, config.head_dim),
            _fake_rows(Float32, 3, None) if config.has_lse else None,
            fake_int32_vector() if config.varlen else None,
            fake_int32_vector() if config.seqused else None,
            make_fake_stream(),
        )

    @cute.jit
    def __call__(
        self,
        mO_partial: cute.Tensor,
        mLSE_partial: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        mCuSeqlens: cute.Tensor | None,
        mSeqused: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        rows = mO.shape[1] * mO.shape[2]
        grid = (cute.ceil_div(rows, self.rows_per_cta), cute.size(mO.shape[0]), 1)
        self.kernel(mO_partial, mLSE_partial, mO, mLSE, mCuSeqlens, mSeqused).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.jit
    def row_is_used(
        self, batch: Int32, m: Int32, mCuSeqlens: cute.Tensor | None, mSeqused: cute.Tensor | None
    ):
        """Whether row ``m`` of batch ``batch`` is below its sequence's seqused (True without
        seqused)."""
        used = True
        if cutlass.const_expr(mSeqused is not None):
            if cutlass.const_expr(mCuSeqlens is not None):
                # The sequence of packed row m: the last b with cu_seqlens[b] <= m (binary
                # search over the powers of two; cu_seqlens is non-decreasing).
                num_seqs = cute.size(mSeqused.shape[0])
                seq = Int32(0)
                for k in cutlass.range_constexpr(30, -1, -1):
                    probe = seq + (1 << k)
                    if probe < num_seqs:
                        if mCuSeqlens[probe] <= m:
                            seq = probe
                used = m - mCuSeqlens[seq] < mSeqused[seq]
            else:
                used = m < mSeqused[batch]
        return used

    @cute.kernel
    def kernel(
        self,
        mO_partial: cute.Tensor,
        mLSE_partial: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        mCuSeqlens: cute.Tensor | None,
        mSeqused: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, batch, _ = cute.arch.block_idx()
        vec, tpr = COMBINE_VEC, self.tpr
        num_heads = mO.shape[2]
        idx = block * self.rows_per_cta + tidx // tpr
        lane = tidx % tpr  # this thread's place among its row's lanes
        m = idx // num_heads
        head = idx - m * num_heads
        num_splits = mLSE_partial.shape[0]
        if m < mO.shape[1]:
            if self.row_is_used(batch, m, mCuSeqlens, mSeqused):
                lse_row = mLSE_partial[None, batch, m, head]  # (S,)
                # Max of the splits' LSEs in log2 units; 0 when every split is empty.
                lse_max = -Float32.inf
                for s in cutlass.range(num_splits, unroll=1):
                    lse_max = cute.arch.fmax(lse_max, lse_row[s] * LOG2_E)
                shift = 0.0 if lse_max == -Float32.inf else lse_max
                total = Float32(0.0)
                for s in cutlass.range(num_splits, unroll=1):
                    total += cute.math.exp2(lse_row[s] * LOG2_E - shift, fastmath=True)
                # total == 0 (every split empty): log2 gives -inf, and so does lse.
                lse_log2 = cute.math.log2(total, fastmath=True) + shift
                acc = cute.make_rmem_tensor((vec, self.vecs_per_thread), Float32)
                acc.fill(0.0)
                if lse_log2 != -Float32.inf:
                    for s in cutlass.range(num_splits, unroll=4):
                        lse_s = lse_row[s]
                        if lse_s != -Float32.inf:  # an empty split is not read
                            weight = cute.math.exp2(lse_s * LOG2_E - lse_log2, fastmath=True)
                            o_row = mO_partial[s, batch, m, head, None]
                            for j in cutlass.range_constexpr(self.vecs_per_thread):
                                part = cute.local_tile(o_row, (vec,), (lane + j * tpr,))
                                r = cute.make_fragment_like(part)
                                cute.autovec_copy(part, r)
                                acc[None, j].store(
                                    acc[None, j].load() + weight * r.load().to(Float32)
                                )
                out_row = mO[batch, m, head, None]
                for j in cutlass.range_constexpr(self.vecs_per_thread):
                    r = cute.make_rmem_tensor((vec,), self.dtype)
                    r.store(acc[None, j].load().to(self.dtype))
                    cute.autovec_copy(r, cute.local_tile(out_row, (vec,), (lane + j * tpr,)))
                if cutlass.const_expr(mLSE is not None):
                    if lane == 0:
                        mLSE[batch, m, head] = lse_log2 * LN_2
