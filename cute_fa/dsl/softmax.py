"""Online softmax in base 2, shared by every forward kernel.

Note [base-2 online softmax]
----------------------------
Scores arrive unscaled (``s = q . k``). With ``scale_log2 = softmax_scale * log2(e)``, one FFMA
and one MUFU.EX2 give ``p = exp2(s * scale_log2 - m * scale_log2)``, which equals
``exp(scale * (s - m))``. The running row max ``m`` is kept unscaled; a row whose max is still
``-inf`` (every key masked so far) uses 0 in place of ``m * scale_log2`` so that no ``-inf - -inf``
NaN appears: its ``p`` are all ``exp2(-inf) = 0`` and its sum stays 0. The max of the unscaled
scores is the max of the scaled ones only for ``scale_log2 >= 0``: the interface runs a negative
softmax_scale on ``-q`` (Note [softmax_scale the kernels take] in cute_fa/checks.py). After
the first block the accumulator and the row sum are multiplied by ``exp2((m_old - m_new) *
scale_log2)`` every block (1 for rows whose max did not move; skipped only with a rescale
threshold, Note [rescale threshold]). At the end
``O / l`` normalises once, and ``lse = (m * scale_log2 + log2(l)) * ln(2)``; a row with ``l == 0``
saw no key and gets ``O = 0`` and ``lse = -inf``.

Accumulator views: an mma accumulator fragment has layout ((vals), MMA_M, MMA_N); ``mn_view``
regroups it as (rows, cols) of the thread's own elements so row loops are plain indexing. Each
row of an sm80 m16n8 accumulator lives in the 4 threads of a quad, so row reductions finish with
two butterfly shuffles (``quad_allreduce``). A WGMMA accumulator (sm90) stacks the same quad
pattern along N, so ``mn_view_wgmma`` gives the (rows, cols) view there and the same quad
reduction holds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


# Note [rescale threshold]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# With ``rescale_threshold`` t > 0 (log2 units; FA4 uses 8 for 16-bit inputs) a row keeps its
# running max m until a block's max exceeds it by more than t / scale_log2; until then the
# exponentials are taken against the stale m, so p <= 2^t (256 at t = 8: fine in fp32 sums and
# in bf16 / fp16 P), and O and the row sum need no rescale. The final O / l and the LSE
# (m * scale_log2 + log2 l) are exact for whatever m was used. Once a row's max has settled,
# blocks rarely move it by 2^t, so ``rescale`` (O *= factor, d / 2 multiplies a row-pair and
# thread on sm90) is skipped for the whole warp unless one of its rows moved.


# Note [exp2 on the FMA pipe]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# MUFU.EX2 runs 16 lanes a clock an SM (sm80, sm90). Where the exponentials of a block take
# about as many clocks as its GEMMs (head dim 64 on sm90 tensor cores), ``exp2_poly`` computes
# some of them on the FMA and integer pipes instead: 2^x = 2^j * 2^f with j = round(x) (adding
# and subtracting 1.5 * 2^23 rounds in fp32), f = x - j in [-0.5, 0.5], 2^f by a degree-3
# polynomial (3 FFMA; relative error 7.5e-5 on the interval, below the half ulp of bf16, 2e-3,
# and of fp16, 4.9e-4; coefficients fitted for the least maximum relative error), and j added
# to the exponent bits (one shift-and-add). 8 instructions in place of one MUFU.EX2. x is
# clamped at -126 so that the result stays a normal number; the input must be finite (masked
# -inf scores would give 2^-126, not 0), so only blocks without a mask take it.
EXP2_POLY = (0.9999280571937561, 0.6932609677314758, 0.2426111400127411, 0.0551716685295105)
ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: x + it rounds x to an integer in the low mantissa bits


@cute.jit
def exp2_poly(x: Float32) -> Float32:
    """2^x for finite x <= ~0 on the FMA and integer pipes (no MUFU); x < -126 gives 2^-126."""
    x = cute.arch.fmax(x, Float32(-126.0))
    t = x + Float32(ROUND_MAGIC)
    f = x - (t - Float32(ROUND_MAGIC))
    c0, c1, c2, c3 = EXP2_POLY
    p = cute.math.fma(cute.math.fma(cute.math.fma(Float32(c3), f, Float32(c2)), f, Float32(c1)),
                      f, Float32(c0))  # fmt: skip
    bits = p.bitcast(Int32) + (t.bitcast(Int32) << 23)
    return bits.bitcast(Float32)


class ScoreScales(NamedTuple):
    """``score_scales``: what the raw scores are multiplied by before softcap's tanh
    (``score_scale``) and the exponent's scale (``scale_log2``)."""

    score_scale: Float32
    scale_log2: Float32


def score_scales(softmax_scale: Float32, softcap: Float32, has_softcap: bool) -> ScoreScales:
    """(score_scale, scale_log2) of Note [base-2 online softmax], softcap folded in.

    Without softcap the scores stay unscaled (score_scale = 1) and the exponent applies
    softmax_scale * log2(e). With softcap the scores become tanh(s * softmax_scale / softcap)
    (score_scale = softmax_scale / softcap), and the exponent needs only softcap * log2(e).
    """
    if has_softcap:
        return ScoreScales(softmax_scale / softcap, softcap * LOG2_E)
    return ScoreScales(Float32(1.0), softmax_scale * LOG2_E)


