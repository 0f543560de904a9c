"""Which (query block, head, batch) tiles a CTA computes: one per CTA, or a persistent static
schedule (Note [persistent tiles])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

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


class WorkTile(NamedTuple):
    """A tile of the schedule: work unit ``unit`` and, for a causal pair, which of its two
    tiles (``second``; Note [persistent tiles])."""

    unit: Int32
    second: Int32


class TileScheduler:
    """The (query block, head, batch) tiles of one CTA of a forward kernel: the one of its block
    index (``persistent`` off: grid = (query blocks, heads, batch), causal grids in reverse), or
    the work units of a persistent grid from its block index on, a grid apart (Note [persistent
    tiles]; ``causal``: units are pairs of tiles). Created once in the kernel, before the warp roles
    split; every role walks the same tiles with ``for_each_tile``, so the pipelines between the
    roles see the same sequence of tiles on both sides.

    ``seqlen_q``, ``num_heads``, ``batch``: the extents of the dense query tensor (a persistent
    grid is dense only).
    """

    def __init__(
        self,
        seqlen_q: Int32,
        num_heads: Int32,
        batch: Int32,
        tile_m: int,
        causal: bool,
        persistent: bool,
    ):
        self.seqlen_q = seqlen_q
        self.num_heads = num_heads
        self.tile_m = tile_m
        self.causal = causal
        self.persistent = persistent
        self.first = WorkTile(cute.arch.block_idx()[0], Int32(0))
        self.num_units = unit_count(seqlen_q, tile_m, num_heads, batch, causal)
        self.stride = cute.arch.grid_dim()[0]

    def initial(self) -> WorkTile:
        """This CTA's first tile."""
        return self.first

    def is_valid(self, tile: WorkTile):
        """Whether ``tile`` exists (persistent grids: a unit below the count)."""
        return tile.unit < self.num_units

    def advance(self, tile: WorkTile) -> WorkTile:
        """The tile this CTA runs after ``tile``."""
        return WorkTile(
            *next_tile(tile.unit, tile.second, self.stride, self.seqlen_q, self.tile_m, self.causal)
        )

    @cute.jit
    def coords(self, tile: WorkTile):
        """(m_block, head, batch) of ``tile``."""
        if cutlass.const_expr(self.persistent):
            m_block, head, batch = tile_coords(
                tile.unit, tile.second, self.seqlen_q, self.tile_m, self.num_heads, self.causal
            )
        else:
            m_block, head, batch = cute.arch.block_idx()
            if cutlass.const_expr(self.causal):  # the longest rows first
                m_block = cute.arch.grid_dim()[0] - 1 - m_block
        return m_block, head, batch


@cute.jit
def for_each_tile(scheduler: TileScheduler, body: Callable, carry: Any, *args) -> Any:
    """The one tile loop of every warp role: ``carry = body(coords, carry, *args)`` for each of
    the CTA's tiles (``coords``: its (m_block, head, batch)), the carry (pipeline states) passed
    on from tile to tile. Returns the last carry."""
    tile = scheduler.initial()
    # Bound before the loop: a method called on the scheduler inside the ``while`` makes the DSL
    # carry the scheduler through it, and its loop-invariant values, carried, cost the
    # persistent kernels tens of integer instructions (their SASS checked against this form).
    is_valid, coords, advance = scheduler.is_valid, scheduler.coords, scheduler.advance
    if cutlass.const_expr(scheduler.persistent):
        while is_valid(tile):
            carry = body(coords(tile), carry, *args)
            tile = advance(tile)
    else:
        carry = body(scheduler.coords(tile), carry, *args)
    return carry


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
