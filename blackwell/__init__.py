"""sm100 kernels (FA4 design): tcgen05 MMA, TMEM, softmax and correction warpgroups.

``FlashAttentionBackwardSm100`` (compile-only, not dispatched) is its backward.
``FlashAttentionForwardSm100`` cross-compiles for sm_100a / sm_103a (compile-only so far: it has
not run on a Blackwell GPU). Dispatch routes capability 10.x to it where it implements the call,
and each compiled variant passes the first-use self-check on the user's GPU before it serves a
call (``cute_fa.selftest``), else the sm80 kernel serves it.
The kernel class imports the CuTe DSL and loads on first use; ``cute_fa.blackwell.support``
answers what it can do without that import.
"""

from __future__ import annotations

from cute_fa.lazy import lazy_getattr

_LAZY = {
    "FlashAttentionBackwardSm100": ".flash_bwd",
    "FlashAttentionForwardSm100": ".flash_fwd",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
