"""What the sm100 kernels can do, without importing the CuTe DSL.

``fwd_can_implement`` is ``FlashAttentionForwardSm100.can_implement``; keeping it here lets a
caller (dispatch, the feature matrix, tests) ask without importing the DSL. The tuning knobs of
the sm100 forward are module constants for now; the kernel reads each of them once, in its
``__init__``, so they can move into a typed tuning field of the compile key.

Nothing of this has run on a Blackwell GPU: the kernel is cross-compiled for sm_100a / sm_103a
and checked by its SASS (tests/test_compile_sm100.py, docs/blackwell.md).
"""

from __future__ import annotations

import dataclasses

from cute_fa.config import SMEM_CAPACITY, BwdConfig, FwdConfig, Sm100BwdTuning, Sm100FwdTuning

SM100_FWD_TARGETS = ("sm_100a", "sm_103a")

# One CTA runs two Q tiles of SM100_FWD_TILE_Q query rows (the M of one tcgen05 MMA and the 128
# TMEM lanes), or one where two do not fit TMEM (d 256, (192, 192)); config.tile_m is the CTA's
# rows, q_tiles * SM100_FWD_TILE_Q (``fwd_q_tiles``). Key blocks of tile_n keys.
SM100_FWD_TILE_Q = 128
# Rows of the O tile the epilogue warp stores per pass (16 registers a lane at dv 128).
SM100_FWD_EPI_ROWS = 8
# Packed GQA (Note [packed GQA] in cute_fa/dsl/pack_gqa.py): the packed rows are cut into Q
# boxes of a Q tile and epilogue stores of SM100_FWD_EPI_ROWS rows, so the group size divides
# both (or is a multiple of them).
SM100_FWD_PACK_GQA_TILES = (SM100_FWD_TILE_Q, SM100_FWD_EPI_ROWS)
SM100_FWD_Q_TILES = 2  # the default: two Q tiles (ping-pong softmax warpgroups)
SM100_FWD_TILE_M = SM100_FWD_Q_TILES * SM100_FWD_TILE_Q
# The CTA's rows a tuning may ask for: one Q tile (128) or two (256).
SM100_FWD_TILE_MS = (SM100_FWD_TILE_Q, SM100_FWD_TILE_M)
SM100_FWD_TILE_N = 128
SM100_FWD_WARPS = 16
SM100_FWD_TILE = (SM100_FWD_TILE_M, SM100_FWD_TILE_N, SM100_FWD_WARPS)
# (head_dim, head_dim_v): what fits the TMEM plan (below) and shared memory and compiles without
# local memory (d 96: 2 x 128 + 2 x 96 = 448 columns). d 256 and (192, 192) need 2 * 128 + 2 * dv
# > 512 columns with two Q tiles: they run one Q tile a CTA (tile_m 128: 128 + dv <= 384 columns,
# one softmax warpgroup; FA4 runs d 256 with a dedicated 2-CTA kernel instead, docs/blackwell.md).
# (192, 128) fits and compiles, but its MMA warp goes to local memory (43 LDL / 23 STL at 80
# registers, 58 / 31 at 64): ptxas hoists the 2 x 12 loop-invariant smem descriptors of the two Q
# tiles (K phases of 16) out of the key loop, more than the uniform registers hold. Needs
# descriptors built per K phase from one base (FA4 does this in its own gemm helper); rejected until
# then.
SM100_FWD_HEAD_DIM_PAIRS = ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))

# Tensor memory: 512 columns of 32 bits x 128 lanes an SM. Plan (columns), two Q tiles:
#   S0 [0, tile_n)  S1 [tile_n, 2 tile_n)  O0 [2 tile_n, 2 tile_n + dv)  O1 [.., + dv)
# one Q tile: S0 [0, tile_n)  O0 [tile_n, tile_n + dv) (d 256: 128 + 256 = 384).
# P_i (16-bit, tile_n / 2 columns) overwrites the first half of S_i.
TMEM_COLUMNS = 512


def fwd_tmem_columns(tile_n: int, head_dim_v: int, q_tiles: int = SM100_FWD_Q_TILES) -> int:
    """Columns of the forward's TMEM plan: an S/P tile and an O tile per Q tile."""
    return q_tiles * (tile_n + head_dim_v)


