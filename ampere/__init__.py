"""sm80 kernels (FA2 design): cp.async, ldmatrix, mma.sync. They run on every GPU from Ampere up."""

from .flash_fwd import FlashAttentionForwardSm80

__all__ = ["FlashAttentionForwardSm80"]
