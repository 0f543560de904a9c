"""What the sm80 kernels can do, without importing the CuTe DSL.

Dispatch and the feature matrix ask these functions; the kernel classes use them as their
``can_implement``. Keeping them here lets a call whose kernel is already in the disk cache run
without importing the DSL at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cute_fa.config import (
    SM80_HEAD_DIM_PAIRS,
    SM80_TILE_HEAD_DIMS,
    SMEM_CAPACITY,
    BwdConfig,
    FwdConfig,
    tile_head_dim,
)

# The head dims the sm80 kernels take: every multiple of 8 up to 256, each run on the tile of
# the next of SM80_TILE_HEAD_DIMS (Note [rounded head dims] in cute_fa/config.py).
MAX_HEAD_DIM = SM80_TILE_HEAD_DIMS[-1]
SUPPORTED_HEAD_DIMS = tuple(range(8, MAX_HEAD_DIM + 1, 8))


def head_dims_reason(head_dim: int, head_dim_v: int) -> str:
    """Why the sm80 kernels cannot take (head_dim, head_dim_v), or "" when they can: each a
    multiple of 8 up to 256, and equal or one of SM80_HEAD_DIM_PAIRS."""
    for dim, name in ((head_dim, "head_dim"), (head_dim_v, "head_dim_v")):
        if dim not in SUPPORTED_HEAD_DIMS:
            return f"{name} {dim} is not a positive multiple of 8 up to {MAX_HEAD_DIM}"
    if head_dim_v != head_dim and (head_dim, head_dim_v) not in SM80_HEAD_DIM_PAIRS:
        return (
            f"head_dim_v {head_dim_v} with head_dim {head_dim} is not supported on sm80 "
            f"(head_dim_v == head_dim, or the pairs {SM80_HEAD_DIM_PAIRS})"
        )
    return ""


def tile_dims(config: FwdConfig | BwdConfig) -> tuple[int, int]:
    """(tile head dim of Q and K, of V and O) of a config the sm80 kernels take."""
    return tile_head_dim(config.head_dim), tile_head_dim(config.head_dim_v)


def set_head_dim_columns(kernel, config: FwdConfig | BwdConfig) -> None:
    """Set the head dims of an sm80-family kernel and their tiles (Note [rounded head dims]):
    ``head_dim`` / ``head_dim_v``, ``tile_hdim`` / ``tile_hdimv``, and the column limits of the
    loads and stores, ``cols_qk`` / ``cols_vo``: None where a tile is exactly the tensor's."""
    kernel.head_dim, kernel.head_dim_v = config.head_dim, config.head_dim_v
    kernel.tile_hdim, kernel.tile_hdimv = tile_dims(config)
    kernel.cols_qk = None if kernel.head_dim == kernel.tile_hdim else kernel.head_dim
    kernel.cols_vo = None if kernel.head_dim_v == kernel.tile_hdimv else kernel.head_dim_v
    # One g2s / r2g copy serves both sides: its threads a row follow the smem atom's width.
    assert (kernel.tile_hdim % 64 == 0) == (kernel.tile_hdimv % 64 == 0), (
        "the K and V tile head dims need swizzle atoms of one width"
    )


def fwd_smem_bytes(config: FwdConfig) -> int:
    """Shared memory of the sm80 forward: sQ (tile_m x tile d; O is staged there, dv <= d),
    sK (tile_n x tile d) and sV (tile_n x tile dv), 16-bit."""
    d, dv = tile_dims(config)
    return (config.tile_m * d + config.tile_n * (d + dv)) * 2


def fwd_pack_gqa_fits(qhead_per_kvhead: int, tile_m: int) -> bool:
    """Whether packed GQA rows (Note [packed GQA] in cute_fa/dsl/pack_gqa.py) with this many
    query heads per K/V head split evenly into the sm80 forward's tiles of ``tile_m`` rows: the
    (G, seqlen) row mode then divides into (G, tile_m / G) tiles (or tiles inside one position's
    G rows), and the copy and MMA row partitions (powers of two of rows) follow it."""
    g = qhead_per_kvhead
    return g >= 2 and (tile_m % g == 0 or g % tile_m == 0)


