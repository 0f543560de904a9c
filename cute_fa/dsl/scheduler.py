"""Which (query block, head, batch) tiles a CTA computes: one per CTA, or a static persistent
schedule (Note [persistent tiles])."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# Note [persistent tiles]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A persistent kernel launches a fixed grid of G CTAs (one an SM) and CTA b computes the tiles
# b, b + G, b + 2 G, ... of the num_m_blocks * num_heads * batch tiles, so the producer loads
# the next tile's Q, K and V while the consumers finish the current one: no CTA launch, no
# barrier set-up, no cold pipeline between tiles. Tiles are numbered with the query block
# fastest (the order the launch grid (m_block, head, batch) of the one-CTA-a-tile kernels has),
# so the tiles in flight at once share a few heads' K and V in L2. Every tile of a dense call
# without a causal mask or window costs the same, so the static round robin is balanced; with
# varying work a tile (causal, varlen) the hardware's own CTA scheduler balances better.


@cute.jit
def tile_count(seqlen_q: Int32, tile_m: cutlass.Constexpr[int], num_heads: Int32, batch: Int32):
    """Number of (query block, head, batch) tiles."""
    return (seqlen_q + (tile_m - 1)) // tile_m * num_heads * batch


@cute.jit
def tile_coords(tile: Int32, seqlen_q: Int32, tile_m: cutlass.Constexpr[int], num_heads: Int32):
    """(m_block, head, batch) of tile number ``tile``, query block fastest."""
    num_m_blocks = (seqlen_q + (tile_m - 1)) // tile_m
    m_block = tile % num_m_blocks
    rest = tile // num_m_blocks
    return m_block, rest % num_heads, rest // num_heads
