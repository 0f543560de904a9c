"""What the sm90 kernels can do, without importing the CuTe DSL.

Dispatch and the feature matrix ask these functions; the kernel classes use them as their
``can_implement``. Keeping them here lets a caller ask without importing the DSL.
"""

from __future__ import annotations

from cute_fa.config import SMEM_CAPACITY, FwdConfig

# The one shape FlashAttentionForwardSm90 implements so far: 128 query rows (two consumer
# warpgroups of 64), 128 keys a block, 3 warpgroups (one producer, two consumers). Not tuned
# yet (docs/performance.md has its first measurements).
SM90_FWD_TILE = (128, 128, 12)
SM90_FWD_HEAD_DIMS = (64, 128)
SM90_FWD_KV_STAGES = 2


def fwd_tile(head_dim: int, causal: bool) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_warps) of the sm90 forward for a head dim (dispatch asks this)."""
    return SM90_FWD_TILE


def fwd_smem_bytes(config: FwdConfig, kv_stages: int = SM90_FWD_KV_STAGES) -> int:
    """Shared memory of the Q tile and the K and V rings (16-bit elements), barriers aside."""
    return (config.tile_m * config.head_dim
            + kv_stages * config.tile_n * (config.head_dim + config.head_dim_v)) * 2  # fmt: skip


def fwd_can_implement(config: FwdConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionForwardSm90 implements ``config``, else (False, why)."""
    if config.arch != 90:
        return False, f"config is for sm{config.arch}, this kernel is sm90"
    if not config.target.startswith("sm_90"):
        return False, f"target {config.target} is not sm_90a (TMA and WGMMA need sm_90a)"
    if config.head_dim not in SM90_FWD_HEAD_DIMS:
        return False, f"head_dim {config.head_dim} not in {SM90_FWD_HEAD_DIMS} (sm90 forward)"
    if config.head_dim_v != config.head_dim:
        return False, "head_dim_v != head_dim is not supported by the sm90 forward yet"
    if (config.tile_m, config.tile_n, config.num_warps) != SM90_FWD_TILE:
        return False, (
            f"tile {config.tile_m}x{config.tile_n}w{config.num_warps} is not the sm90 forward "
            f"tile {SM90_FWD_TILE[0]}x{SM90_FWD_TILE[1]}w{SM90_FWD_TILE[2]}"
        )
    for flag in ("local", "has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k"):
        if getattr(config, flag):
            return False, f"{flag} is not supported by the sm90 forward yet"
    smem = fwd_smem_bytes(config)
    if smem > SMEM_CAPACITY.get(config.target, 0):
        return False, f"tiles need {smem} B of shared memory, more than {config.target} has"
    return True, ""
