"""Compile keys, the typed tuning each holds, and the sm80 tile tables.

A ``FwdConfig`` IS the compile key of a forward kernel: it holds exactly what changes the
generated code (architecture family, compile target, dtype, head dims, tile shape, feature flags)
and nothing else. Tensors, sequence lengths, batch and head counts never appear here: layouts
stay dynamic, so a new sequence length or batch reuses the compiled kernel.
"""

from __future__ import annotations

import dataclasses
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


class TuningError(ValueError):
    """A tuning field out of range (raised as is: never a reason to fall back)."""


@dataclass(frozen=True)
class Tiles:
    """Tuning of the sm80 kernels (forward and backward): the tile and nothing else."""

    tile_m: int  # query rows a CTA (backward: a step)
    tile_n: int  # keys a step (backward: a CTA)
    num_warps: int

    def __post_init__(self) -> None:
        _check_types(self)
        _check_tile(self.tile_m, self.tile_n)
        if self.num_warps not in (4, 8):
            raise TuningError(f"num_warps must be 4 or 8, got {self.num_warps!r}")

    @property
    def label(self) -> str:
        return f"{self.tile_m}x{self.tile_n}w{self.num_warps}"


# Choices of the forwards' numerics switches (Note [exp2 on the FMA pipe], Note [rescale
# threshold] in cute_fa/dsl/softmax.py).
EXP2_POLY_CHOICES = (0, 2, 4, 8, 16)
RESCALE_THRESHOLD_CHOICES = (0, 4, 8)


def _check_numerics(tuning) -> None:
    """TuningError unless the tuning's ``exp2_poly`` and ``rescale_threshold`` are choices."""
    if tuning.exp2_poly not in EXP2_POLY_CHOICES:
        raise TuningError(f"exp2_poly must be one of {EXP2_POLY_CHOICES}, got {tuning.exp2_poly!r}")
    if tuning.rescale_threshold not in RESCALE_THRESHOLD_CHOICES:
        raise TuningError(
            f"rescale_threshold must be one of {RESCALE_THRESHOLD_CHOICES}, "
            f"got {tuning.rescale_threshold!r}"
        )


