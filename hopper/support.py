"""What the sm90 kernels can do, without importing the CuTe DSL.

Dispatch and the feature matrix ask these functions; the kernel classes use them as their
``can_implement``. Keeping them here lets a caller ask without importing the DSL.
"""

from __future__ import annotations

import os

from cute_fa.config import SMEM_CAPACITY, BwdConfig, FwdConfig, SettingError

# FlashAttentionForwardSm90 always runs 128 query rows (two consumer warpgroups of 64 rows) and
# 3 warpgroups (one producer, two consumers); the key block tile_n depends on the head dim:
#   d 64, 96, 128: 128 keys. Q + 2 K/V stages are 48 / 72 / 96 KiB of smem; a consumer holds
#     S (64 fp32 registers a thread), P (32) and O (d / 2) well inside 240 registers.
#   d 192 (dv 192 or 128): 112 keys. 128 keys would need 48 + 192 = 240 KiB (dv 192), more than
#     the 227 KiB of sm_90a; 112 keys need 216 KiB (dv 192), 184 KiB (dv 128). S 56 + P 28 +
#     O 96 registers.
#   d 256: 80 keys. Q is 64 KiB and each K/V stage 80 KiB: 224 KiB with 2 stages (96 keys
#     would need 256 KiB). O alone is 128 registers a thread (64 x 256 fp32 over a warpgroup);
#     S 40 + P 20 leave room for the softmax inside 240 registers without spills.
# Not tuned beyond fitting (docs/performance.md has the measurements of d 64 and 128).
SM90_FWD_TILE_M = 128
SM90_FWD_WARPS = 12
SM90_FWD_TILE_N = {64: 128, 96: 128, 128: 128, 192: 112, 256: 80}
SM90_FWD_HEAD_DIMS = tuple(SM90_FWD_TILE_N)
# (head_dim, head_dim_v) pairs: equal head dims, and 192 x 128 (DeepSeek's q/k 192, v 128).
SM90_FWD_HEAD_DIM_PAIRS = tuple((d, d) for d in SM90_FWD_HEAD_DIMS) + ((192, 128),)
SM90_FWD_KV_STAGES = 2
# The tile of d 64 and 128, the first shape the kernel ran with (tests use it as the default).
SM90_FWD_TILE = (SM90_FWD_TILE_M, SM90_FWD_TILE_N[128], SM90_FWD_WARPS)
# mbarriers and the 1024-byte alignment of the smem tiles.
SM90_FWD_SMEM_SLACK = 1024


# Tuning override: CUTE_FA_SM90_FWD_TILE_N=<keys> (a multiple of 16, at most 256) replaces the
# key block of every head dim, so a benchmark can compare tiles; the shared-memory check of
# fwd_can_implement still applies. Read when a launch plan is made.
TILE_N_ENV = "CUTE_FA_SM90_FWD_TILE_N"


def fwd_tile(head_dim: int, causal: bool) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_warps) of the sm90 forward for a head dim (dispatch asks this)."""
    tile_n = SM90_FWD_TILE_N.get(head_dim, SM90_FWD_TILE[1])
    override = os.environ.get(TILE_N_ENV, "").strip()
    if override:
        if not override.isdigit() or int(override) % 16 or not 16 <= int(override) <= 256:
            raise SettingError(f"{TILE_N_ENV}={override!r}: expected a multiple of 16 up to 256")
        tile_n = int(override)
    return SM90_FWD_TILE_M, tile_n, SM90_FWD_WARPS


def fwd_smem_bytes(config: FwdConfig, kv_stages: int = SM90_FWD_KV_STAGES) -> int:
    """Shared memory of the Q tile and the K and V rings (16-bit elements), barriers and
    alignment included."""
    return (config.tile_m * config.head_dim
            + kv_stages * config.tile_n * (config.head_dim + config.head_dim_v)) * 2 \
        + SM90_FWD_SMEM_SLACK  # fmt: skip


def fwd_can_implement(config: FwdConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionForwardSm90 implements ``config``, else (False, why)."""
    if config.arch != 90:
        return False, f"config is for sm{config.arch}, this kernel is sm90"
    if not config.target.startswith("sm_90"):
        return False, f"target {config.target} is not sm_90a (TMA and WGMMA need sm_90a)"
    if config.head_dim not in SM90_FWD_HEAD_DIMS:
        return False, f"head_dim {config.head_dim} not in {SM90_FWD_HEAD_DIMS} (sm90 forward)"
    if (config.head_dim, config.head_dim_v) not in SM90_FWD_HEAD_DIM_PAIRS:
        return False, (
            f"head_dim_v {config.head_dim_v} with head_dim {config.head_dim} is not supported "
            f"by the sm90 forward (pairs {SM90_FWD_HEAD_DIM_PAIRS})"
        )
    tile = fwd_tile(config.head_dim, config.causal)
    if (config.tile_m, config.tile_n, config.num_warps) != tile:
        return False, (
            f"tile {config.tile_m}x{config.tile_n}w{config.num_warps} is not the sm90 forward "
            f"tile {tile[0]}x{tile[1]}w{tile[2]} of head_dim {config.head_dim}"
        )
    smem = fwd_smem_bytes(config)
    if smem > SMEM_CAPACITY.get(config.target, 0):
        return False, f"tiles need {smem} B of shared memory, more than {config.target} has"
    return True, ""