def fwd_q_tiles(config: FwdConfig) -> int:
    """Q tiles of 128 rows a CTA runs: tile_m / 128 (1 or 2)."""
    return config.tile_m // SM100_FWD_TILE_Q


def fwd_default_tile_m(head_dim_v: int, tile_n: int = SM100_FWD_TILE_N) -> int:
    """The CTA's rows by default: two Q tiles where their TMEM plan fits, else one."""
    fits = fwd_tmem_columns(tile_n, head_dim_v) <= TMEM_COLUMNS
    return SM100_FWD_TILE_M if fits else SM100_FWD_TILE_Q


# Registers a thread after setmaxnreg, by role: (softmax, correction, other) by (d, dv). The
# whole CTA: 128 * (2 * softmax + correction + other) <= 65536 (512 threads launch at 128 each).
# Two softmax warpgroups hold a row of S (tile_n fp32) and its P, the correction warpgroup a
# 32-column slice of O, the rest (MMA, load, epilogue, idle warp) addresses and pipeline
# states. 192 / 80 / 48 are FA4's defaults at d 128.
SM100_FWD_REGS = {
    (64, 64): (192, 80, 48),
    (96, 96): (192, 80, 48),
    (128, 128): (192, 80, 48),
    (192, 128): (192, 80, 48),
    # One Q tile: the second softmax warpgroup (warps 4-7) idles at the "other" budget, the
    # correction warpgroup takes 128 (at 80 its final O -> smem pass over dv 256 held the
    # swizzled smem addresses of its chunks in local memory: 16 bytes, 6 LDL / 6 STL) and the
    # one softmax warpgroup 256 (at 192 the sliding window's step spilled 16 bytes on sm_100a).
    (192, 192): (256, 128, 48),
    (256, 256): (256, 128, 48),
}


def fwd_regs_total(regs: tuple[int, int, int], q_tiles: int) -> int:
    """Registers of the CTA after setmaxnreg: a softmax warpgroup per Q tile, the unused
    softmax warpgroup (one Q tile) at the "other" budget, correction, the last warpgroup."""
    softmax, correction, other = regs
    return 128 * (q_tiles * softmax + (2 - q_tiles) * other + correction + other)