@dataclass(frozen=True)
class Sm90FwdTuning:
    """Tuning of FlashAttentionForwardSm90 (hopper/flash_fwd.py); defaults by problem class in
    ``hopper/support.py fwd_default_tuning``. Every field changes the generated code."""

    tile_m: int = 128  # query rows a CTA: 64 a consumer warpgroup (128: two, 192: three)
    tile_n: int = 128  # keys a block (a multiple of 16 up to 256)
    # The O rescale and the P conversion of a key block wait until just before its P V GEMM is
    # issued, so the softmax's exponentials run while the previous P V is in flight.
    defer_rescale: bool = False
    exp2_poly: int = 0  # every exp2_poly-th exponential of an unmasked block by polynomial
    rescale_threshold: int = 0  # log2 units a row max must move by to rescale O; 0: any move
    # 0: one CTA a tile; > 0: a persistent grid (Note [persistent tiles] in
    # cute_fa/dsl/scheduler.py); planning puts the device's SM count here.
    num_ctas: int = 0
    pingpong: bool = True  # consumer warpgroups take turns issuing their GEMMs
    overlap: bool = True  # a consumer's softmax of block j overlaps its P V of block j - 1
    tma_store: bool = False  # O leaves by one TMA store a consumer (dense rows, dv == d)

    def __post_init__(self) -> None:
        _check_types(self)
        _check_tile(self.tile_m, self.tile_n)
        if self.tile_m not in (128, 192):
            raise TuningError(f"sm90 forward tile_m must be 128 or 192, got {self.tile_m!r}")
        _check_numerics(self)
        if self.num_ctas < 0:
            raise TuningError(f"num_ctas must be >= 0, got {self.num_ctas!r}")

    @property
    def num_warps(self) -> int:
        """The producer warpgroup and tile_m / 64 consumer warpgroups."""
        return 4 * (1 + self.tile_m // 64)

    @property
    def label(self) -> str:
        flags = [f"{self.tile_m}x{self.tile_n}w{self.num_warps}"]
        flags += ["defer"] if self.defer_rescale else []
        flags += [f"poly{self.exp2_poly}"] if self.exp2_poly else []
        flags += [f"thr{self.rescale_threshold}"] if self.rescale_threshold else []
        flags += [f"persistent{self.num_ctas}"] if self.num_ctas else []
        flags += [] if self.pingpong else ["nopingpong"]
        flags += [] if self.overlap else ["nooverlap"]
        flags += ["tmastore"] if self.tma_store else []
        return "_".join(flags)


@dataclass(frozen=True)
class Sm90BwdTuning:
    """Tuning of FlashAttentionBackwardSm90 (hopper/flash_bwd.py); defaults in
    ``hopper/support.py bwd_default_tuning``."""

    tile_m: int = 64  # query rows a step: 64, 128 (d 64) or 80 (d 128, dQ computed transposed)
    tile_n: int = 128  # keys a CTA
    q_stages: int = 0  # Q / dO (and LSE / delta) stages; 0: two (one above d 192)
    # tile_m 128 (d 64): each consumer computes dQ of its 64 query rows over all d columns
    # (one M = 64 atom, N = d), not d / 2 columns of all 128 rows (two M = 64 atoms).
    dq_by_rows: bool = False
    # d <= 128: the step issues dV, then dQ, then dK (dQ written to smem while dK runs), not
    # dV and dK, then dQ (dQ written with no WGMMA in flight).
    dq_before_dk: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        _check_tile(self.tile_m, self.tile_n)
        if self.q_stages not in (0, 1, 2, 3):
            raise TuningError(f"q_stages must be 0 (default), 1, 2 or 3, got {self.q_stages!r}")

    @property
    def num_warps(self) -> int:
        return 12  # one producer and two consumer warpgroups

    @property
    def label(self) -> str:
        flags = [f"{self.tile_m}x{self.tile_n}w{self.num_warps}"]
        flags += [f"q{self.q_stages}"] if self.q_stages else []
        flags += ["dqrows"] if self.dq_by_rows else []
        flags += ["dqfirst"] if self.dq_before_dk else []
        return "_".join(flags)


@dataclass(frozen=True)
class _Sm100Tiles:
    """The tiles of an sm100 kernel (16 warps, its roles in the kernel's docstring); its other
    choices are constants of ``blackwell/support.py`` until they are measured on a Blackwell
    GPU."""

    tile_m: int
    tile_n: int

    def __post_init__(self) -> None:
        _check_types(self)
        _check_tile(self.tile_m, self.tile_n)

    @property
    def num_warps(self) -> int:
        return 16

    @property
    def label(self) -> str:
        return f"{self.tile_m}x{self.tile_n}w{self.num_warps}"


# Stages of the sm100 forward's K/V ring a tuning may ask for; 0: the default of its head dims.
SM100_KV_STAGE_CHOICES = (0, 2, 3, 4, 5, 6)


@dataclass(frozen=True)
class Sm100FwdTuning(_Sm100Tiles):
    """Tuning of FlashAttentionForwardSm100 (blackwell/flash_fwd.py): two 128-row Q tiles a
    CTA (tile_m 256) and tile_n keys a block;
    the softmax's numerics (FA4's values by default, not measured here: no Blackwell GPU),
    the K/V ring's depth and the CTA pair (2-CTA MMA). Every field changes the generated
    code."""

    tile_m: int = 256
    tile_n: int = 128
    # In a block without a mask, every exp2_poly-th pair of a row's exponentials is the packed
    # polynomial on the FMA pipe (Note [exp2 on the FMA pipe]); 0: all on MUFU.
    exp2_poly: int = 8
    # Log2 units a row max must grow by before O is rescaled (Note [rescale threshold]); 0: on
    # every new max.
    rescale_threshold: int = 8
    kv_stages: int = 0  # K/V ring stages; 0: by head dims (blackwell/support.py)
    # A cluster of two CTAs runs each S = Q K^T and O += P V as one tcgen05 MMA of M = 256
    # (cta_group::2, issued by the even CTA), each CTA loading half of every K and V tile
    # (``FlashAttentionForwardSm100``'s docstring; ``blackwell/support.py`` says which calls).
    cta_pair: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_numerics(self)
        if self.kv_stages not in SM100_KV_STAGE_CHOICES:
            raise TuningError(
                f"kv_stages must be one of {SM100_KV_STAGE_CHOICES}, got {self.kv_stages!r}"
            )

    @property
    def label(self) -> str:
        flags = [super().label]
        flags += [f"poly{self.exp2_poly}"] if self.exp2_poly != 8 else []
        flags += [f"thr{self.rescale_threshold}"] if self.rescale_threshold != 8 else []
        flags += [f"kv{self.kv_stages}"] if self.kv_stages else []
        flags += ["pair"] if self.cta_pair else []
        return "_".join(flags)


@dataclass(frozen=True)
class Sm100BwdTuning(_Sm100Tiles):
    """Tuning of FlashAttentionBackwardSm100 (blackwell/flash_bwd.py): tile_n keys a CTA (the M
    of its tcgen05 MMAs) and tile_m query rows a step; the CTA pair."""

    tile_m: int = 128
    tile_n: int = 128
    # A cluster of two CTAs (2 x tile_n keys) runs every GEMM as one cta_group::2 tcgen05 MMA
    # (M = 256 keys; dQ M = 128 queries, 64 a CTA). Planned (Note [backward TMEM plan] in
    # blackwell/support.py), not built: ``bwd_can_implement`` declines it, saying why.
    cta_pair: bool = False

    @property
    def label(self) -> str:
        return super().label + ("_pair" if self.cta_pair else "")


def check_field_types(cls: type, values: dict) -> None:
    """TuningError unless each of ``values`` has the declared type of ``cls``'s field of that
    name: an int (not a bool) for int fields, a bool for bool fields (so ``pingpong="off"`` or
    ``num_ctas=1.5`` never reach a kernel as something truthy)."""
    types = {f.name: (f.type if isinstance(f.type, str) else f.type.__name__)
             for f in dataclasses.fields(cls)}  # fmt: skip
    for name, value in values.items():
        want = types.get(name)
        if want == "bool" and not isinstance(value, bool):
            raise TuningError(f"{name} must be True or False, got {value!r}")
        if want == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise TuningError(f"{name} must be an int, got {value!r}")


def _check_types(tuning) -> None:
    check_field_types(type(tuning), dataclasses.asdict(tuning))


def _check_tile(tile_m: int, tile_n: int) -> None:
    for name, value in (("tile_m", tile_m), ("tile_n", tile_n)):
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value % 16
            or not 16 <= value <= 256
        ):
            raise TuningError(f"{name} must be a multiple of 16 from 16 to 256, got {value!r}")


