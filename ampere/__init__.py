"""sm80 kernels (FA2 design): cp.async, ldmatrix, mma.sync. They run on every GPU from Ampere up.

The kernel classes import the CuTe DSL, so they load on first use (``from cute_fa.ampere import
FlashAttentionForwardSm80`` works as usual); ``cute_fa.ampere.support`` answers what they can
do without that import.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "FlashAttentionForwardSm80": ".flash_fwd",
    "FlashAttentionBackwardSm80": ".flash_bwd",
    "FlashAttentionBackwardPreprocessSm80": ".flash_bwd_prepost",
    "FlashAttentionBackwardPostprocessSm80": ".flash_bwd_prepost",
    "BwdPreConfig": ".flash_bwd_prepost",
    "BwdPostConfig": ".flash_bwd_prepost",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
