"""sm90 kernels (FA3 design): TMA, WGMMA, warp-specialized producer/consumer warpgroups.

``FlashAttentionForwardSm90`` is the forward on sm90 for what its ``can_implement`` accepts
(``cute_fa.hopper.support``); the rest of the forward and the backward run the sm80 kernels,
which run on Hopper too. The kernel class imports the CuTe DSL
and loads on first use; ``cute_fa.hopper.support`` answers what it can do without that import.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "FlashAttentionForwardSm90": ".flash_fwd",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