for (_d, _dv), _regs in SM100_FWD_REGS.items():
    assert fwd_regs_total(_regs, fwd_default_tile_m(_dv) // SM100_FWD_TILE_Q) <= 65536
    assert fwd_regs_total(_regs, 1) <= 65536
    assert all(r % 8 == 0 for r in _regs)
# softcap with dv 128: the correction warpgroup takes 88 and the rest 40 (at 80 / 48 CUDA 12.9's
# ptxas spilled the correction warps, 3 LDL / STL; CUDA 13's did not; both are clean at 88 / 40).
SM100_FWD_REGS_SOFTCAP_DV128 = (192, 88, 40)
assert 128 * (2 * 192 + 88 + 40) <= 65536


def fwd_regs(config: FwdConfig) -> tuple[int, int, int]:
    """(softmax, correction, other) registers after setmaxnreg for ``config``."""
    if config.has_softcap and config.head_dim_v == 128:
        return SM100_FWD_REGS_SOFTCAP_DV128
    return SM100_FWD_REGS[(config.head_dim, config.head_dim_v)]


# The softmax's numerics are fields of Sm100FwdTuning (cute_fa/config.py): the conditional
# rescale (``rescale_threshold``, Note [rescale threshold] in cute_fa/dsl/softmax.py; FA4: 8
# for 16-bit inputs) and the software exp2 (``exp2_poly``: in blocks without a mask every k-th
# pair of a row's exponentials is the packed polynomial, cute_fa/dsl/fastmath.py; FA4 emulates
# about 1 in 10 at d 128). Both defaults are FA4's values, not measured here (no Blackwell GPU).
# Stages of the K/V ring (K[n] and V[n] take one stage each) by (head_dim, head_dim_v), where
# the tuning's ``kv_stages`` is 0: what fits 227 KiB with two Q tiles (O is staged in the Q
# tiles' smem; (192, 128) would take 2).
# One Q tile: (192, 192) takes 3 (48 KiB of Q + 3 x 48 KiB), d 256 2 (64 KiB + 2 x 64 KiB).
SM100_FWD_KV_STAGES = {(64, 64): 4, (96, 96): 4, (128, 128): 4, (192, 128): 2, (192, 192): 3,
                       (256, 256): 2}  # fmt: skip
# mbarriers, the LSE/scale exchange (2 x 2 x 128 fp32) and 1024-byte alignment of the tiles.
SM100_FWD_SMEM_SLACK = 4096

# The CTA pair (Sm100FwdTuning.cta_pair; 2-CTA tcgen05 MMAs of M = 256, cluster (2, 1, 1)):
# each CTA holds half of every K and V tile, so a stage costs half. The head dims FA4 runs with
# 2-CTA instructions (flash_attn/cute/interface.py: d rounded to 16 in {128, 192}, dv 128), and
# FA4's ring depth for them (its _setup_attributes: 224 KiB less Q and O over the halved stage:
# 6 at d 128, 5 at (192, 128)); not measured here.
SM100_FWD_PAIR_HEAD_DIM_PAIRS = ((128, 128), (192, 128))
SM100_FWD_PAIR_KV_STAGES = {(128, 128): 6, (192, 128): 5}


def fwd_ctas(config: FwdConfig) -> int:
    """CTAs of one MMA: 2 with the tuning's ``cta_pair``, else 1."""
    return 2 if getattr(config.tuning, "cta_pair", False) else 1


def fwd_kv_stages(config: FwdConfig) -> int:
    """Stages of the forward's K/V ring: the tuning's ``kv_stages``, or by head dims."""
    asked = getattr(config.tuning, "kv_stages", 0)
    pair = (config.head_dim, config.head_dim_v)
    if fwd_ctas(config) == 2:
        return asked or SM100_FWD_PAIR_KV_STAGES.get(pair, 2)
    return asked or SM100_FWD_KV_STAGES.get(pair, 2)


def fwd_smem_bytes(config: FwdConfig) -> int:
    """Shared memory of the forward (a CTA): its Q tiles and the K/V ring (stages of the larger
    of a K and a V tile; with the CTA pair, half of one), 16-bit elements, plus slack."""
    stages = fwd_kv_stages(config)
    q = config.tile_m * config.head_dim * 2
    kv = stages * config.tile_n * max(config.head_dim, config.head_dim_v) * 2 // fwd_ctas(config)
    return q + kv + SM100_FWD_SMEM_SLACK


def fwd_pair_can_implement(config: FwdConfig) -> tuple[bool, str]:
    """Whether the CTA pair takes ``config`` (the rest of ``fwd_can_implement`` aside)."""
    pair = (config.head_dim, config.head_dim_v)
    if fwd_q_tiles(config) != SM100_FWD_Q_TILES:
        return False, "cta_pair with one Q tile (tile_m 128): the CTA pair runs two Q tiles a CTA"
    if pair not in SM100_FWD_PAIR_HEAD_DIM_PAIRS:
        return False, (
            f"cta_pair at head_dim {config.head_dim} / head_dim_v {config.head_dim_v}: the CTA "
            f"pair is built for {SM100_FWD_PAIR_HEAD_DIM_PAIRS} (FA4's 2-CTA head dims)"
        )
    if config.seqused_k:
        return False, (
            "cta_pair with seqused_k: the zeroing of the V rows past seqused_k (load_v_tail) "
            "waits on a barrier of its own CTA, and a pair's V TMA completes on the even CTA's"
        )
    if config.has_softcap:
        # Measured 2026-12-05 (DSL 4.8.1): 8 bytes of stack at d 128 (1 LDL / 1 STL in the
        # softmax warps at 192 registers) and at (192, 128) plain; (192, 128) causal + varlen
        # and window + packed GQA compiled clean.
        return False, (
            "cta_pair with softcap: the softmax warps spill (8 bytes of local memory at 192 "
            "registers); the single CTA serves it"
        )
    return True, ""


def fwd_pair_wanted(config: FwdConfig, seqlen_q: int | None) -> bool:
    """Whether dispatch takes the CTA pair for ``config``: FA4's rule for its 2-CTA forward
    (flash_attn/cute/interface.py, ``use_2cta_instrs``), unmeasured here: no causal mask, no
    window, dense query rows (no cu_seqlens_q / seqused_q), (d, dv) of
    ``SM100_FWD_PAIR_HEAD_DIM_PAIRS``, more than 2 x 128 query rows; and where the pair
    implements the rest (``fwd_pair_can_implement``). ``seqlen_q``: the query rows of the
    call as planning passes them (packed GQA: already times the heads a K/V head, as FA4's
    ``seqlen_q_packgqa``); None (unknown): no. Split-KV and paged K/V do not reach the sm100
    forward here."""
    if seqlen_q is None or config.causal or config.local or config.varlen_q or config.seqused_q:
        return False
    return seqlen_q > 2 * SM100_FWD_TILE_Q and fwd_pair_can_implement(config)[0]


def fwd_can_implement(config: FwdConfig) -> tuple[bool, str]:
    """Whether FlashAttentionForwardSm100 compiles ``config``; else the reason."""
    if config.arch != 100:
        return False, f"FlashAttentionForwardSm100 is the sm100 family, not sm{config.arch}"
    if config.target not in SM100_FWD_TARGETS:
        return False, f"target {config.target}: the sm100 forward needs one of {SM100_FWD_TARGETS}"
    pair = (config.head_dim, config.head_dim_v)
    if pair not in SM100_FWD_HEAD_DIM_PAIRS:
        return False, (
            f"head_dim {config.head_dim} / head_dim_v {config.head_dim_v}: the sm100 forward "
            f"takes {SM100_FWD_HEAD_DIM_PAIRS}"
        )
    if not isinstance(config.tuning, Sm100FwdTuning):
        return False, f"tuning {type(config.tuning).__name__} is not an Sm100FwdTuning"
    if (
        config.tile_m not in SM100_FWD_TILE_MS
        or (config.tile_n, config.num_warps) != SM100_FWD_TILE[1:]
    ):
        tile = f"{config.tile_m}x{config.tile_n}w{config.num_warps}"
        return False, (
            f"tile {tile}: the sm100 forward needs tile_m in {SM100_FWD_TILE_MS}, tile_n "
            f"{SM100_FWD_TILE_N}, {SM100_FWD_WARPS} warps"
        )
    columns = fwd_tmem_columns(config.tile_n, config.head_dim_v, fwd_q_tiles(config))
    if columns > TMEM_COLUMNS:
        return False, (
            f"the TMEM plan needs {columns} columns (more than 512) with "
            f"{fwd_q_tiles(config)} Q tiles: head_dim_v {config.head_dim_v} takes tile_m 128"
        )
    if fwd_ctas(config) == 2:
        ok, reason = fwd_pair_can_implement(config)
        if not ok:
            return False, reason
    if fwd_smem_bytes(config) > SMEM_CAPACITY[config.target]:
        return False, f"shared memory {fwd_smem_bytes(config)} bytes exceeds the target's"
    g = config.pack_gqa
    if g and not all(n % g == 0 or g % n == 0 for n in SM100_FWD_PACK_GQA_TILES):
        return False, (
            f"pack_gqa with {g} query heads per K/V head: the packed rows take {SM100_FWD_TILE_Q}"
            f"-row Q boxes and {SM100_FWD_EPI_ROWS}-row stores, which needs the heads per K/V "
            f"head to divide them or be a multiple of them (powers of two)"
        )
    return True, ""


def fwd_config(d: int, dv: int, target: str = "sm_100a", dtype: str = "bf16", **flags) -> FwdConfig:
    """The compile key of the sm100 forward for (d, dv) and the feature flags (one Q tile a CTA
    where two do not fit TMEM: ``fwd_default_tile_m``)."""
    tuning = Sm100FwdTuning(tile_m=fwd_default_tile_m(dv), tile_n=SM100_FWD_TILE_N)
    return FwdConfig(arch=100, target=target, dtype=dtype, head_dim=d, head_dim_v=dv,
                     tuning=tuning, **flags)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Backward (FlashAttentionBackwardSm100, blackwell/flash_bwd.py): compile-only, not dispatched.
# ----------------------------------------------------------------------------------------------
# One CTA owns SM100_BWD_TILE_N keys (the M of every tcgen05 MMA but dQ's, and the 128 TMEM
# lanes) and steps over query blocks of SM100_BWD_TILE_M rows (the N of S^T / dP^T, the M of dQ).
SM100_BWD_TILE_M = 128
SM100_BWD_TILE_N = 128
SM100_BWD_WARPS = 16
SM100_BWD_TILE = (SM100_BWD_TILE_M, SM100_BWD_TILE_N, SM100_BWD_WARPS)
# d = dv only: what the single-CTA TMEM plan (below) holds. (192, 128) fits 512 columns only
# with the CTA pair's plan; (192, 192) and d 256 fit neither (``bwd_tmem_plan``).
SM100_BWD_HEAD_DIMS = (64, 96, 128)
# (d, dv) the CTA pair's TMEM plan holds (FA4's 2-CTA backward head dims).
SM100_BWD_PAIR_HEAD_DIM_PAIRS = ((128, 128), (192, 128))
# Registers a thread after setmaxnreg, per warpgroup (setmaxnreg is warpgroup-wide): (compute,
# dq, other). 128 * (2 * compute + dq + other) <= 65536 (512 threads launch at 128 each). A
# compute thread holds one key row of P^T (64 fp32 of its half) and a 32-column chunk of dP^T;
# a dQ thread a 16-column chunk of its query row of dQ. The last warpgroup holds the MMA warp,
# whose loop-invariant smem descriptors (five GEMMs, two 32-bit words a K phase) ptxas keeps
# in registers: at 48 or 88 it spilled them (d 128: 40 / 5 LDL), at 96 it does not. Compute
# spilled at 120 (d 128), dQ did not at 64.
SM100_BWD_REGS = (168, 80, 96)
assert 128 * (2 * SM100_BWD_REGS[0] + SM100_BWD_REGS[1] + SM100_BWD_REGS[2]) <= 65536
assert all(r % 8 == 0 for r in SM100_BWD_REGS)
# Q (and LSE / delta) stages and dO stages: Q(i + 1) is loaded while block i runs (S(i + 1) is
# issued before dK(i) reads Q(i)); dO(i + 1) waits for dV(i) (one stage fits 227 KiB at d 128).
SM100_BWD_Q_STAGES = 2
SM100_BWD_DO_STAGES = 1
# dQ leaves TMEM in chunks of this many columns (fp32), staged in smem in SM100_BWD_DQ_STAGES
# buffers of (tile_m, chunk), each added to dQaccum by one TMA reduce-add.
SM100_BWD_DQ_CHUNK = 16
SM100_BWD_DQ_STAGES = 2
# mbarriers, the TMEM address and 1024-byte alignment of the tiles.
SM100_BWD_SMEM_SLACK = 2048


# Note [backward TMEM plan]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Columns (32 bits, 128 lanes; 512 an SM) a CTA needs, keys x queries computed transposed so
# the CTA's 128 keys are the 128 lanes of S^T, dP^T, dV, dK; tile_m = 128 queries a step.
#   S^T tile_m, dP^T tile_m, dV dv, dK d: fp32 accumulators, all live across a step (dV / dK
#   across the whole CTA); P^T (16-bit) lives over S^T's columns.
#   dQ (queries x d, fp32): one CTA, M = tile_m queries in 128 lanes: d columns; the CTA pair
#   (one cta_group::2 MMA of M = 128 queries, 64 a CTA, K = both CTAs' 256 keys): d / 2
#   columns a CTA, the 64 rows in lanes 0-63 for the first d / 2 columns and in lanes 64-127
#   for the rest (the DSL's layout, checked in tests/test_compile_sm100_bwd.py; FA4 allocates
#   d / 2). It lives over dP^T (dead once loaded), so it needs d (or d / 2) <= tile_m.
#   dS^T: one CTA, to smem (the A operand of dK, and transposed of dQ). The pair: a 2-CTA
#   MMA's smem descriptors (issued by the even CTA) address the same offset in both CTAs, so
#   dQ's A operand (each CTA: its 64 queries x the pair's 256 keys, in key order) is a tile of
#   its own that each CTA's compute warps fill with their keys' dS, the partner's half across
#   the cluster; a second smem copy of dS^T for dK does not fit (``bwd_smem_bytes``), so dK
#   takes dS^T from TMEM (A from TMEM, as dV takes P^T; FA4 does so): 16-bit, each compute
#   warpgroup's half over the first half of its own dP^T columns (as P^T over S^T: no barrier
#   between the warpgroups), and dQ moves to dP^T's end (it may cover dS^T columns: dQ(i) is
#   issued after dK(i), which reads them, by the same thread).
# One CTA, 2 tile_m + d + dv (+ what dQ needs beyond dP^T's columns): d 64: 384, d 96: 448,
#   d 128: 512; (192, 128): 576 + 64 = 640, (192, 192): 704, d 256: 896: no.
# CTA pair (cta_group::2, M = 256 keys a pair, each CTA's 128 keys in its own 128 lanes: the
#   pair halves no key-row accumulator, only dQ and the smem of the B operands):
#   d 128: 512: S^T [0, 128) (P^T [0, 32) and [64, 96)), dP^T [128, 256) with dS^T [128, 160)
#   and [192, 224) and dQ (64) [192, 256) over it, dV [256, 384), dK [384, 512).
#   (192, 128): 2 x 128 + 192 + 128 = 576 > 512, so S^T and dP^T share 64 columns: dP^T
#   starts at S^T's second half, over the second warpgroup's P^T, so each block runs S(i),
#   dV(i) (once both P^T halves are stored), dP(i) (issued after the dV that reads them),
#   dK(i), dQ(i), and S(i + 1) only once dQ(i) is drained (and dP^T(i) loaded):
#   S^T [0, 128), P^T [0, 32) and [64, 96), dP^T [64, 192), dS^T [64, 96) and [128, 160),
#   dQ (96) [96, 192), dV [192, 320), dK [320, 512): 1.5 x 128 + 192 + 128 = 512. (FA4,
#   flash_bwd_sm100.py, the same sharing in another order: dV 0, dK 128, S 320, dP 384, dS
#   384, dQ 416.) tests/test_sm100_bwd_protocol.py checks both orders (and the single CTA's)
#   over every interleaving of the roles.
#   One CTA could hold (192, 128) in 512 the same way only with dQ (192) over S^T and dP^T
#   both (S(i + 1) behind the dQ drain too) and one Q stage (217088 bytes of smem; two:
#   266240 > 227 KiB); not the plan: FA4 takes the pair there.
#   (192, 192): 1.5 x 128 + 384 = 576; d 256: 704: no (FA4's fused backward takes dv <= 128;
#   it runs d 256 as two other kernels, dQ and dK / dV with 64-key tiles).


def bwd_tmem_columns(tile_m: int, head_dim: int, head_dim_v: int, ctas: int = 1) -> int:
    """Columns the backward's TMEM plan needs (Note [backward TMEM plan]); may exceed 512.
    One CTA: S^T, dP^T (dQ over it), dV, dK; where that exceeds 512, the pair shares half of
    S^T with dP^T; a dQ wider than dP^T adds its excess."""
    cols = 2 * tile_m + head_dim + head_dim_v
    if ctas == 2 and cols > TMEM_COLUMNS:
        cols -= tile_m // 2
    return cols + max(0, head_dim // ctas - tile_m)


def bwd_tmem_plan(tile_m: int, head_dim: int, head_dim_v: int, ctas: int = 1) -> dict[str, int]:
    """First TMEM column of each accumulator of the backward (and "total" columns used; Note
    [backward TMEM plan]); ``ctas`` 2: the CTA pair's plan ("shared": the S^T columns dP^T
    reuses, 0 where none; "dS": dS^T, 16-bit, over dP^T's first columns).

    S^T [0, tile_m) (keys x queries, fp32); P^T (16-bit) over it: the half of the queries of
    compute warpgroup w at columns [w tile_m / 2, w tile_m / 2 + tile_m / 4), inside the S^T
    columns that warpgroup alone reads. dP^T [tile_m, 2 tile_m) (shared: [tile_m / 2,
    1.5 tile_m)); the pair's dS^T (16-bit) likewise over each warpgroup's own dP^T columns;
    dQ (queries x d / ctas) over dP^T's columns (dP^T is dead once the compute warps loaded
    it; dQ is drained before the next dP^T; the pair: at dP^T's end). dV after dP^T, dK
    after dV."""
    assert ctas in (1, 2), ctas
    assert head_dim // ctas <= tile_m, "dQ must fit in dP^T's columns"
    shared = tile_m // 2 if ctas == 2 and 2 * tile_m + head_dim + head_dim_v > TMEM_COLUMNS else 0
    plan = {"S": 0, "P": 0, "dP": tile_m - shared}
    plan["dQ"] = plan["dP"]
    if ctas == 2:
        plan.update(shared=shared, dS=plan["dP"], dQ=plan["dP"] + tile_m - head_dim // 2)
    plan["dV"] = plan["dP"] + tile_m
    plan["dK"] = plan["dV"] + head_dim_v
    plan["total"] = plan["dK"] + head_dim
    assert plan["total"] == bwd_tmem_columns(tile_m, head_dim, head_dim_v, ctas)
    assert plan["total"] <= TMEM_COLUMNS, f"TMEM plan of {plan['total']} columns"
    return plan


# The CTA pair's Q (and LSE / delta) stages: one, as FA4's 2-CTA backward (two fit no head dim).
SM100_BWD_PAIR_Q_STAGES = 1


def bwd_ctas(config: BwdConfig) -> int:
    """CTAs of one MMA of the backward: 2 with the tuning's ``cta_pair``, else 1."""
    return 2 if getattr(config.tuning, "cta_pair", False) else 1


def bwd_smem_bytes(config: BwdConfig) -> int:
    """Shared memory of the sm100 backward (a CTA): K and V once, the Q and dO stages, one dS
    tile (16-bit), the fp32 dQ staging buffers, LSE and delta stages (fp32), plus slack.

    CTA pair: a B operand of a cta_group::2 MMA is split by its N between the two CTAs, and
    Q, dO and K are B operands split two ways (S^T = K Q^T and dP^T = V dO^T by query rows;
    dK += dS^T Q and dV += P^T dO by head-dim columns; dQ = dS K by head-dim columns over
    both CTAs' keys), so each stage holds two halves: 64 x d of Q and d / 2 x 128 of Q^T (the
    bytes of one Q tile, likewise dO), and K^T's half (d / 2 x 256 keys: the bytes of K
    again). In place of the dS^T tile, dQ's A operand: 64 queries x 256 keys, the same
    element count (dS^T for dK stays in TMEM, Note [backward TMEM plan])."""
    tm, tn, d, dv = config.tile_m, config.tile_n, config.head_dim, config.head_dim_v
    pair = bwd_ctas(config) == 2
    q_stages = SM100_BWD_PAIR_Q_STAGES if pair else SM100_BWD_Q_STAGES
    tiles = tn * (d + dv) + q_stages * tm * d + SM100_BWD_DO_STAGES * tm * dv + tm * tn
    if pair:
        tiles += tn * d  # K^T's half
    dq = SM100_BWD_DQ_STAGES * tm * SM100_BWD_DQ_CHUNK * 4
    stats = 2 * q_stages * tm * 4
    return tiles * 2 + dq + stats + SM100_BWD_SMEM_SLACK


def bwd_can_implement(config: BwdConfig) -> tuple[bool, str]:
    """Whether FlashAttentionBackwardSm100 compiles ``config``; else the reason."""
    if config.arch != 100:
        return False, f"FlashAttentionBackwardSm100 is the sm100 family, not sm{config.arch}"
    if config.target not in SM100_FWD_TARGETS:
        return False, (
            f"target {config.target}: the sm100 backward needs one of {SM100_FWD_TARGETS}"
        )
    if not isinstance(config.tuning, Sm100BwdTuning):
        return False, f"tuning {type(config.tuning).__name__} is not an Sm100BwdTuning"
    d, dv, ctas = config.head_dim, config.head_dim_v, bwd_ctas(config)
    cols = bwd_tmem_columns(SM100_BWD_TILE_M, d, dv, ctas)
    if ctas == 1 and (d != dv or d not in SM100_BWD_HEAD_DIMS):
        pair_cols = bwd_tmem_columns(SM100_BWD_TILE_M, d, dv, 2)
        return False, (
            f"head_dim {d} / head_dim_v {dv}: the sm100 backward takes d = dv in "
            f"{SM100_BWD_HEAD_DIMS} (one CTA's TMEM plan: {cols} columns; the 2-CTA MMA's: "
            f"{pair_cols}, of 512; Note [backward TMEM plan])"
        )
    if ctas == 2 and (d, dv) not in SM100_BWD_PAIR_HEAD_DIM_PAIRS:
        return False, (
            f"cta_pair at head_dim {d} / head_dim_v {dv}: the 2-CTA MMA's TMEM plan holds "
            f"{SM100_BWD_PAIR_HEAD_DIM_PAIRS} ({cols} columns here, of 512; Note [backward "
            f"TMEM plan])"
        )
    if (config.tile_m, config.tile_n, config.num_warps) != SM100_BWD_TILE:
        tile = f"{config.tile_m}x{config.tile_n}w{config.num_warps}"
        return False, f"tile {tile}: the sm100 backward needs {SM100_BWD_TILE}"
    if bwd_tmem_columns(config.tile_m, d, dv, ctas) > TMEM_COLUMNS:
        return False, "the TMEM plan needs more than 512 columns"
    if bwd_smem_bytes(config) > SMEM_CAPACITY[config.target]:
        reason = f"shared memory {bwd_smem_bytes(config)} bytes exceeds the target's"
        if ctas == 2:
            reason += (
                " (the pair's split B operands: Q, dO and K held twice, bwd_smem_bytes; FA4 "
                "reuses Q's bytes for Q^T at d 192)"
            )
        return False, reason
    if ctas == 2:
        return False, (
            "cta_pair: the 2-CTA backward is planned (TMEM and shared memory fit: Note "
            "[backward TMEM plan], bwd_smem_bytes), not built: its split B operands (Q^T, dO^T, "
            "K^T loads), dK with dS^T from TMEM, dQ's dS operand filled across the pair, "
            "cluster pipelines and the pair's TMEM allocation are missing (docs/blackwell.md); "
            "one CTA serves d 128"
        )
    if config.det_coresident:
        return False, (
            "det_coresident (the sm80 kernel's coresident turn order) is not implemented in the "
            "sm100 backward: its deterministic mode takes the chain order"
        )
    return True, ""


def bwd_pair_wanted(config: BwdConfig) -> bool:
    """Whether dispatch takes the CTA pair for ``config``: FA4's rule for its 2-CTA backward
    (flash_attn/cute/interface.py, ``use_2cta_instrs = head_dim >= 128`` on sm100, whatever the
    mask or layout), unmeasured here; and only where the pair implements the call
    (``bwd_can_implement`` of the pair's config): today nowhere, so d 128 stays on one CTA."""
    if config.head_dim < 128 or not isinstance(config.tuning, Sm100BwdTuning):
        return False
    pair = config.replace(tuning=dataclasses.replace(config.tuning, cta_pair=True))
    return bwd_can_implement(pair)[0]


def bwd_config(d: int, dv: int, target: str = "sm_100a", dtype: str = "bf16", **flags) -> BwdConfig:
    """The compile key of the sm100 backward for (d, dv) and the feature flags."""
    tuning = Sm100BwdTuning(tile_m=SM100_BWD_TILE_M, tile_n=SM100_BWD_TILE_N)
    return BwdConfig(arch=100, target=target, dtype=dtype, head_dim=d, head_dim_v=dv,
                     tuning=tuning, **flags)  # fmt: skip
