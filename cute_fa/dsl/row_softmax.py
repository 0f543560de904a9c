"""A thread that owns a whole row (sm100: a TMEM lane is one query row).

The per-row numerics are the shared ones of cute_fa/dsl/softmax.py (``update_max``,
``finalize_row``, which ``OnlineSoftmax`` runs in the sm80 / sm90 kernels too); there a row is
spread over the 4 threads of a quad and its reductions end in shuffles, here one thread holds
the row (``tcgen05.ld`` 32x32b: lane i of the warp reads TMEM lane 32 * (warp % 4) + i), so the
reductions are in registers and the running max / sum are two scalars.
"""

from __future__ import annotations

import cutlass.cute as cute


def row_view(t: cute.Tensor) -> cute.Tensor:
    """A thread's row fragment (registers, or the matching coordinate tensor) as a (1, n)
    (rows, cols) view, the shape ``cute_fa.dsl.mask.apply_mask`` takes."""
    return cute.make_tensor(
        t.iterator, cute.composition(t.layout, cute.make_layout((1, cute.size(t))))
    )