def softcap_scores(acc: cute.Tensor, score_scale: Float32, derivative: bool = False):
    """Softcap in place (``score_scales``): acc = tanh(acc * score_scale), before any mask
    (so -inf stays -inf), the softcap factor itself being in scale_log2. With ``derivative``
    (the backwards) also returns 1 - tanh^2, an fp32 fragment like acc, that dS is multiplied
    by; else None. Runs at trace time on a register fragment of any MMA layout."""
    t = cute.math.tanh(acc.load() * score_scale, fastmath=True)
    acc.store(t)
    if not derivative:
        return None
    dtanh = cute.make_fragment_like(acc, Float32)
    dtanh.store(1.0 - t * t)
    return dtanh


@cute.jit
def lse_for_recompute(lse: Float32) -> Float32:
    """The forward's LSE (natural log) in log2 units, for recomputing P = exp2(S * scale_log2 -
    LSE_log2) in a backward; a row that saw no key (LSE = -inf) gets +inf, so its P is 0."""
    return Float32.inf if lse == -Float32.inf else lse * LOG2_E


def mn_view(acc: cute.Tensor) -> cute.Tensor:
    """((2, 2), MMA_M, MMA_N) accumulator (sm80 m16n8 C layout) -> ((2, MMA_M), (2, MMA_N)).

    Mode 0 of the C fragment is (column pair, row pair); rows are (row pair, MMA_M) and columns
    (column pair, MMA_N).
    """
    shape = acc.layout.shape
    stride = acc.layout.stride
    layout = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[2])),
        stride=((stride[0][1], stride[1]), (stride[0][0], stride[2])),
    )
    return cute.make_tensor(acc.iterator, layout)


def mn_view_wgmma(acc: cute.Tensor) -> cute.Tensor:
    """((2, 2, N/8), MMA_M, MMA_N) accumulator (sm90 WGMMA C layout) -> ((2, MMA_M), ((2, N/8),
    MMA_N)).

    Mode 0 of a WGMMA C fragment is (column pair, row pair, group of 8 columns); each thread
    holds 2 rows of a 64-row atom (8 apart) and 2 adjacent columns of every 8.
    """
    shape = acc.layout.shape
    stride = acc.layout.stride
    layout = cute.make_layout(
        ((shape[0][1], shape[1]), ((shape[0][0], shape[0][2]), shape[2])),
        stride=((stride[0][1], stride[1]), ((stride[0][0], stride[0][2]), stride[2])),
    )
    return cute.make_tensor(acc.iterator, layout)


@cute.jit
def quad_allreduce(val: Float32, op: cutlass.Constexpr) -> Float32:
    """Reduce over the 4 threads of a quad (lanes 4i..4i+3) that share an accumulator row."""
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=2))
    val = op(val, cute.arch.shuffle_sync_bfly(val, offset=1))
    return val


def _fmax(a, b):
    return cute.arch.fmax(a, b)


def _add(a, b):
    return a + b


@cute.jit
def update_max(
    m_prev: Float32,
    m_cur: Float32,
    scale_log2: Float32,
    is_first: cutlass.Constexpr[bool],
    check_inf: cutlass.Constexpr[bool],
    rescale_threshold: cutlass.Constexpr[float],
):
    """One row's step of Note [base-2 online softmax], shared by every arch (``OnlineSoftmax``
    in the sm80 / sm90 kernels after the quad's max reduction; the sm100 softmax warps, one
    thread a row). The row's new running max from the old one and this block's max: (m_new,
    m_scaled, factor), with m_scaled = m_new * scale_log2 (0 for a row still at -inf when
    ``check_inf``) the exponent's offset, and factor = 2^(m_prev * scale_log2 - m_scaled) what
    O and the row sum are multiplied by (1 on the first block). With ``rescale_threshold`` t > 0
    the max moves only by more than t log2 units (Note [rescale threshold]) and the factor is
    exactly 1 when it stays, which lets a warp skip its O rescale (a vote)."""
    m_new = m_cur
    if cutlass.const_expr(not is_first):
        if cutlass.const_expr(rescale_threshold > 0):
            # (m_prev = -inf: moves to any m_cur; both -inf: NaN > t is False, stays.)
            moved = (m_cur - m_prev) * scale_log2 > rescale_threshold
            m_new = m_cur if moved else m_prev
        else:
            m_new = cute.arch.fmax(m_prev, m_cur)
    m_scaled = m_new * scale_log2
    if cutlass.const_expr(check_inf):
        m_scaled = 0.0 if m_new == -Float32.inf else m_scaled
    factor = Float32(1.0)
    if cutlass.const_expr(not is_first):
        factor = cute.math.exp2(m_prev * scale_log2 - m_scaled, fastmath=True)
        if cutlass.const_expr(rescale_threshold > 0):
            factor = factor if moved else Float32(1.0)  # exactly 1: the rescale is skipped
    return m_new, m_scaled, factor