Tuning = Tiles | Sm90FwdTuning | Sm90BwdTuning | Sm100FwdTuning | Sm100BwdTuning
# The tuning of each kernel family, by the family's name in overrides (``cute_fa.tuning``) and
# in the per-GPU tuned tables (``cute_fa/tuned.py``).
TUNING_CLASSES: dict[str, type] = {
    "sm80_fwd": Tiles,
    "sm80_bwd": Tiles,
    "sm90_fwd": Sm90FwdTuning,
    "sm90_bwd": Sm90BwdTuning,
    "sm100_fwd": Sm100FwdTuning,
}

_FLAGS = ("causal", "local", "varlen_q", "varlen_k", "seqused_q", "seqused_k")


@dataclass(frozen=True)
class _Key:
    """Fields and naming shared by the forward and backward compile keys."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def with_tuning(self, **changes):
        """This key with some fields of its tuning changed."""
        return dataclasses.replace(self, tuning=dataclasses.replace(self.tuning, **changes))

    @property
    def tile_m(self) -> int:
        return self.tuning.tile_m

    @property
    def tile_n(self) -> int:
        return self.tuning.tile_n

    @property
    def num_warps(self) -> int:
        return self.tuning.num_warps

    def _name(self, kind: str, extra: list[str]) -> str:
        flags = [f for f in _FLAGS if getattr(self, f)]
        if self.has_softcap:
            flags.append("softcap")
        dv = "" if self.head_dim_v == self.head_dim else f"x{self.head_dim_v}"
        return "_".join(
            [f"{kind}_sm{self.arch}", self.target, self.dtype, f"d{self.head_dim}{dv}",
             self.tuning.label, *flags, *extra]
        )  # fmt: skip

    def _check(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"{type(self).__name__}.dtype must be one of {DTYPES}, got {self.dtype!r}"
            )
        if self.causal and self.local:
            raise ValueError(f"{type(self).__name__}: causal and local are exclusive")


@dataclass(frozen=True)
class FwdConfig(_Key):
    """Compile key of a forward kernel. Every field changes the generated code; the
    architecture-specific choices are one typed field, ``tuning``."""

    arch: int  # kernel family: 80 (ampere package), 90 (hopper), 100 (blackwell)
    target: str  # compile target, e.g. "sm_90a"; see TARGETS
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    head_dim_v: int
    tuning: Tuning  # Tiles (sm80), Sm90FwdTuning (sm90), Sm100FwdTuning (sm100)
    causal: bool = False
    local: bool = False  # sliding window; window bounds are runtime values
    has_softcap: bool = False  # the softcap value itself is a runtime value
    varlen_q: bool = False  # cu_seqlens_q given
    varlen_k: bool = False  # cu_seqlens_k given
    seqused_q: bool = False
    seqused_k: bool = False
    # Split-KV: each CTA runs one of num_splits ranges of its key blocks and writes fp32 O and
    # its LSE to the partial buffers (the split count is a runtime value; cute_fa/ops.py runs
    # the combine, ampere/flash_combine.py).
    split_kv: bool = False
    # Packed GQA (Note [packed GQA] in cute_fa/dsl/pack_gqa.py): the query heads per K/V head
    # whose rows share a tile (>= 2), or 0 (one head a tile). A compile-time constant: it is
    # part of the tensors' layouts.
    pack_gqa: int = 0
    # Paged K/V (flash_attn.cute's page_table): the keys per page, a compile-time constant (its
    # divisions and the TMA boxes depend on it); 0: K and V are (batch, seqlen, ...) tensors.
    page_size: int = 0

    def __post_init__(self) -> None:
        self._check()
        if (
            isinstance(self.page_size, bool)
            or not isinstance(self.page_size, int)
            or (self.page_size < 0)
        ):
            raise ValueError(f"FwdConfig.page_size must be an int >= 0, got {self.page_size!r}")
        if self.page_size and self.varlen_k:
            raise ValueError("FwdConfig: paged K/V (page_size) takes no cu_seqlens_k (varlen_k)")
        if isinstance(self.pack_gqa, bool) or not isinstance(self.pack_gqa, int):
            raise ValueError(f"FwdConfig.pack_gqa must be an int, got {self.pack_gqa!r}")
        if self.pack_gqa == 1 or self.pack_gqa < 0:
            raise ValueError(
                f"FwdConfig.pack_gqa must be 0 (off) or the query heads per K/V head (>= 2), "
                f"got {self.pack_gqa}"
            )

    @property
    def name(self) -> str:
        """Short human-readable name, used in messages and cache file names."""
        extra = ["splitkv"] if self.split_kv else []
        extra += [f"packgqa{self.pack_gqa}"] if self.pack_gqa else []
        extra += [f"page{self.page_size}"] if self.page_size else []
        return self._name("fwd", extra)


# Head dims the sm80 kernels' tiles are built for (their smem layouts, MMA shapes and the tile
# tables below); every other multiple of 8 up to 256 runs the tile of the next one up (Note
# [rounded head dims]).
SM80_TILE_HEAD_DIMS = (64, 96, 128, 192, 256)
# (head_dim, head_dim_v) pairs with dv != d that the sm80 kernels take (Q and K of one head dim,
# V and O of another; both exact tile head dims): the tile tables are those of head_dim.
SM80_HEAD_DIM_PAIRS = ((128, 64), (192, 128))


def tile_head_dim(head_dim: int) -> int:
    """The sm80 kernels' tile head dim for ``head_dim`` (a multiple of 8 from 8 to 256): the
    smallest of SM80_TILE_HEAD_DIMS that holds it (Note [rounded head dims])."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise ValueError(f"head_dim must be an int, got {head_dim!r}")
    if head_dim <= 0 or head_dim % 8 or head_dim > SM80_TILE_HEAD_DIMS[-1]:
        raise NotImplementedError(
            f"head_dim {head_dim} is not a positive multiple of 8 up to {SM80_TILE_HEAD_DIMS[-1]}"
        )
    return next(t for t in SM80_TILE_HEAD_DIMS if t >= head_dim)


