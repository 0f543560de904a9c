"""Compile keys and the tuned tile table.

A ``FwdConfig`` IS the compile key of a forward kernel: it holds exactly what changes the
generated code (architecture family, compile target, dtype, head dims, tile shape, feature flags)
and nothing else. Tensors, sequence lengths, batch and head counts never appear here: layouts
stay dynamic, so a new sequence length or batch reuses the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

DTYPES = ("bf16", "fp16")

# Compile targets by compute capability. The sm80 kernel family runs on every GPU from Ampere up;
# it is compiled for the device's own target (SASS does not run across major versions).
TARGETS = {
    (8, 0): "sm_80",
    (8, 6): "sm_86",
    (8, 7): "sm_87",
    (8, 9): "sm_89",
    (9, 0): "sm_90a",
    (10, 0): "sm_100a",
    (10, 3): "sm_103a",
    (12, 0): "sm_120a",
}

# Shared memory a CTA may use (bytes) per target, from the CUDA programming guide.
SMEM_CAPACITY = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_87": 163 * 1024,
    "sm_89": 99 * 1024,
    "sm_90a": 227 * 1024,
    "sm_100a": 227 * 1024,
    "sm_103a": 227 * 1024,
    "sm_120a": 99 * 1024,
}


def target_for_capability(major: int, minor: int) -> str:
    """Compile target of a device with the given compute capability."""
    try:
        return TARGETS[(major, minor)]
    except KeyError:
        raise NotImplementedError(
            f"compute capability {major}.{minor} has no compile target in cute_fa "
            f"(known: {sorted(TARGETS)})"
        ) from None


def capability_for_target(target: str) -> tuple[int, int]:
    """Compute capability whose devices compile for ``target`` (the inverse of
    ``target_for_capability``)."""
    for capability, name in TARGETS.items():
        if name == target:
            return capability
    raise ValueError(f"unknown target {target!r}; known: {', '.join(sorted(TARGETS.values()))}")


@dataclass(frozen=True)
class FwdConfig:
    """Compile key of a forward kernel. Every field changes the generated code."""

    arch: int  # kernel family: 80 (ampere package), 90 (hopper), 100 (blackwell)
    target: str  # compile target, e.g. "sm_90a"; see TARGETS
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    head_dim_v: int
    tile_m: int
    tile_n: int
    num_warps: int
    causal: bool = False
    local: bool = False  # sliding window; window bounds are runtime values
    has_softcap: bool = False  # the softcap value itself is a runtime value
    varlen_q: bool = False  # cu_seqlens_q given
    varlen_k: bool = False  # cu_seqlens_k given
    seqused_q: bool = False
    seqused_k: bool = False
    # Tuning variants of the sm90 kernel (hopper/support.py switches); the defaults are the
    # kernel's own choice and leave the name unchanged.
    kv_stages: int = 0  # K/V smem stages; 0: the kernel's default
    # O rescale and P conversion just before the next P V: 0 off, 1 on, 2 on with the P V wait
    # in a vote-guarded branch (hopper/flash_fwd.py, ``wait_pv_after_exponentials``).
    defer_rescale: int = 0
    exp2_poly: int = 0  # every exp2_poly-th exponential of an unmasked block by polynomial
    rescale_threshold: int = 0  # log2 units a row max must move by to rescale O; 0: any move
    # Persistent grid (Note [persistent tiles] in cute_fa/dsl/scheduler.py): CTAs launched, one
    # an SM of the device; 0: one CTA a tile.
    num_ctas: int = 0
    # Persistent grid only: CTAs take their next work unit from a global counter (atomicAdd)
    # instead of the static round robin (CUTE_FA_SM90_FWD_PERSISTENT=2).
    dynamic_tiles: bool = False
    # O leaves by TMA store from shared memory instead of 16-byte stores (sm90; dense calls with
    # dv == d; CUTE_FA_SM90_FWD_TMA_STORE=1).
    tma_store: bool = False
    # P reaches O += P V through shared memory (an SS WGMMA) instead of registers (RS); sm90,
    # without the deferred rescale (CUTE_FA_SM90_FWD_P_SMEM=1).
    p_smem: bool = False
    # Consumer warpgroups take turns issuing their GEMMs (named barriers); False: each issues
    # as soon as its operands are ready (CUTE_FA_SM90_FWD_PINGPONG=0).
    pingpong: bool = True
    # A consumer's softmax of block j runs while its O += P V of block j - 1 is in flight
    # (intra-warpgroup overlap); False: it waits for both GEMMs (CUTE_FA_SM90_FWD_OVERLAP=0).
    overlap: bool = True
    # S = Q K^T takes Q from registers (RS WGMMA; Q loaded once a tile by ldmatrix) instead of
    # shared memory (SS); sm90, d <= 128 (CUTE_FA_SM90_FWD_Q_RMEM=1).
    q_rmem: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"FwdConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.causal and self.local:
            raise ValueError("FwdConfig: causal and local are exclusive (causal is a window)")

    def replace(self, **changes) -> FwdConfig:
        return dataclasses.replace(self, **changes)

    @property
    def name(self) -> str:
        """Short human-readable name, used in messages and cache file names."""
        flags = [
            f
            for f in ("causal", "local", "varlen_q", "varlen_k", "seqused_q", "seqused_k")
            if getattr(self, f)
        ]
        if self.has_softcap:
            flags.append("softcap")
        if getattr(self, "kv_stages", 0):  # (BwdConfig shares this name and has neither field)
            flags.append(f"kv{self.kv_stages}")
        defer = getattr(self, "defer_rescale", 0)
        if defer:
            flags.append("defer" if defer == 1 else f"defer{int(defer)}")
        if getattr(self, "exp2_poly", 0):
            flags.append(f"poly{self.exp2_poly}")
        if getattr(self, "rescale_threshold", 0):
            flags.append(f"thr{self.rescale_threshold}")
        if getattr(self, "num_ctas", 0):
            flags.append(f"persistent{self.num_ctas}")
        if getattr(self, "dynamic_tiles", False):
            flags.append("dynamic")
        if getattr(self, "tma_store", False):
            flags.append("tmastore")
        if getattr(self, "p_smem", False):
            flags.append("psmem")
        if not getattr(self, "pingpong", True):
            flags.append("nopingpong")
        if not getattr(self, "overlap", True):
            flags.append("nooverlap")
        if getattr(self, "q_rmem", False):
            flags.append("qrmem")
        dv = "" if self.head_dim_v == self.head_dim else f"x{self.head_dim_v}"
        return (
            f"fwd_sm{self.arch}_{self.target}_{self.dtype}_d{self.head_dim}{dv}"
            f"_{self.tile_m}x{self.tile_n}w{self.num_warps}"
            + ("_" + "_".join(flags) if flags else "")
        )


# Tuned forward tiles of the sm80 (FA2-design) kernel: head_dim -> (tile_m, tile_n, num_warps).
# Each entry's reason is beside it; the performance log in docs/performance.md has the numbers.
# Shared memory per CTA = (tile_m + 2 * tile_n) * head_dim * 2 bytes (Q, K, V tiles).
SM80_FWD_TILES = {
    # d64: 128x64 w4 beat 128x128 w4 (316 vs 310 TFLOPs, s2k), 128x128 w8 (268) and 64x128 w4
    # (279) on the H200; 128x128 w4 spills (acc_S is 128 fp32 a thread).
    64: (128, 64, 4),
    # d96: same shape as d128 (acc_O 96 fp32 a thread).
    96: (128, 64, 4),
    # d128: 128x64 w4 (32 query rows a warp) 377 TFLOPs at s8k vs 128x128 w8 339, 64x128 w4 314,
    # 128x64 w8 312, 64x64 w4 302: 32 rows a warp halve the ldmatrix traffic per mma.
    128: (128, 64, 4),
    # d192: 128x64 w8 keeps acc_O at 96 fp32 a thread (4 warps would need 192).
    192: (128, 64, 8),
    # d256: 128x64 w8 344 TFLOPs at s8k vs 64x64 w4 323, 64x32 w4 294 (64x64 w4 wins causal s2k:
    # 283 vs 270).
    256: (128, 64, 8),
}

# Smaller tiles for targets with 99 KiB of shared memory (sm86, sm89, sm120).
SM80_FWD_TILES_SMALL_SMEM = {
    64: (128, 128, 4),
    96: (128, 64, 4),
    128: (128, 64, 4),
    192: (64, 64, 4),
    256: (64, 64, 4),
}


# Causal overrides: causal grids are short on work per query block, where smaller tiles keep more
# CTAs per SM. d256 causal: 64x64 w4 283 TFLOPs vs 128x64 w8 270 at s2k on the H200 (the standard
# grid run of 2026-11-30 had 128x64 w8 at 0.99x-1.00x SDPA FLASH for s2k/s4k).
SM80_FWD_TILES_CAUSAL = {256: (64, 64, 4)}


def sm80_fwd_tile(head_dim: int, target: str, causal: bool = False) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_warps) of the sm80 forward kernel for a head dim and target."""
    big_smem = SMEM_CAPACITY.get(target, 0) >= 160 * 1024
    if causal and big_smem and head_dim in SM80_FWD_TILES_CAUSAL:
        return SM80_FWD_TILES_CAUSAL[head_dim]
    table = SM80_FWD_TILES if big_smem else SM80_FWD_TILES_SMALL_SMEM
    if head_dim not in table:
        raise NotImplementedError(
            f"head_dim={head_dim} is not supported by the sm80 forward kernel "
            f"(supported: {sorted(table)})"
        )
    return table[head_dim]


