"""cute-fa: exact FlashAttention in NVIDIA's CuTe Python DSL, with a flash_attn.cute-compatible
torch API.

    from cute_fa import flash_attn_func, flash_attn_varlen_func
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)

    with cute_fa.tuning(sm90_fwd={"tile_n": 112}):   # typed tuning override (cute_fa/tuned.py)
        out, lse = flash_attn_func(q, k, v)

``python -m cute_fa features`` prints what is implemented on which GPU architecture.
"""

from .api import flash_attn_func, flash_attn_varlen_func, get_scheduler_metadata
from .cache import package_version
from .combine import flash_attn_combine
from .tuned import tuning

__version__ = package_version()

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "get_scheduler_metadata",
    "flash_attn_combine",
    "tuning",
    "__version__",
]