# Note [rounded head dims]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The sm80 kernels take every head dim d that is a multiple of 8 up to 256 (Stable Diffusion's 40
# / 80 / 160, Phi-2's 80, ...): 8 16-bit elements are one 16-byte chunk, so a row of d elements
# is whole cp.async chunks and its stride keeps 16-byte alignment. A kernel builds its tiles for
# the tile head dim tile_head_dim(d) (64 for 8-64, 96 for 72-96, 128 for 104-128, 192 for
# 136-192, 256 for 200-256): shared-memory layouts, MMA shapes and the tuned tiles are those of
# that head dim. The user's tensors are read and written as they are (no copy, no padding):
# - loads of Q, K, V (and dO in the backward) skip the 16-byte chunks of columns >= d (a
#   predicate a chunk, beside the row predicate of the sequence tails), and those columns of
#   the shared-memory tiles are zeroed once when a CTA starts (no load ever writes them): Q K^T
#   over the padded columns adds exact zeros, dO V^T likewise;
# - P V (and dK, dV, dQ) compute padded output columns that are never stored: the stores of O,
#   dQ, dK and dV write the first d (dv) columns only (LSE and delta are per row);
# - the backward's fp32 dQ accumulator (an internal buffer, zeroed by the preprocess) has
#   tile_head_dim(d) columns, in the dQ MMA's fragment order (Note [dQ accumulator in
#   fragment order] in ampere/support.py); its padded columns stay 0 and the postprocess writes
#   d columns of dQ.
# The compile key keeps the real head dim (its name shows it, d40) and the kernel derives the
# tile head dim; tile tables are looked up by the tile head dim. The work of the padded columns
# is spent (d 72 computes as d 96): a kernel with exact tiles would pay only where a head dim is
# common enough to tune for. (Skipping the 16-wide k-slices of Q K^T that hold only padded
# columns was tried: it cost more spills in the 4-warp tiles at the 255-register cap than it
# saved work, docs/log/sm80.md, 2026-12-05.)
# (head_dim, head_dim_v) pairs (SM80_HEAD_DIM_PAIRS, both exact tile head dims): the K side (Q,
# K, dQ, dK) and the V side (V, O, dO, dV) each have their own tile head dim.