@dataclass(frozen=True)
class BwdConfig:
    """Compile key of a backward kernel. Every field changes the generated code."""

    arch: int
    target: str
    dtype: str
    head_dim: int
    head_dim_v: int
    tile_m: int  # query rows per inner step
    tile_n: int  # key rows per CTA (dK, dV of these rows live in registers)
    num_warps: int
    causal: bool = False
    local: bool = False
    has_softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    deterministic: bool = False  # dQ added in a fixed order (semaphores), bitwise reproducible
    # Deterministic, sm80 kernel: the key blocks of one (batch, head) all run at once (the caller
    # checked that they fit on the GPU), so the turns may follow the order in which they reach
    # a query block (Note [deterministic dQ] in ampere/flash_bwd.py).
    det_coresident: bool = False
    # sm90 kernel: Q / dO stages (CUTE_FA_SM90_BWD_Q_STAGES, hopper/support.py); 0: its default.
    q_stages: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"BwdConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.causal and self.local:
            raise ValueError("BwdConfig: causal and local are exclusive (causal is a window)")
        if self.det_coresident and (not self.deterministic or self.local):
            raise ValueError("BwdConfig: det_coresident needs deterministic and no window")

    def replace(self, **changes) -> BwdConfig:
        return dataclasses.replace(self, **changes)

    @property
    def name(self) -> str:
        det = "_deterministic" if self.deterministic else ""
        det += "_coresident" if self.det_coresident else ""
        det += f"_q{self.q_stages}" if self.q_stages else ""
        return "bwd" + FwdConfig.name.fget(self)[3:] + det  # same naming as the forward


