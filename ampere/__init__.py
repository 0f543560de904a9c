"""sm80 kernels (FA2 design): cp.async, ldmatrix, mma.sync. They run on every GPU from Ampere up."""

from .flash_bwd import FlashAttentionBackwardSm80
from .flash_bwd_prepost import (
    BwdPostConfig,
    BwdPreConfig,
    FlashAttentionBackwardPostprocessSm80,
    FlashAttentionBackwardPreprocessSm80,
)
from .flash_fwd import FlashAttentionForwardSm80

__all__ = [
    "BwdPostConfig",
    "BwdPreConfig",
    "FlashAttentionBackwardPostprocessSm80",
    "FlashAttentionBackwardPreprocessSm80",
    "FlashAttentionBackwardSm80",
    "FlashAttentionForwardSm80",
]