@cute.jit
def finalize_row(row_max: Float32, row_sum: Float32, scale_log2: Float32):
    """(1 / row_sum, natural-log LSE) of a finished row; a row that saw no key (row_sum 0)
    gets 0 and -inf, so its O is 0 (Note [base-2 online softmax])."""
    empty = row_sum == 0.0
    inv = 0.0 if empty else cute.arch.rcp_approx(row_sum)
    lse = (
        -Float32.inf
        if empty
        else (row_max * scale_log2 + cute.math.log2(row_sum, fastmath=True)) * LN_2
    )
    return Float32(inv), Float32(lse)


class OnlineSoftmax:
    """Running max and sum of the rows a thread holds (Note [base-2 online softmax]).

    ``view`` maps an accumulator fragment to its (rows, cols) view: ``mn_view`` (sm80 mma.sync,
    the default) or ``mn_view_wgmma`` (sm90 WGMMA).
    """

    def __init__(
        self, scale_log2: Float32, num_rows: int, view=mn_view, rescale_threshold: float = 0.0
    ):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.view = view
        # > 0: Note [rescale threshold]; 0: the max follows every new row max.
        self.rescale_threshold = rescale_threshold
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    @cute.jit
    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(
        self,
        acc_S: cute.Tensor,
        acc_O: cute.Tensor | None,
        is_first: cutlass.Constexpr[bool],
        check_inf: cutlass.Constexpr[bool],
        corr: cute.Tensor | None = None,
        poly_every: cutlass.Constexpr[int] = 0,
    ):
        """Turn scores ``acc_S`` into probabilities in place and rescale ``acc_O``.

        ``check_inf``: rows may still be fully masked (-inf max); needed on masked blocks.
        With ``corr`` (num_rows fp32), ``acc_O`` is not touched (it may be None): each row's
        rescale factor goes to ``corr`` instead (1 on the first block), for ``rescale`` once an
        O GEMM still in flight has completed. ``poly_every`` k > 0: every k-th exponential of
        a thread's row by ``exp2_poly`` (Note [exp2 on the FMA pipe]; finite scores only, so
        not with masked scores).
        """
        S = self.view(acc_S)
        if cutlass.const_expr(corr is None):
            o_mn = self.view(acc_O)
        for r in cutlass.range_constexpr(self.num_rows):
            row = S[r, None].load()
            m_cur = quad_allreduce(row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0), _fmax)
            m_prev = self.row_max[r]
            m_new, m_scaled, corr_r = update_max(
                m_prev, m_cur, self.scale_log2, is_first, check_inf, self.rescale_threshold
            )
            if cutlass.const_expr(poly_every > 0):
                # Every poly_every-th column on the FMA pipe (exp2_poly), the rest on MUFU.
                S[r, None].store(row * self.scale_log2 - m_scaled)
                for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
                    if cutlass.const_expr(c % poly_every == poly_every - 1):
                        S[r, c] = exp2_poly(S[r, c])
                    else:
                        S[r, c] = cute.math.exp2(S[r, c], fastmath=True)
                p = S[r, None].load()
            else:
                p = cute.math.exp2(row * self.scale_log2 - m_scaled, fastmath=True)
                S[r, None].store(p)
            row_sum = p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            if cutlass.const_expr(not is_first):
                row_sum = row_sum + self.row_sum[r] * corr_r
                if cutlass.const_expr(corr is None):
                    o_mn[r, None].store(o_mn[r, None].load() * corr_r)
                else:
                    corr[r] = corr_r
            elif cutlass.const_expr(corr is not None):
                corr[r] = Float32(1.0)
            self.row_max[r] = m_new
            self.row_sum[r] = row_sum

    @cute.jit
    def rescale(self, acc_O: cute.Tensor, corr: cute.Tensor):
        """Multiply each row of ``acc_O`` by its factor from ``step(..., corr=corr)``; with a
        rescale threshold, only when a row of the warp has a factor other than 1."""
        o_mn = self.view(acc_O)
        if cutlass.const_expr(self.rescale_threshold > 0):
            moved = corr[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, self.num_rows):
                moved = moved | (corr[r] != Float32(1.0))
            if cute.arch.vote_any_sync(moved):
                for r in cutlass.range_constexpr(self.num_rows):
                    o_mn[r, None].store(o_mn[r, None].load() * corr[r])
        else:
            for r in cutlass.range_constexpr(self.num_rows):
                o_mn[r, None].store(o_mn[r, None].load() * corr[r])

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, lse: cute.Tensor):
        """Normalise ``acc_O`` by the row sums; write each row's natural-log LSE to ``lse``."""
        o_mn = self.view(acc_O)
        for r in cutlass.range_constexpr(self.num_rows):
            row_sum = quad_allreduce(self.row_sum[r], _add)
            inv, lse[r] = finalize_row(self.row_max[r], row_sum, self.scale_log2)
            o_mn[r, None].store(o_mn[r, None].load() * inv)
