"""Fake (compile-time) arguments of the kernels, so they compile without tensors or a GPU.

Every extent except the head dims is a symbolic runtime value, so one compiled kernel serves any
batch, sequence length and head count. Strides are symbolic too (q/k/v may be views of a packed
qkv tensor), with the innermost stride fixed to 1 and the others divisible by 8 elements
(16 bytes), which the interface checks before every launch.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from ..config import FwdConfig, dq_accum_head_dim

DTYPE = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


def fake_qkv(dtype, head_dim: int):
    """(batch, seqlen, heads, head_dim) with dynamic extents and strides, 16-byte aligned."""
    shape = (cute.sym_int(), cute.sym_int(), cute.sym_int(), head_dim)
    stride = (
        cute.sym_int(64, divisibility=8),
        cute.sym_int(32, divisibility=8),
        cute.sym_int(32, divisibility=8),
        1,
    )
    return make_fake_tensor(dtype, shape, stride, assumed_align=16)


def fake_lse():
    """(batch, heads, seqlen) fp32, seqlen contiguous."""
    shape = (cute.sym_int(), cute.sym_int(), cute.sym_int())
    stride = (cute.sym_int(64), cute.sym_int(64), 1)
    return make_fake_tensor(cutlass.Float32, shape, stride, assumed_align=4)


def fake_int32_vector():
    return make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)


def fake_int32_matrix():
    """(rows, cols) int32, cols contiguous (a page table)."""
    shape = (cute.sym_int(), cute.sym_int())
    return make_fake_tensor(cutlass.Int32, shape, (cute.sym_int(), 1), assumed_align=4)


def fake_semaphores():
    """(batch, heads, blocks) int32, blocks contiguous."""
    shape = (cute.sym_int(), cute.sym_int(), cute.sym_int())
    stride = (cute.sym_int(), cute.sym_int(), 1)
    return make_fake_tensor(cutlass.Int32, shape, stride, assumed_align=4)


def fwd_fake_args(config: FwdConfig) -> tuple:
    """Arguments of ``kernel(...)`` for ``cute.compile``, in the order of the forward protocol.

    Forward protocol (every arch's forward kernel ``__call__`` takes exactly these):
      mQ   (b, sq, h, d)        varlen: (1, total_q, h, d)
      mK   (b, sk, h_kv, d)     varlen: (1, total_k, h_kv, d)
      mV   (b, sk, h_kv, dv)
      mO   (b, sq, h, dv)
      mLSE (b, h, sq) fp32      varlen: (1, h, total_q)
        split-KV (config.split_kv): mO fp32 (num_splits * b, sq, h, dv) and mLSE
        (num_splits * b, h, sq), split slowest (varlen: num_splits * 1); num_splits is
        mO.shape[0] // mQ.shape[0]
      softmax_scale: Float32, softcap: Float32 (ignored unless config.has_softcap),
      window_left: Int32, window_right: Int32 (ignored unless config.local),
      max_seqlen_q: Int32 (the longest query sequence; the grid has ceil(max_seqlen_q / tile_m)
        query blocks per (head, batch)),
      mCuSeqlensQ, mCuSeqlensK: (b + 1,) int32 or None,
      mSeqUsedQ, mSeqUsedK: (b,) int32 or None,
      mPageTable: (b, max_pages) int32 or None: paged K/V (config.page_size > 0); mK and mV
        are then (num_pages, page_size, h_kv, d / dv) and sequence b's key j lies in page
        mPageTable[b, j // page_size], row j % page_size,
      stream
    """
    dtype = DTYPE[config.dtype]
    return (
        fake_qkv(dtype, config.head_dim),
        fake_qkv(dtype, config.head_dim),
        fake_qkv(dtype, config.head_dim_v),
        fake_qkv(cutlass.Float32 if config.split_kv else dtype, config.head_dim_v),
        fake_lse(),
        cutlass.Float32(1.0),
        cutlass.Float32(0.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        fake_int32_vector() if config.varlen_q else None,
        fake_int32_vector() if config.varlen_k else None,
        fake_int32_vector() if config.seqused_q else None,
        fake_int32_vector() if config.seqused_k else None,
        fake_int32_matrix() if config.page_size else None,
        make_fake_stream(),
    )


def fake_accum(head_dim: int):
    """(batch, heads, seqlen, head_dim) fp32 accumulator, head_dim contiguous."""
    shape = (cute.sym_int(), cute.sym_int(), cute.sym_int(), head_dim)
    stride = (cute.sym_int(64, divisibility=4), cute.sym_int(64, divisibility=4),
              cute.sym_int(32, divisibility=4), 1)  # fmt: skip
    return make_fake_tensor(cutlass.Float32, shape, stride, assumed_align=16)


def bwd_fake_args(config) -> tuple:
    """Arguments of the main backward kernel for ``cute.compile``.

    Backward protocol (every arch's main backward kernel ``__call__`` takes exactly these):
      mQ   (b, sq, h, d)         varlen: (1, total_q, h, d)
      mK   (b, sk, h_kv, d)      mV (b, sk, h_kv, dv)
      mdO  (b, sq, h, dv)        (last dim contiguous)
      mLSE (b, h, sq) fp32       the forward's LSE (natural log); -inf for rows seeing no key
      mdPsum (b, h, sq) fp32     delta = rowsum(dO * O), from the preprocess kernel
      mdQaccum (b, h, sq, d) fp32 (sm80: sq padded to whole query blocks and d to the tile
               head dim, Note [rounded head dims]), zeroed before the launch; the kernel adds
               dS @ K (unscaled) into it atomically (sm90: TMA reduce-adds, which clip at sq
               rows); the postprocess multiplies by softmax_scale and casts
      mdK  (b, sk, h, d)         one slice per *query* head (GQA: the caller sums groups)
      mdV  (b, sk, h, dv)        the same; dK is written already multiplied by softmax_scale
      softmax_scale, softcap, window_left, window_right (as the forward),
      max_seqlen_k: Int32 (grid: ceil(max_seqlen_k / tile_n) key blocks per (head, batch)),
      mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
      mdQsemaphore (b, h, m_blocks) int32 zeroed, or None: with ``config.deterministic`` the
               CTAs of one (batch, head) add their dQ of a query block in key-block order,
               each waiting for the count of that block to reach its turn, then raising it
      stream
    """
    dtype = DTYPE[config.dtype]
    return (
        fake_qkv(dtype, config.head_dim),
        fake_qkv(dtype, config.head_dim),
        fake_qkv(dtype, config.head_dim_v),
        fake_qkv(dtype, config.head_dim_v),
        fake_lse(),
        fake_lse(),
        fake_accum(dq_accum_head_dim(config.arch, config.head_dim)),
        fake_qkv(dtype, config.head_dim),
        fake_qkv(dtype, config.head_dim_v),
        cutlass.Float32(1.0),
        cutlass.Float32(0.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        fake_int32_vector() if config.varlen_q else None,
        fake_int32_vector() if config.varlen_k else None,
        fake_int32_vector() if config.seqused_q else None,
        fake_int32_vector() if config.seqused_k else None,
        fake_semaphores() if config.deterministic else None,
        make_fake_stream(),
    )
