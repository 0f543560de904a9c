"""Sequence-length, causal and sliding-window masks, and which key blocks a query block visits.

Note [bottom-right aligned masks]
---------------------------------
As in flash_attn: with ``offset = seqlen_k - seqlen_q``, query row ``i`` sees key ``j`` iff
``i + offset - left <= j <= i + offset + right`` and ``j < seqlen_k``. Causal is ``right = 0``,
``left = inf``. Window bounds may be negative (a band shifted off the diagonal); unbounded sides
arrive as a large sentinel (``WINDOW_INF``). A query row that sees no key at all produces
``O = 0`` and ``LSE = -inf`` (see softmax.py).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

# Unbounded window side, small enough that ``row + offset +/- WINDOW_INF`` cannot overflow int32
# for any sequence shorter than 2**29.
WINDOW_INF = 1 << 29


class Window(NamedTuple):
    """Sliding-window sides (keys left and right of the diagonal); runtime values, WINDOW_INF
    for an unbounded side, ignored unless the kernel is compiled ``local``."""

    left: Int32
    right: Int32


class BlockRange(NamedTuple):
    """The key blocks of one query block (``block_range``): visited from ``n_max - 1`` down to
    ``n_min``; blocks at or above ``n_no_right`` may cut the seqlen_k tail or the causal / right
    window edge, blocks below ``n_no_left`` the left window edge (local only)."""

    n_min: Int32
    n_max: Int32
    n_no_right: Int32
    n_no_left: Int32


@cute.jit
def key_blocks_without_right_mask(
    row_start: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    right: Int32,
    tile_n: cutlass.Constexpr[int],
) -> Int32:
    """How many key blocks, from block 0, every query row from ``row_start`` on sees whole: no
    key of them past the row's right edge (``right``: 0 causal, the window's right side) or
    past seqlen_k. The first row sees the fewest keys."""
    col_end_first_row = row_start + seqlen_k - seqlen_q + right + 1
    return cutlass.max(cutlass.min(col_end_first_row, seqlen_k), 0) // tile_n


@cute.jit
def causal_block_unmasked(
    row_start: Int32,
    n_block: Int32,
    tile_n: cutlass.Constexpr[int],
    seqlen_q: Int32,
    seqlen_k: Int32,
) -> cutlass.Boolean:
    """Causal backward: whether the tile of query rows from ``row_start`` on and key block
    ``n_block`` needs no mask (``block_range``'s right-edge rule, seen from a key block)."""
    return n_block < key_blocks_without_right_mask(row_start, seqlen_q, seqlen_k, Int32(0), tile_n)


def split_block_range(n_block_min: Int32, n_block_max: Int32, split: Int32, num_splits: Int32):
    """The key blocks [lo, hi) of key split ``split`` of ``num_splits`` (split-KV): the
    block range [n_block_min, n_block_max) cut into ``ceil(n / num_splits)``-block pieces, the
    last one shorter; a split past the end gets an empty range (lo == hi: it writes O = 0 and
    LSE = -inf). The mask boundaries of ``block_range`` stay valid for every piece."""
    per_split = cute.ceil_div(cutlass.max(n_block_max - n_block_min, 0), num_splits)
    lo = n_block_min + split * per_split
    hi = cutlass.max(cutlass.min(lo + per_split, n_block_max), lo)
    return lo, hi


@cute.jit
def block_range(
    m_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    local: cutlass.Constexpr[bool],
    qhead_per_kvhead: cutlass.Constexpr[int] = 1,
):
    """Key blocks of one query block, a ``BlockRange``.

    Blocks are visited from n_max - 1 down to n_min; an empty range (n_max <= n_min) means no
    row of the block sees any key. Blocks at or above n_no_right may cut the seqlen_k tail or
    the causal/right window edge; blocks below n_no_left may cut the left window edge (local
    only). ``qhead_per_kvhead`` > 1: the block's rows are packed GQA rows (Note [packed GQA] in
    cute_fa/dsl/pack_gqa.py), query positions ``row // qhead_per_kvhead``; ``seqlen_q`` is
    the query length in positions.
    """
    g = qhead_per_kvhead
    offset = seqlen_k - seqlen_q
    n_max = cute.ceil_div(seqlen_k, tile_n)
    n_min = Int32(0)
    n_min_no_left = Int32(0)
    n_no_right = seqlen_k // tile_n
    row_first = m_block * tile_m  # in positions below
    row_last = cutlass.min((m_block + 1) * tile_m, seqlen_q * g) - 1
    if cutlass.const_expr(g > 1):
        row_first = row_first // g
        row_last = row_last // g
    if cutlass.const_expr(causal or local):
        right = Int32(0) if cutlass.const_expr(causal) else window_right
        col_end = row_last + offset + right + 1  # one past the last key any row sees
        n_max = cutlass.min(n_max, cute.ceil_div(cutlass.max(col_end, 0), tile_n))
        n_no_right = key_blocks_without_right_mask(row_first, seqlen_q, seqlen_k, right, tile_n)
    if cutlass.const_expr(local):
        col_first = row_first + offset - window_left  # first key of the first row
        n_min = cutlass.max(col_first, 0) // tile_n
        col_first_last_row = row_last + offset - window_left  # the last row starts furthest right
        n_min_no_left = cute.ceil_div(cutlass.max(col_first_last_row, 0), tile_n)
        n_min_no_left = cutlass.max(n_min_no_left, n_min)
    return BlockRange(n_min, n_max, n_no_right, n_min_no_left)


@cute.jit
def query_block_range(
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    local: cutlass.Constexpr[bool],
):
    """Query blocks that see any key of key block ``n_block`` (the backward's dual of
    ``block_range``): (m_block_min, m_block_max), empty when m_block_max <= m_block_min.

    Both bounds are non-decreasing in ``n_block``, so the key blocks that visit one query block
    form one contiguous run (``first_key_block`` is its start).
    """
    offset = seqlen_k - seqlen_q
    m_min = Int32(0)
    m_max = cute.ceil_div(seqlen_q, tile_m)
    if cutlass.const_expr(causal or local):
        right = Int32(0) if cutlass.const_expr(causal) else window_right
        m_min = cutlass.max(n_block * tile_n - offset - right, 0) // tile_m
    if cutlass.const_expr(local):
        last_col = cutlass.min((n_block + 1) * tile_n, seqlen_k) - 1
        last_row = last_col - offset + window_left  # the last row that sees last_col
        m_max = cutlass.min(m_max, cutlass.max(cute.ceil_div(last_row + 1, tile_m), 0))
    return m_min, m_max


class QueryMaskBounds(NamedTuple):
    """``query_block_mask_bounds``: query blocks below ``m_no_right`` may cut the causal / right
    window edge of the key block, blocks from ``m_left`` on its left window edge."""

    m_no_right: Int32
    m_left: Int32


def query_block_mask_bounds(
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    tile_m: int,
    tile_n: int,
    causal: bool,
    local: bool,
) -> QueryMaskBounds:
    """Which query blocks of key block ``n_block`` need the causal / window mask: the
    backward's dual of ``block_range``'s n_no_right / n_no_left (Note [bottom-right aligned
    masks]). Query block m is whole on the right when its first row sees the block's last key
    (m tile_m >= (n_block + 1) tile_n - 1 - offset - right), and whole on the left when its
    last row does not pass the block's first key (a row r cuts key n_block tile_n when r >
    n_block tile_n - offset + left). Without causal / local: (0, WINDOW_INF), no block cuts an
    edge; the seqlen_k tail is the caller's (a key block that holds seqlen_k masks every
    block). Plain arithmetic, no ``cute.jit``: the same code traces in a kernel and runs on
    Python ints (tests); divisions only of non-negative values."""
    offset = seqlen_k - seqlen_q
    m_no_right = 0
    m_left = WINDOW_INF
    if causal or local:
        right = 0 if causal else window_right
        first_whole_row = (n_block + 1) * tile_n - 1 - offset - right
        m_no_right = cute.ceil_div(cutlass.max(first_whole_row, 0), tile_m)
    if local:
        first_cut_row = n_block * tile_n - offset + window_left + 1
        m_left = cutlass.max(first_cut_row, 0) // tile_m
    return QueryMaskBounds(m_no_right, m_left)


def visited_query_block(i: Int32, m_block_min: Int32, m_block_max: Int32, downward: bool) -> Int32:
    """The i-th query block a key block's CTA visits in ``query_block_range``: ascending from
    m_block_min, or ``downward`` from m_block_max - 1 (the backwards' deterministic mode, Note
    [deterministic dQ] in ampere/flash_bwd.py: with turns in ascending key-block order, no key
    block then waits for another to reach a block that one visits late)."""
    return m_block_max - 1 - i if downward else m_block_min + i


# The deterministic backward's order when all key blocks of a (batch, head) run at once (the
# sm80 kernel's ``det_coresident``; Note [deterministic dQ] in ampere/flash_bwd.py). A query
# block's turns follow the order in which its key blocks reach it, so each key block's
# predecessor got there a step earlier:
# - causal: key blocks walk upward from their first query block; key block n + 1 starts one or
#   more blocks further down, so it reaches each block no later than n: turns descending.
# - no mask: key block n walks downward from query block n - 1, wrapping (block m at step
#   (M - 1 + n - m) mod M of M query blocks); its predecessor n - 1 visits each block one
#   step earlier. This needs no more key blocks than query blocks (N <= M); a longer key
#   sequence falls back to the chain (every key block downward from M - 1, turns ascending).


@cute.jit
def coresident_rotates(
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
) -> cutlass.Boolean:
    """No mask, coresident: whether a sequence's key blocks walk rotated (key block n downward
    from query block n - 1, wrapping): N <= M; else they take the chain."""
    return cute.ceil_div(seqlen_k, tile_n) <= cute.ceil_div(seqlen_q, tile_m)


@cute.jit
def rotated_query_block(i: Int32, m_block_min: Int32, m_block_max: Int32, shift: Int32) -> Int32:
    """The i-th query block of a downward walk over [m_block_min, m_block_max) that starts
    ``shift`` (< the block count) blocks after the last one, wrapping."""
    count = m_block_max - m_block_min
    j = count - 1 + shift - i
    if j >= count:
        j = j - count
    return m_block_min + j


@cute.jit
def coresident_turn(
    m_block: Int32,
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
    rotates: cutlass.Boolean,
) -> Int32:
    """How many key blocks add their dQ of query block ``m_block`` before ``n_block`` in the
    coresident order (above); ``n_block`` visits ``m_block``; ``rotates``: the sequence's
    ``coresident_rotates`` (no mask)."""
    num_n = cute.ceil_div(seqlen_k, tile_n)
    turn = n_block
    if cutlass.const_expr(causal):
        # The visitors of m_block are key blocks 0 .. last: those whose first key some row of
        # m_block sees (query_block_range's m_min <= m_block).
        last = cutlass.min(num_n, cute.ceil_div((m_block + 1) * tile_m + seqlen_k - seqlen_q,
                                                tile_n)) - 1  # fmt: skip
        turn = last - n_block
    else:
        num_m = cute.ceil_div(seqlen_q, tile_m)
        if rotates:
            # The key block that reaches m_block first, at step 0 (none when first >= N: then
            # the order is 0, 1, .., N - 1).
            first = m_block + 1
            if first == num_m:
                first = 0
            if first < num_n:
                turn = n_block - first
                if turn < 0:
                    turn = turn + num_n
    return turn


@cute.jit
def first_key_block(
    m_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    local: cutlass.Constexpr[bool],
) -> Int32:
    """The first key block whose ``query_block_range`` holds ``m_block``: 0, or with a window
    the block of the first key the block's first row sees."""
    first = Int32(0)
    if cutlass.const_expr(local):
        first = cutlass.max(m_block * tile_m + seqlen_k - seqlen_q - window_left, 0) // tile_n
    return first


# Note [mask columns as immediates]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A thread's column of accumulator element c is its own first column plus a constant of the
# MMA layout. Compared as ``col_c < limit``, every col_c is a register (the compiler builds
# them with one LOP3 each) that stays live across the compares; compared as
# ``col_c - col0 < limit - col0``, the left side folds to a constant and each compare takes
# an immediate. Same predicate (no overflow: limits stay below 2^30, WINDOW_INF is 2^29).
# SASS (sm_90a, bf16): the sm90 forward d64 causal -72 instructions (LOP3 59 -> 29), d128
# causal / non-causal -56, local -88; d64 causal with three consumers on the persistent grid
# 4 -> 0 spill instructions (-276); the sm80 forward d128 causal -74 instructions, its spill
# instructions 87 -> 93 (inside its budget).


# Note [packed mask rows]
# ~~~~~~~~~~~~~~~~~~~~~~~
# With packed GQA rows a score row's query position is ``row // G``. Computed per row, each
# position is a register the compiler hoists out of the key loop and keeps live: in the sm80
# forward (d64, 4 warps, at the 255-register cap; sm_80, G 4, local + softcap + paged) that
# took 69 spill instructions. With ``positions_from_first`` the position of row row0 + off
# (row0 the thread's first row, off a constant of the layout) is (row_base + row0) // G +
# off // G: one position register and constants (the difference of two coordinates of the
# thread folds to a constant, as in Note [mask columns as immediates]); the same call spills
# nothing. The caller vouches that this is exact. The sm80 forward's m16n8 C layout (rows
# lane / 4 + 8 i + 16 w + 16 num_warps j; powers of two of warps and of tile_m) writes row0
# and off in disjoint bits below tile_m, and row_base is a multiple of tile_m: with G a power
# of two dividing tile_m the shift by log2 G distributes over that carry-free sum; with G a
# multiple of tile_m every row of a tile has one position (off // G = 0).


@cute.jit
def apply_mask(
    S: cute.Tensor,
    coords: cute.Tensor,
    row_base: Int32,
    col_base: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    window_left: Int32,
    window_right: Int32,
    causal: cutlass.Constexpr[bool],
    local: cutlass.Constexpr[bool],
    qhead_per_kvhead: cutlass.Constexpr[int] = 1,
    positions_from_first: cutlass.Constexpr[bool] = False,
):
    """Set masked scores of ``S`` (an (rows, cols) view) to -inf.

    ``coords`` is the identity tensor of the tile partitioned and viewed like ``S``: its entries are
    (row, col) inside the tile; ``row_base`` / ``col_base`` place the tile in the sequence.
    ``qhead_per_kvhead`` > 1: rows are packed GQA rows, query position ``row //
    qhead_per_kvhead`` (Note [packed GQA] in cute_fa/dsl/pack_gqa.py). ``positions_from_first``:
    the caller's layout guarantees that each row's position is the thread's first row's plus
    that row's (constant) offset divided by ``qhead_per_kvhead`` (Note [packed mask rows]).
    """
    offset = seqlen_k - seqlen_q
    num_rows = cute.size(S.shape[0])
    num_cols = cute.size(S.shape[1])
    neg_inf = -Float32.inf
    # Columns relative to the thread's first one: coords[0, c][1] - col0 is the same for every
    # thread (the accumulator layout's static part), so each comparison takes an immediate
    # instead of a column register (Note [mask columns as immediates]).
    col0 = coords[0, 0][1]
    if cutlass.const_expr(not causal and not local):
        col_limit = seqlen_k - col_base - col0
        for c in cutlass.range_constexpr(num_cols):
            keep = coords[0, c][1] - col0 < col_limit
            for r in cutlass.range_constexpr(num_rows):
                S[r, c] = S[r, c] if keep else neg_inf
    else:
        g = qhead_per_kvhead
        row0 = coords[0, 0][0]
        pos0 = (row0 + row_base) // g  # Note [packed mask rows]
        for r in cutlass.range_constexpr(num_rows):
            row = coords[r, 0][0] + row_base
            if cutlass.const_expr(g > 1 and positions_from_first):
                row = pos0 + (coords[r, 0][0] - row0) // g
            elif cutlass.const_expr(g > 1):
                row = row // g
            right = Int32(0) if cutlass.const_expr(causal) else window_right
            col_limit_right = cutlass.min(row + offset + right + 1, seqlen_k) - col_base - col0
            col_limit_left = row + offset - window_left - col_base - col0
            for c in cutlass.range_constexpr(num_cols):
                col = coords[0, c][1] - col0
                keep = col < col_limit_right
                if cutlass.const_expr(local):
                    keep = keep and col >= col_limit_left
                S[r, c] = S[r, c] if keep else neg_inf
