"""Packed GQA: the query heads that share a K/V head as rows of one query tile.

Note [packed GQA]
~~~~~~~~~~~~~~~~~
With ``G = nheads / nheads_kv`` query heads per K/V head (GQA / MQA), a decode step has one
(or a few) query rows per head, so a tile of 64-192 rows holds almost nothing. Packing puts the
G heads of one K/V head into the tile's M dimension: packed row ``r`` of K/V head ``hk`` is
query position ``r // G`` of query head ``hk * G + r % G`` (the head within the group varies
fastest), so one tile covers ``tile_m / G`` positions of all G heads and K/V are read once for
them. In CuTe this is a layout, not a copy: the row mode of Q (and O, LSE) becomes the
hierarchical mode ``(G, seqlen)`` with strides ``(head stride, row stride)``, and the head mode
shrinks to the K/V heads with stride ``G * head stride``. An integer row coordinate of a
``(G, seqlen)`` mode is split colexicographically, ``(r % G, r // G)``, which is exactly the
packing; tiles of ``tile_m`` rows divide that mode when ``G`` divides ``tile_m`` (the TMA box
then spans ``(d, G, tile_m / G)``).

What changes in a kernel: the grid has ``ceil(seqlen_q * G / tile_m)`` query blocks and
``nheads_kv`` heads; a tile's packed rows are compared with ``seqlen_q * G`` (stores); masks and
``block_range`` take query positions, ``row // G`` (``cute_fa/dsl/mask.py``). Results are
identical to the unpacked kernel: every row still sees the keys of its own K/V head.
"""

from __future__ import annotations

import cutlass.cute as cute


def pack_rows(t: cute.Tensor, qhead_per_kvhead: int) -> cute.Tensor:
    """A (batch, seqlen, nheads, d) tensor (Q, O) as (batch, (G, seqlen), nheads / G, d),
    G = ``qhead_per_kvhead`` (Note [packed GQA]); a view, no data moves."""
    g = qhead_per_kvhead
    b, s, h, d = t.shape
    sb, ss, sh, sd = t.stride
    layout = cute.make_layout((b, (g, s), h // g, d), stride=(sb, (sh, ss), sh * g, sd))
    return cute.make_tensor(t.iterator, layout)


def pack_lse_rows(t: cute.Tensor, qhead_per_kvhead: int) -> cute.Tensor:
    """A (batch, nheads, seqlen) LSE as (batch, nheads / G, (G, seqlen)) (Note [packed GQA])."""
    g = qhead_per_kvhead
    b, h, s = t.shape
    sb, sh, ss = t.stride
    layout = cute.make_layout((b, h // g, (g, s)), stride=(sb, sh * g, (sh, ss)))
    return cute.make_tensor(t.iterator, layout)


def packed_row_views(
    mQ: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, qhead_per_kvhead: int
) -> tuple[cute.Tensor, cute.Tensor, cute.Tensor]:
    """(Q, O, LSE) with packed rows (``pack_rows`` / ``pack_lse_rows``) when
    ``qhead_per_kvhead`` > 1, else the tensors themselves."""
    if qhead_per_kvhead == 1:
        return mQ, mO, mLSE
    g = qhead_per_kvhead
    return pack_rows(mQ, g), pack_rows(mO, g), pack_lse_rows(mLSE, g)