# Backward tiles of the sm80 kernel: head_dim -> (tile_m, tile_n, num_warps). One CTA keeps
# dK and dV of tile_n keys in registers (2 * tile_n * d fp32 over the CTA's threads) and walks
# the query blocks tile_m rows at a time.
SM80_BWD_TILES = {
    64: (64, 128, 8),
    96: (64, 128, 8),
    128: (64, 128, 8),
    192: (64, 64, 8),
    256: (64, 64, 8),
}

# Where shared memory is 99 KiB (sm_86, sm_89, sm_120a: consumer GPUs), the table's 64x128 tile of
# d96 (105 KiB) and d128 (129 KiB) does not fit; 64 keys a CTA do (65 / 81 KiB, one Q/dO stage;
# SASS for sm_86: 0 spills, 174-242 registers with every feature flag). d192 and d256 fit no
# tile there (d256 at 64x64: 145 KiB) and raise NotImplementedError with the reason. Not run on
# those GPUs; the H200 runs this tile as the sm80 kernel (tests/test_bwd_gpu.py).
SM80_BWD_TILES_SMALL_SMEM = {96: (64, 64, 8), 128: (64, 64, 8)}

# Where shared memory holds 160 KiB: d64 takes 128 x 128 (two Q/dO stages, 0 spills). Causal
# measured +7-9 % over 64 x 128 at 2k and 8k on the H200 (docs/bench/2026-11-30-h200-bwd-d64-
# 128x128w8.csv), non-causal +3-5 % at 512-16k once dQ was added in fragment order
# (docs/bench/2026-12-01-h200-bwd-sm80-d64-128x128w8.csv).
SM80_BWD_TILES_LARGE_SMEM = {64: (128, 128, 8)}


class SettingError(ValueError):
    """A malformed environment setting (raised as is: never a reason to fall back)."""


# Tuning override: CUTE_FA_BWD_TILE="<tile_m>x<tile_n>w<num_warps>" (e.g. 128x128w8) replaces
# the table's tile for every head dim, so a benchmark can compare tiles; the kernel's
# can_implement still decides (NotImplementedError with its reason when the tile cannot work).
BWD_TILE_ENV = "CUTE_FA_BWD_TILE"


def sm80_bwd_tile(head_dim: int, target: str) -> tuple[int, int, int]:
    """(tile_m, tile_n, num_warps) of the sm80 backward kernel."""
    if head_dim not in SM80_BWD_TILES:
        raise NotImplementedError(
            f"head_dim={head_dim} is not supported by the sm80 backward kernel "
            f"(supported: {sorted(SM80_BWD_TILES)})"
        )
    override = os.environ.get(BWD_TILE_ENV, "").strip()
    if override:
        match = re.fullmatch(r"(\d+)x(\d+)w(\d+)", override)
        if match is None:
            raise SettingError(f"{BWD_TILE_ENV}={override!r}: expected e.g. 64x128w8")
        tile_m, tile_n, num_warps = (int(g) for g in match.groups())
        return tile_m, tile_n, num_warps
    big_smem = SMEM_CAPACITY.get(target, 0) >= 160 * 1024
    if big_smem and head_dim in SM80_BWD_TILES_LARGE_SMEM:
        return SM80_BWD_TILES_LARGE_SMEM[head_dim]
    if not big_smem and head_dim in SM80_BWD_TILES_SMALL_SMEM:
        return SM80_BWD_TILES_SMALL_SMEM[head_dim]
    return SM80_BWD_TILES[head_dim]
