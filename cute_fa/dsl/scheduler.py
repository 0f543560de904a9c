"""Which (query block, head, batch) tiles a CTA computes: one per CTA, or a persistent static
schedule (Note [persistent tiles])."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# Note [persistent tiles]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A persistent kernel launches a fixed grid of G CTAs (one an SM) and CTA b computes the work
# units b, b + G, b + 2 G, ... of the call, so the producer loads the next tile's Q, K and V
# while the consumers finish the current one: no CTA launch, no barrier set-up, no cold
# pipeline between tiles. A unit is one (query block, head, batch) tile, numbered with the
# query block fastest (the order of the launch grid (m_block, head, batch) of one CTA a tile),
# so the tiles in flight at once share a few heads' K and V in L2. Every tile of a dense call
# without a causal mask costs the same, so the static round robin is balanced.
# Causal (``pairs``): a tile's cost grows with its query block, so a unit is a pair of tiles of
# one (head, batch), query blocks n_m - 1 - j and then j (the longest first; the middle block
# of an odd n_m alone): every pair costs about the same, n_m + 1 key blocks of a square mask,
# and consecutive units still share their head's K and V.


@cute.jit
def _num_m_blocks(seqlen_q: Int32, tile_m: cutlass.Constexpr[int]):
    return (seqlen_q + (tile_m - 1)) // tile_m


@cute.jit
def unit_count(
    seqlen_q: Int32,
    tile_m: cutlass.Constexpr[int],
    num_heads: Int32,
    batch: Int32,
    pairs: cutlass.Constexpr[bool],
):
    """Number of work units: tiles, or pairs of tiles with ``pairs``."""
    num_m = _num_m_blocks(seqlen_q, tile_m)
    if cutlass.const_expr(pairs):
        num_m = (num_m + 1) // 2
    return num_m * num_heads * batch


@cute.jit
def tile_coords(
    unit: Int32,
    second: Int32,
    seqlen_q: Int32,
    tile_m: cutlass.Constexpr[int],
    num_heads: Int32,
    pairs: cutlass.Constexpr[bool],
):
    """(m_block, head, batch) of the first (``second`` 0) or second tile of work unit ``unit``."""
    num_m = _num_m_blocks(seqlen_q, tile_m)
    if cutlass.const_expr(pairs):
        half = (num_m + 1) // 2
        j = unit % half
        rest = unit // half
        m_block = num_m - 1 - j
        if second != 0:
            m_block = j
    else:
        m_block = unit % num_m
        rest = unit // num_m
    return m_block, rest % num_heads, rest // num_heads


@cute.jit
def next_tile(
    unit: Int32,
    second: Int32,
    stride: Int32,
    seqlen_q: Int32,
    tile_m: cutlass.Constexpr[int],
    pairs: cutlass.Constexpr[bool],
):
    """(unit, second) of the tile a CTA runs after ``(unit, second)``; ``stride``: the grid."""
    next_unit, next_second = unit + stride, Int32(0)
    if cutlass.const_expr(pairs):
        num_m = _num_m_blocks(seqlen_q, tile_m)
        j = unit % ((num_m + 1) // 2)
        if second == 0 and num_m - 1 - j != j:
            next_unit, next_second = unit, Int32(1)
    return next_unit, next_second


def _key_blocks_slowest(deterministic: bool, causal: bool, coresident: bool) -> bool:
    # measured: Note [deterministic dQ] in ampere/flash_bwd.py
    return deterministic and causal and not coresident


def bwd_grid(
    key_blocks, num_heads, batch, deterministic: bool, causal: bool, coresident: bool = False
) -> tuple:
    """Launch grid of a backward main kernel, one CTA per (key block, head, batch): the key
    block fastest, so the CTAs resident together are the key blocks of a few heads, which read
    the same Q and dO from L2; slowest for deterministic causal calls unless ``coresident``
    (Note [deterministic dQ] in ampere/flash_bwd.py). ``bwd_block_coords`` reads a CTA's
    coordinates back."""
    if _key_blocks_slowest(deterministic, causal, coresident):
        return (num_heads, batch, key_blocks)
    return (key_blocks, num_heads, batch)


def bwd_block_coords(deterministic: bool, causal: bool, coresident: bool = False) -> tuple:
    """(key block, head, batch) of this CTA in ``bwd_grid``'s order."""
    x, y, z = cute.arch.block_idx()
    if _key_blocks_slowest(deterministic, causal, coresident):
        return z, x, y
    return x, y, z
