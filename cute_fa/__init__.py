"""cute-fa: exact FlashAttention in NVIDIA's CuTe Python DSL, with a flash_attn.cute-compatible
torch API.

    from cute_fa import flash_attn_func, flash_attn_varlen_func
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)

``python -m cute_fa features`` prints what is implemented on which GPU architecture.
"""

from importlib.metadata import PackageNotFoundError, version

from .interface import flash_attn_func, flash_attn_varlen_func

try:
    __version__ = version("cute-fa")
except PackageNotFoundError:
    __version__ = "0.0.0"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "__version__"]
