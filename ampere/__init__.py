"""sm80 kernels (FA2 design): cp.async, ldmatrix, mma.sync. They run on every GPU from Ampere up.

The kernel classes import the CuTe DSL, so they load on first use (``from cute_fa.ampere import
FlashAttentionForwardSm80`` works as usual); ``cute_fa.ampere.support`` answers what they can
do without that import.
"""

from __future__ import annotations

from cute_fa.lazy import lazy_getattr

_LAZY = {
    "FlashAttentionForwardSm80": ".flash_fwd",
    "FlashAttentionBackwardSm80": ".flash_bwd",
    "FlashAttentionBackwardPreprocessSm80": ".flash_bwd_prepost",
    "FlashAttentionBackwardPostprocessSm80": ".flash_bwd_prepost",
    "BwdPreConfig": ".flash_bwd_prepost",
    "BwdPostConfig": ".flash_bwd_prepost",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