# --------------------------------------------------------------------------------------------
# Backward (FlashAttentionBackwardSm90 in hopper/flash_bwd.py; checked on an H200 by
# tests/test_bwd_sm90_gpu.py; dispatched on sm_90a where it applies). One CTA owns tile_n = 128
# keys: two consumer warpgroups of 64 keys each (the M = 64 of a WGMMA) hold dK and dV of their keys
# in registers (2 * 64 * d / 128 fp32 a thread: 64 at d 64, 128 at d 128) and walk the query
# blocks tile_m = 64 rows at a time, with
# S^T = K Q^T and dP^T = V dO^T (64 x 64 fp32: 32 registers each).
# Shared memory: K, V (tile_n x d, loaded once), SM90_BWD_Q_STAGES of Q and dO (tile_m x d) with
# their LSE and delta rows (fp32), two buffers of dS (tile_m x tile_n, 16-bit) and one fp32 dQ
# tile (tile_m x d, the source of the TMA reduce-add into dQaccum).
#   d 64: 32 + 32 + 32 + 16 KiB = 112 KiB;  d 128: 64 + 64 + 32 + 32 KiB = 192 KiB (of 227).
# --------------------------------------------------------------------------------------------
SM90_BWD_TILE_M = 64
SM90_BWD_TILE_N = 128
SM90_BWD_WARPS = 12  # one producer and two consumer warpgroups
SM90_BWD_HEAD_DIMS = (64, 128)
SM90_BWD_Q_STAGES = 2
SM90_BWD_DS_BUFFERS = 2


def bwd_tile(head_dim: int, causal: bool) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_warps) of the sm90 backward (the same for every supported head dim)."""
    return SM90_BWD_TILE_M, SM90_BWD_TILE_N, SM90_BWD_WARPS


def bwd_smem_bytes(config: BwdConfig) -> int:
    """Shared memory of the sm90 backward: K, V; the Q, dO, LSE and delta stages; the dS
    buffers; the fp32 dQ tile; barriers and the 1024-byte alignment of the tiles."""
    tm, tn, d, dv = config.tile_m, config.tile_n, config.head_dim, config.head_dim_v
    tiles = tn * (d + dv) + SM90_BWD_Q_STAGES * tm * (d + dv) + SM90_BWD_DS_BUFFERS * tm * tn
    return tiles * 2 + SM90_BWD_Q_STAGES * 2 * tm * 4 + tm * d * 4 + SM90_FWD_SMEM_SLACK


def bwd_can_implement(config: BwdConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionBackwardSm90 implements ``config``, else (False, why)."""
    if config.arch != 90:
        return False, f"config is for sm{config.arch}, this kernel is sm90"
    if not config.target.startswith("sm_90"):
        return False, f"target {config.target} is not sm_90a (TMA and WGMMA need sm_90a)"
    if config.head_dim not in SM90_BWD_HEAD_DIMS:
        return False, f"head_dim {config.head_dim} not in {SM90_BWD_HEAD_DIMS} (sm90 backward)"
    if config.head_dim_v != config.head_dim:
        return False, "head_dim_v != head_dim is not supported by the sm90 backward yet"
    tile = bwd_tile(config.head_dim, config.causal)
    if (config.tile_m, config.tile_n, config.num_warps) != tile:
        return False, (
            f"tile {config.tile_m}x{config.tile_n}w{config.num_warps} is not the sm90 backward "
            f"tile {tile[0]}x{tile[1]}w{tile[2]}"
        )
    for flag in ("local", "has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k"):
        if getattr(config, flag):
            return False, f"{flag} is not supported by the sm90 backward yet"
    if config.deterministic:
        return False, "deterministic (the dQ semaphores) is not supported by the sm90 backward yet"
    smem = bwd_smem_bytes(config)
    if smem > SMEM_CAPACITY.get(config.target, 0):
        return False, f"tiles need {smem} B of shared memory, more than {config.target} has"
    return True, ""