def sm80_tile_dims(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """(tile head dim of Q and K, of V and O) of an sm80 kernel (Note [rounded head dims])."""
    return tile_head_dim(head_dim), tile_head_dim(head_dim_v)


def dq_accum_head_dim(arch: int, head_dim: int) -> int:
    """Columns of the backward's fp32 dQ accumulator: the sm80 kernel's tile head dim (Note
    [rounded head dims]), the head dim for the other families."""
    return tile_head_dim(head_dim) if arch == 80 else head_dim


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


def sm80_fwd_tile(head_dim: int, target: str, causal: bool = False) -> Tiles:
    """The sm80 forward kernel's tile for a head dim (the table's entry of its tile head dim,
    Note [rounded head dims]) and target."""
    big_smem = SMEM_CAPACITY.get(target, 0) >= 160 * 1024
    try:
        tile_d = tile_head_dim(head_dim)
    except NotImplementedError as e:
        raise NotImplementedError(f"the sm80 forward kernel: {e}") from None
    if causal and big_smem and tile_d in SM80_FWD_TILES_CAUSAL:
        return Tiles(*SM80_FWD_TILES_CAUSAL[tile_d])
    table = SM80_FWD_TILES if big_smem else SM80_FWD_TILES_SMALL_SMEM
    return Tiles(*table[tile_d])


@dataclass(frozen=True)
class BwdConfig(_Key):
    """Compile key of a backward kernel. Every field changes the generated code."""

    arch: int
    target: str
    dtype: str
    head_dim: int
    head_dim_v: int
    tuning: Tuning  # Tiles (sm80: tile_m query rows a step, tile_n keys a CTA), Sm90BwdTuning
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

    def __post_init__(self) -> None:
        self._check()
        if self.det_coresident and (not self.deterministic or self.local):
            raise ValueError("BwdConfig: det_coresident needs deterministic and no window")

    @property
    def name(self) -> str:
        extra = ["deterministic"] if self.deterministic else []
        extra += ["coresident"] if self.det_coresident else []
        return self._name("bwd", extra)


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


def sm80_bwd_tile(head_dim: int, target: str) -> Tiles:
    """The sm80 backward kernel's tile (the table's entry of the tile head dim, Note [rounded
    head dims])."""
    try:
        tile_d = tile_head_dim(head_dim)
    except NotImplementedError as e:
        raise NotImplementedError(f"the sm80 backward kernel: {e}") from None
    big_smem = SMEM_CAPACITY.get(target, 0) >= 160 * 1024
    if big_smem and tile_d in SM80_BWD_TILES_LARGE_SMEM:
        return Tiles(*SM80_BWD_TILES_LARGE_SMEM[tile_d])
    if not big_smem and tile_d in SM80_BWD_TILES_SMALL_SMEM:
        return Tiles(*SM80_BWD_TILES_SMALL_SMEM[tile_d])
    return Tiles(*SM80_BWD_TILES[tile_d])