def fwd_can_implement(config: FwdConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionForwardSm80 implements ``config``, else (False, why)."""
    if config.arch != 80:
        return False, f"config is for sm{config.arch}, this kernel is sm80"
    why = head_dims_reason(config.head_dim, config.head_dim_v)
    if why:
        return False, why
    if config.pack_gqa and not fwd_pack_gqa_fits(config.pack_gqa, config.tile_m):
        return False, (
            f"pack_gqa with {config.pack_gqa} query heads per K/V head: the sm80 forward's "
            f"packed rows need the heads per K/V head to divide tile_m {config.tile_m} (or be "
            f"a multiple of it)"
        )
    if config.tile_m % (16 * config.num_warps) != 0:
        return False, f"tile_m {config.tile_m} is not a multiple of 16 * num_warps"
    if config.tile_n % 16 != 0:
        return False, f"tile_n {config.tile_n} is not a multiple of 16"
    smem = fwd_smem_bytes(config)
    if smem > SMEM_CAPACITY.get(config.target, 0):
        return False, f"tile needs {smem} B of shared memory, more than {config.target} has"
    return True, ""


def bwd_smem_bytes(config: BwdConfig, q_stages: int) -> int:
    """Shared memory of the sm80 backward: sK, sV; ``q_stages`` of (sQ, sdO, LSE, delta); sP,
    sdS (16-bit tiles of the tile head dims, fp32 rows)."""
    tm, tn = config.tile_m, config.tile_n
    d, dv = tile_dims(config)
    tiles = tn * (d + dv) + q_stages * tm * (d + dv) + 2 * tm * tn
    return tiles * 2 + q_stages * 2 * tm * 4


def bwd_q_stages(config: BwdConfig) -> int:
    """2 (the next query block's Q, dO, LSE and delta load while this one computes) when shared
    memory holds two, else 1."""
    return 2 if bwd_smem_bytes(config, 2) + 1024 <= SMEM_CAPACITY.get(config.target, 0) else 1


def bwd_can_implement(config: BwdConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionBackwardSm80 implements ``config``, else (False, why)."""
    if config.arch != 80:
        return False, f"config is for sm{config.arch}, this kernel is sm80"
    why = head_dims_reason(config.head_dim, config.head_dim_v)
    if why:
        return False, why
    if config.num_warps % 4 != 0:
        return False, "num_warps must be a multiple of 4"
    w = config.num_warps
    if config.tile_m % 32 != 0 or config.tile_n % (16 * w // 2) != 0:
        return False, f"tile {config.tile_m}x{config.tile_n} does not fit {w} warps"
    if config.tile_n % 64 != 0:
        return False, "tile_n must be a multiple of 64"
    for dim, tile, name in zip((config.head_dim, config.head_dim_v), tile_dims(config),
                               ("head_dim", "head_dim_v"), strict=True):  # fmt: skip
        if tile % (16 * w // 4) != 0:
            shown = f"{dim}" if dim == tile else f"{dim} (tile {tile})"
            return False, f"{name} {shown} does not split over {w // 4} warps"
    smem = bwd_smem_bytes(config, q_stages=1)
    if smem > SMEM_CAPACITY.get(config.target, 0):
        return False, f"tiles need {smem} B of shared memory, more than {config.target} has"
    return True, ""


def dq_accum_rows(rows: int, num_seqs: int, tile_m: int, varlen: bool) -> int:
    """Rows per (batch, head) of the sm80 backward's dQ accumulator for ``rows`` query rows
    (the packed total for varlen): Note [dQ accumulator in fragment order]."""
    if varlen:
        return rows + num_seqs * tile_m
    return -(-rows // tile_m) * tile_m


def dq_accum_offset(offset_q, seq, tile_m: int, varlen: bool):
    """First dQ accumulator row of sequence ``seq``, whose query rows start at ``offset_q``
    (host ints or device Int32; ``varlen`` a Python bool)."""
    return offset_q + seq * tile_m if varlen else offset_q


# Note [dQ accumulator in fragment order]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The sm80 backward adds each query block's dQ (tile_m x d, fp32) into dQaccum with one atomic
# per element. Stored row-major, one atomic instruction of a warp would touch 8 rows (4 lanes a
# row in the m16n8 accumulator layout), so 8 L2 requests: ncu on the H200 (d128 / d256, 4k)
# counted 8 requests per instruction and warps stalled on the full load/store queue for 16 % /
# 37 % of their cycles, where FA2's kernel, 1 request per instruction, stalled for none. So a
# block is stored in the order of the dQ MMA's C fragments: value i of thread t lies at
# i * num_threads + t, and an instruction of a warp covers 32 consecutive floats, one 128-byte
# line. The postprocess reads a block with the same tiled MMA (``flash_bwd.dq_tiled_mma``) and
# writes dQ row-major. Every block needs all its tile_m rows: dense calls pad each (batch,
# head) to a multiple of tile_m rows; varlen sequence b's blocks start at row
# cu_seqlens_q[b] + b * tile_m, so the last block of b ends before sequence b + 1's first
# (cu_seqlens_q[b] + b * tile_m + ceil(len_b / tile_m) * tile_m < cu_seqlens_q[b + 1] +
# (b + 1) * tile_m), and the buffer has total_q + num_seqs * tile_m rows. The sm90 backward keeps
# dQaccum row-major (its TMA reduce-adds write tiles of shared memory).


# --------------------------------------------------------------------------------------------
# The split-KV combine (ampere/flash_combine.py; runs on every GPU from sm80 up)

# Element types of the combine's partial outputs and of its output.
COMBINE_DTYPES = ("fp32", "bf16", "fp16")
COMBINE_MAX_HEAD_DIM = 512
# Elements a thread loads or stores at a time (16 bytes of fp32, 8 of 16-bit values): head dims,
# strides and pointers must allow it (cute_fa/combine.py checks them).
COMBINE_VEC = 4


@dataclass(frozen=True)
class CombineConfig:
    """Compile key of the combine kernel. Split counts, batch, rows and heads are runtime
    values; ``varlen`` (cu_seqlens) only matters with ``seqused`` (without it the combine is
    the same for every row), so the interface sets it only then."""

    arch: int
    target: str
    dtype_partial: str  # "fp32" | "bf16" | "fp16"
    dtype: str  # of the output: "fp32" | "bf16" | "fp16"
    head_dim: int
    has_lse: bool = True  # write the combined LSE
    varlen: bool = False  # packed rows: sequence b is rows cu_seqlens[b] : cu_seqlens[b + 1]
    seqused: bool = False  # rows of sequence b past seqused[b] are left untouched

    def __post_init__(self) -> None:
        for field in ("dtype_partial", "dtype"):
            value = getattr(self, field)
            if value not in COMBINE_DTYPES:
                raise ValueError(
                    f"CombineConfig.{field} must be one of {tuple(COMBINE_DTYPES)}, got {value!r}"
                )

    def replace(self, **changes) -> CombineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def name(self) -> str:
        flags = ["lse"] if self.has_lse else []
        flags += ["varlen"] if self.varlen else []
        flags += ["seqused"] if self.seqused else []
        return "_".join(
            [f"combine_sm{self.arch}", self.target, f"{self.dtype_partial}to{self.dtype}",
             f"d{self.head_dim}", *flags]
        )  # fmt: skip


def combine_can_implement(config: CombineConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionCombine implements ``config``, else (False, why)."""
    if config.arch != 80:
        return False, f"config is for sm{config.arch}, the combine kernel is sm80 (runs on sm80+)"
    d = config.head_dim
    if d <= 0 or d % 8 or d > COMBINE_MAX_HEAD_DIM:
        return False, f"head_dim {d} is not a positive multiple of 8 up to {COMBINE_MAX_HEAD_DIM}"
    if config.varlen and not config.seqused:
        return False, "varlen only matters with seqused (the combine is row-wise otherwise)"
    return True, ""
