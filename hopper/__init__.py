"""sm90 kernels (FA3 design): TMA, WGMMA, warp-specialized producer/consumer warpgroups.

``FlashAttentionForwardSm90`` and ``FlashAttentionBackwardSm90`` serve sm90 devices for what
their ``can_implement`` accepts (``cute_fa.hopper.support``); the rest runs the sm80 kernels,
which run on Hopper too, as do the backward's pre- and postprocess. The kernel classes import
the CuTe DSL and load on first use (``cute_fa.lazy``).
"""

from __future__ import annotations

from cute_fa.lazy import lazy_getattr

_LAZY = {
    "FlashAttentionForwardSm90": ".flash_fwd",
    "FlashAttentionBackwardSm90": ".flash_bwd",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
