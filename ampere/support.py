"""What the sm80 kernels can do, without importing the CuTe DSL.

Dispatch and the feature matrix ask these functions; the kernel classes use them as their
``can_implement``. Keeping them here lets a call whose kernel is already in the disk cache run
without importing the DSL at all.
"""

from __future__ import annotations

from cute_fa.config import SMEM_CAPACITY, BwdConfig, FwdConfig

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)


def fwd_can_implement(config: FwdConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionForwardSm80 implements ``config``, else (False, why)."""
    if config.arch != 80:
        return False, f"config is for sm{config.arch}, this kernel is sm80"
    if config.head_dim not in SUPPORTED_HEAD_DIMS:
        return False, f"head_dim {config.head_dim} not in {SUPPORTED_HEAD_DIMS}"
    if config.head_dim_v != config.head_dim:
        return False, "head_dim_v != head_dim is not supported on sm80"
    if config.tile_m % (16 * config.num_warps) != 0:
        return False, f"tile_m {config.tile_m} is not a multiple of 16 * num_warps"
    if config.tile_n % 16 != 0:
        return False, f"tile_n {config.tile_n} is not a multiple of 16"
    smem = (config.tile_m + 2 * config.tile_n) * config.head_dim * 2
    if smem > SMEM_CAPACITY.get(config.target, 0):
        return False, f"tile needs {smem} B of shared memory, more than {config.target} has"
    return True, ""


def bwd_smem_bytes(config: BwdConfig, q_stages: int) -> int:
    """Shared memory of the sm80 backward: sK, sV; ``q_stages`` of (sQ, sdO, LSE, delta); sP,
    sdS (16-bit tiles, fp32 rows)."""
    tm, tn, d = config.tile_m, config.tile_n, config.head_dim
    return (2 * tn * d + q_stages * 2 * tm * d + 2 * tm * tn) * 2 + q_stages * 2 * tm * 4


def bwd_q_stages(config: BwdConfig) -> int:
    """2 (the next query block's Q, dO, LSE and delta load while this one computes) when shared
    memory holds two, else 1."""
    return 2 if bwd_smem_bytes(config, 2) + 1024 <= SMEM_CAPACITY.get(config.target, 0) else 1


def bwd_can_implement(config: BwdConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionBackwardSm80 implements ``config``, else (False, why)."""
    if config.arch != 80:
        return False, f"config is for sm{config.arch}, this kernel is sm80"
    if config.head_dim not in SUPPORTED_HEAD_DIMS:
        return False, f"head_dim {config.head_dim} not in {SUPPORTED_HEAD_DIMS}"
    if config.head_dim_v != config.head_dim:
        return False, "head_dim_v != head_dim is not supported on sm80"
    if config.num_warps % 4 != 0:
        return False, "num_warps must be a multiple of 4"
    w = config.num_warps
    if config.tile_m % 32 != 0 or config.tile_n % (16 * w // 2) != 0:
        return False, f"tile {config.tile_m}x{config.tile_n} does not fit {w} warps"
    if config.tile_n % 64 != 0:
        return False, "tile_n must be a multiple of 64"
    if config.head_dim % (16 * w // 4) != 0:
        return False, f"head_dim {config.head_dim} does not split over {w // 4} warps"
    smem = bwd_smem_bytes(config, q_stages=1)
    if smem > SMEM_CAPACITY.get(config.target, 0):
        return False, f"tiles need {smem} B of shared memory, more than {config.target} has"
    return True, ""
