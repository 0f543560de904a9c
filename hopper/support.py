"""What the sm90 kernels can do, without importing the CuTe DSL.

Dispatch and the feature matrix ask these functions; the kernel classes use them as their
``can_implement``. Keeping them here lets a caller ask without importing the DSL.
"""

from __future__ import annotations

import dataclasses
import math

from cute_fa.config import SMEM_CAPACITY, BwdConfig, FwdConfig, Sm90BwdTuning, Sm90FwdTuning

# FlashAttentionForwardSm90 runs tile_m query rows a CTA: one producer warpgroup and tile_m / 64
# consumer warpgroups of 64 query rows each (the M of a WGMMA). tile_m is 128 (two consumers)
# except where SM90_FWD_3WG_DEFAULT picks 192 (below); the key block tile_n depends on the head
# dim:
#   d 64, 96, 128: 128 keys. Q + 2 K/V stages are 48 / 72 / 96 KiB of smem; a consumer holds
#     S (64 fp32 registers a thread), P (32) and O (d / 2) well inside 240 registers.
#   d 192 (dv 192 or 128): 112 keys. 128 keys would need 48 + 192 = 240 KiB (dv 192), more than
#     the 227 KiB of sm_90a; 112 keys need 216 KiB (dv 192), 184 KiB (dv 128). S 56 + P 28 +
#     O 96 registers.
#   d 256: 64 keys. Q is 64 KiB and each K/V stage 64 KiB: 192 KiB with 2 stages (80 keys, the
#     most that fit, need 224 KiB; 96 keys 256 KiB). O alone is 128 registers a thread (64 x 256
#     fp32 over a warpgroup); S 32 + P 16 leave room for the softmax. Measured on the H200
#     (bf16, standard grid, one run with each tile as a peer, docs/performance.md, Log
#     2026-12-01), both with the rescale threshold of d 256: 64 keys +1 to +7 % against 80 at
#     512 to 4k, -0.8 to +1.6 % from 8k (80 keys leave the last block of 512 or 8k keys 40 %
#     full; 64 divides every power of two).
# d 64 and 128: docs/performance.md has the measurements (176 keys at d 128 below).
SM90_FWD_TILE_M = 128
SM90_FWD_WARPS = 12
SM90_FWD_TILE_N = {64: 128, 96: 128, 128: 128, 192: 112, 256: 64}
# Not taken: 176 keys at d 128 (S 88 + P 44 + O 64 registers, 0 spills; 208 KiB with two K/V
# stages). Non-causal it measured +0-4 % in one session and -1 to -3 % at 4k / 8k in the next
# (noise of that size between runs); causal -3 to -12 % (docs/performance.md, Log).
SM90_FWD_HEAD_DIMS = tuple(SM90_FWD_TILE_N)
# (head_dim, head_dim_v) pairs: equal head dims, 192 x 128 (DeepSeek's q/k 192, v 128) and
# 128 x 64 (the tile of d 128 with a narrower V / O: fewer registers, no other change).
SM90_FWD_HEAD_DIM_PAIRS = tuple((d, d) for d in SM90_FWD_HEAD_DIMS) + ((192, 128), (128, 64))
SM90_FWD_KV_STAGES = 2
# The tile of d 64 and 128, the first shape the kernel ran with (tests use it as the default).
SM90_FWD_TILE = (SM90_FWD_TILE_M, SM90_FWD_TILE_N[128], SM90_FWD_WARPS)
# mbarriers and the 1024-byte alignment of the smem tiles.
SM90_FWD_SMEM_SLACK = 1024

# Query rows of one consumer warpgroup.
SM90_FWD_WG_M = 64
# Paged K/V: a TMA box of keys starts on an 8-row swizzle atom of the K / V^T tiles.
SM90_FWD_PAGE_BOX_ALIGN = 8
# ... and of 16 keys where a head dim is 96 or 192 (tiles of narrower swizzle atoms than
# 128 bytes): in the randomized sweep of 2026-12-02 (docs/testing.md) every d96 call with
# pages of 8 keys crashed its process on the H200, and so did (192, 128) with pages of 8 in the
# paged GPU tests, while pages of 16 and 64 pass at both; the cause is not established, so
# these head dims take boxes of 16 keys or more. Page sizes the sm90 forward declines run
# the sm80 forward's row gather (planning falls through to it).
SM90_FWD_PAGE_BOX_ALIGN_NARROW = 16


def fwd_page_box_align(config: FwdConfig) -> int:
    """The multiple a paged K/V box's key count must be (``fwd_page_box``)."""
    if {96, 192} & {config.head_dim, config.head_dim_v}:
        return SM90_FWD_PAGE_BOX_ALIGN_NARROW
    return SM90_FWD_PAGE_BOX_ALIGN


# setmaxnreg budgets (producer, consumer) a thread by number of consumer warpgroups: the
# producer warpgroup gives registers back, the consumers take them (128 * (producer +
# consumers * consumer) <= 65536, each a multiple of 8).
#   2 consumers (384 threads, 168 a thread at launch): 24 * 128 + 240 * 256 = 64512.
#   3 consumers (512 threads, 128 a thread at launch): 24 * 128 + 160 * 384 = 64512.
SM90_FWD_REGS = {2: (24, 240), 3: (24, 160)}
# Tiles of 192 query rows (three consumer warpgroups, so that three softmaxes take turns with
# the GEMMs) by head dim, with the most keys a consumer holds in 160 registers without spills:
# S (tile_n / 2 fp32 a thread), P (tile_n / 4) and O (dv / 2). d 64 at tile_n 128: S 64 + P 32
# + O 32 (the SASS peaks at R157); 144 keys spill (52 LDL/STL). d 96 spills at 128 keys (78),
# causal even at 96 keys. d 128 holds at most 80 keys (S 40 + P 20 + O 64; 0 spills at 64 and
# 80, causal too; 96 keys spill 26, 112 keys 104), fewer than its default 128, so three
# consumers there are a tuning choice only (tile_m 192 with tile_n 64 or 80).
SM90_FWD_TILE_M_3WG = 192
SM90_FWD_3WG_MAX_TILE_N = {64: 128, 128: 80}
# Features whose extra registers do not fit three consumers at d 64 / 128 keys: a window
# (both edges, three loops; 142 LDL/STL) and softcap (the tanh scale; 52 with causal). Calls
# with them keep 128 query rows.
SM90_FWD_3WG_FLAGS_OFF = ("local", "has_softcap")
# Where 192 rows are the default: d 64 without a causal mask. On the H200 (bf16, standard grid,
# same run, docs/performance.md) 192 rows against 128: non-causal +4-7 % at 512 / 1k, +6-16 % at
# 2k-16k; causal -12 % at 512 / 1k (a third consumer on rows past the diagonal and past the
# end), +1-16 % at 2k-16k. So causal calls took 192 rows from 2048 query rows up; since the
# persistent grid with 128 rows is +5 % at 2k and -2 % at 4k against 192 rows one CTA a tile
# (same session), from 4096 (the plan of a call knows its longest query sequence; without it,
# 128). From 4096 to 8192 rows the 192 rows run on the persistent grid too (below).
SM90_FWD_3WG_DEFAULT = (64,)
SM90_FWD_3WG_CAUSAL_MIN_SEQLEN = 4096


# The fields of Sm90FwdTuning (cute_fa/config.py; docs/tuning.md) and their defaults. ``tile_n``
# (a multiple of 16 up to 256) and ``tile_m`` (128 or 192, where three consumers fit
# SM90_FWD_3WG_MAX_TILE_N) default to the tables above; fwd_can_implement checks a tile asked
# for. Three K/V stages were measured no faster and removed (docs/log/sm90-forward.md).
#
# ``defer_rescale`` moves the rescale of O and the conversion of P
# to 16 bits of key block j from the end of its step to just before O += P_j V_j is issued (the
# start of the next step, or the last P V). Between wgmma wait_group 1 and 0 nothing then writes
# the registers the in-flight P V GEMM reads (P) or accumulates (O), so ptxas can keep the
# exponentials of block j before the wait (flash_fwd.py, class docstring; under the CUDA 12
# build's ptxas). A variant with the wait in a vote-guarded branch measured 0.98 and was
# removed. Head dims that defer the rescale by default. On the H200 (bf16, standard grid,
# the switch as a peer in one process, docs/performance.md, Log 2026-12-01): d 64 +0 to +3 %
# non-causal and +1 to +7 % causal (2k and 4k +6-7 %; a second run +1-3 %, inside that run's
# noise); d 128 -9 to +0 % at 512-8k; d 256 -8 to +1 %.
SM90_FWD_DEFER_RESCALE_DEFAULT = (64,)
# ``exp2_poly`` = k (2, 4, 8 or 16) computes every k-th exponential
# of each thread's row in the unmasked key blocks with a polynomial on the FMA pipe
# (cute_fa/dsl/softmax.py, Note [exp2 on the FMA pipe]) instead of MUFU.EX2. Why: MUFU runs 16
# lanes a clock an SM, the tensor cores 4096 FLOPs, so at d 64 (256 FLOPs a score in the two
# GEMMs) the exponentials need as many MUFU clocks as the GEMMs need tensor clocks, and a
# consumer's softmax (66 MUFU.EX2 a thread at 128 keys: 528 clocks of its SMSP's MUFU) takes
# longer than the other consumer's GEMMs (512 clocks). A polynomial exponential is 8 FMA / ALU
# instructions in place of one MUFU.EX2. 0 (the default): MUFU for all.
# ``rescale_threshold`` = t (4 or 8, log2 units): a row's running
# max moves only when a block's max exceeds it by more than t, and a warp skips the O rescale
# (d / 2 multiplies a thread and block) unless one of its rows moved (Note [rescale threshold]
# in cute_fa/dsl/softmax.py; FA4 uses 8). Why: at d 256 the rescale is 128 FMUL a thread and
# block against ~220 other softmax instructions; at d 128 64 against ~350. 0: the max follows
# every move and O is multiplied every block. The threshold by head dim by default, measured on
# the H200 (bf16, standard grid, the threshold as a peer in the same run, docs/log/
# sm90-forward.md, 2026-12-01): d 256 at 64 keys +2 to +9 % (at 80 keys +0 to +9 %), d 128 -1
# to +2 % (not taken), d 64 not measured (its rescale is 32 multiplies a thread and block).
SM90_FWD_RESCALE_THRESHOLD_DEFAULT = {256: 8}

# A persistent grid launches one CTA an SM, each looping over its share of the tiles (Note
# [persistent tiles], cute_fa/dsl/scheduler.py); it takes dense calls without a window or
# seqused (fwd_persistent_fits). Default: where Q gets two stages (d <= 128: the next tile's Q
# loads while this one runs) and the longest query sequence is at most
# SM90_FWD_PERSISTENT_MAX_SEQLEN rows (non-causal) or ..._CAUSAL (causal). On the H200 (bf16,
# hidden 2048, one session each, docs/performance.md), against one CTA a tile:
#   non-causal: +15 % at 512 rows (d64, d128), +6-7 % at 1k, +1-3 % at 2k; -2 to +2 % at 4k and
#     -1.5 to -2.5 % at 16k, where the hardware's dynamic CTA placement balances SMs of unequal
#     speed better than a static round robin;
#   causal (pairs of tiles): d64 (128 rows) +29 % / +16 % at 512 / 1k; d128 +24 %, +12 %, +8 %,
#     +5 %, +4 % from 512 to 8k, -2.4 % at 16k;
#   d256 (one Q stage, 80 keys then, separate processes): -2 to -4 % causal at 512 / 1k and
#     16k, +2-6 % causal at 2k-8k, +3 % non-causal up to 2k (see the rule for one Q stage below).
# d96 also gets two Q stages and so the default; its speed was not measured (the rule follows
# d64 / d128). (192, 128) and d192 have one stage, like d256.
# With one Q stage (d 192, (192, 128), d 256) a persistent grid cannot load the next tile's Q
# during this one, and only causal calls gain: on the H200 (d 256, the switch as a peer in one
# process, docs/performance.md, Log 2026-12-01) +5 % causal at 1k, 2k and 4k, +2 % at 8k,
# -2 % at 512 and -3 % at 16k; non-causal -6 to +1 %; a second run, after the change, the grid
# without it at 1k / 2k / 4k causal: -3 / -8 / -9 %. So causal calls of 1024 to 8192 query
# rows (SM90_FWD_PERSISTENT_ONE_Q_STAGE_CAUSAL) take it; d 192 follows d 256 unmeasured.
# Three consumers (192 rows, d 64) on the persistent causal grid: they spilled at 160
# registers a thread until the causal mask compared columns as immediates (Note [mask columns
# as immediates] in cute_fa/dsl/mask.py; 0 spills now), and then measured, on the H200 (bf16,
# standard grid, the pair as a peer in one process, three runs, docs/performance.md, Log
# 2026-12-01) against 192 rows one CTA a tile: +5 / +6 / +9 % at 4k causal, 0.99-1.00 at 8k,
# 0.99 and 1.06 at 16k. So they follow the rule above (causal up to 8192 rows): d 64 causal
# calls run 128 rows persistent below 4096 rows, 192 rows persistent from 4096 to 8192, and
# 192 rows one CTA a tile above.
# ``num_ctas`` > 0 asks for a persistent grid for every call that fits, 0 for none (planning
# puts the device's SM count there). A dynamic schedule (CTAs taking their next work unit from
# a global counter) measured 0.93-1.02 of the static one and was removed.
SM90_FWD_PERSISTENT_MAX_SEQLEN = 2048
SM90_FWD_PERSISTENT_MAX_SEQLEN_CAUSAL = 8192
SM90_FWD_PERSISTENT_ONE_Q_STAGE_CAUSAL = (1024, 8192)
# CTAs of a persistent grid when the device is not known (precompile for sm_90a): the SMs of an
# H100 SXM or H200. A plan for a device puts that device's count in the config (cute_fa/ops.py).
SM90_SMS = 132
# Q stages of a persistent grid: two where they fit next to the K/V ring (the next tile's Q
# loads while this one runs; its O is staged in this one's Q stage), else one.
SM90_FWD_PERSISTENT_Q_STAGES = 2

# ``pingpong`` False drops the turns of the consumer warpgroups (named barriers SCHEDULER_WG1 +
# c, hopper/flash_fwd.py): each issues its GEMMs as soon as its own operands are ready, and the
# warp schedulers interleave the consumers as they come. True: the turns (FA3's pingpong).
# Never off with seqused_k, whose V-tail zeroing the turns order (``zero_v_tail``).
# Where the turns are off by default: d 64 causal calls on the persistent grid with
# two consumers (128 rows: below 4096 query rows). On the H200 (bf16, standard grid, the switch
# as a peer in one process, docs/performance.md, Log 2026-12-02), three runs: +2 / +3 / +3 % at
# 512, +4 / +1 / +2 % at 1k, +3 / +3 / +2 % at 2k. Not elsewhere: d 64 causal 4k (192 rows) -4 /
# -5 %, d 64 non-causal (192 rows) -3 to 0 %, d 128 -5 to +3 % (two runs, inside the spread),
# d 256 -4 to +1 %. At d 64 a consumer's softmax (66 exponentials a thread) takes longer than
# the other consumer's GEMMs, so a turn mostly makes a consumer whose operands are ready wait.
SM90_FWD_PINGPONG_OFF_DEFAULT = (64,)
# ``overlap`` False turns the intra-warpgroup overlap off: a consumer waits for both GEMMs of
# its step (S = Q K[j]^T and O += P V[j + 1]) before the softmax of block j, instead of only
# for S (hopper/flash_fwd.py, ``step``).
# Where the overlap is off by default: head dim -> longest query sequence, for
# causal calls on the persistent grid with two consumers and no turns (d 64 causal below 4096
# rows, SM90_FWD_PINGPONG_OFF_DEFAULT). On the H200 (bf16, standard grid, the switch as a peer
# in one process, docs/performance.md, Log 2026-12-02), three runs: +2 / +2 / +4 % at 512,
# +2 / +2 / +3 % at 1k, but +4 / 0 / 0 % at 2k and 0 / -2 % at 4k; elsewhere a loss or noise
# (d 64 non-causal -8 to 0 %, d 128 -3 to +4 %, d 256 -9 to -4 %). A causal tile of up to 1k rows
# visits at most 8 key blocks, half of them on the diagonal: the overlap's prologue (the first
# S issued ahead) and its drain are a large part of so few steps.
SM90_FWD_OVERLAP_OFF_DEFAULT = {64: 1024}
# ``tma_store`` True: each consumer's O leaves by one TMA store from its shared-memory slice
# (FA3's epilogue) instead of 16-byte stores by its 128 threads. Dense query calls with dv == d
# only (a varlen box would cross into the next sequence; the O tile is staged in the Q slice's
# layout); elsewhere it is not taken. Off by default (0.93-1.06 in three runs).
# P through shared memory (an SS P V WGMMA; 0.87-0.99) and Q in registers (an RS S = Q K^T;
# 0.93-1.00) were measured and removed (docs/log/sm90-forward.md).

# Each choice above is a field of Sm90FwdTuning (cute_fa/config.py), part of the compile key,
# so a kernel compiled under one setting is never served under another.


def fwd_kv_stages(config: FwdConfig) -> int:
    """K/V stages of the sm90 forward."""
    return SM90_FWD_KV_STAGES


def fwd_persistent_fits(config: FwdConfig) -> bool:
    """Whether a static persistent schedule balances ``config``'s calls: dense, no window or
    seqused, so every tile costs the same, or (causal) every pair of tiles (Note [persistent
    tiles])."""
    return not (
        config.local or config.varlen_q or config.varlen_k or config.seqused_q
        or config.seqused_k or config.split_kv or config.pack_gqa or config.page_size
    )  # fmt: skip


def fwd_tma_store_fits(config: FwdConfig) -> bool:
    """Whether O can leave by TMA store: dense query rows (no cu_seqlens_q or seqused_q),
    dv == d, and a 16-bit O (not the fp32 partial O of split-KV)."""
    return (
        not (config.varlen_q or config.seqused_q or config.split_kv or config.pack_gqa)
        and config.head_dim_v == config.head_dim
    )


def fwd_page_box(config: FwdConfig) -> int:
    """Keys of one TMA box of paged K/V (hopper/flash_fwd.py, Paged K/V): gcd(page_size,
    tile_n), so that a box never crosses a page and a key block is whole boxes."""
    return math.gcd(config.page_size, config.tuning.tile_n)


def fwd_pack_gqa_fits(qhead_per_kvhead: int) -> bool:
    """Whether packed GQA rows (Note [packed GQA] in cute_fa/dsl/pack_gqa.py) with this many
    query heads per K/V head tile into the consumers' 64-row TMA boxes."""
    g = qhead_per_kvhead
    return g >= 2 and (SM90_FWD_WG_M % g == 0 or g % SM90_FWD_WG_M == 0)


def fwd_q_stages(config: FwdConfig) -> int:
    """Q stages of the sm90 forward: 1, or SM90_FWD_PERSISTENT_Q_STAGES for a persistent grid
    where they fit in shared memory."""
    if not config.tuning.num_ctas:
        return 1
    smem = fwd_smem_bytes(config, fwd_kv_stages(config), SM90_FWD_PERSISTENT_Q_STAGES)
    return SM90_FWD_PERSISTENT_Q_STAGES if smem <= SMEM_CAPACITY.get(config.target, 0) else 1


def fwd_config(
    base: FwdConfig, seqlen_q: int | None = None, asked: dict | None = None
) -> FwdConfig:
    """The sm90 forward's compile key for the problem of ``base`` (whose tuning is ignored):
    the built-in defaults of its problem class (the tables above; ``seqlen_q``, the call's
    longest query sequence when known, picks tile_m and the persistent grid), then the fields
    ``asked`` (a tuned table's entry, then overrides: ``cute_fa/tuned.py``) over them.

    What a call cannot run is not taken even when asked: pingpong stays on with seqused_k (the
    turns order its V-tail zeroing), ``tma_store`` needs dense query rows and dv == d, a
    persistent grid dense calls without a window or seqused (``num_ctas`` > 0 asks for one;
    planning puts the device's SM count there). The measured defaults for causal calls on the
    persistent grid with two consumers (no turns at d 64; no overlap for short ones) apply
    only where the fields are not asked."""
    asked = dict(asked or {})
    Sm90FwdTuning(**asked)  # every asked field checked (TuningError) before it is used
    d = base.head_dim
    tile_n = asked.get("tile_n", SM90_FWD_TILE_N.get(d, SM90_FWD_TILE[1]))
    tile_m = asked.get("tile_m")
    if tile_m is None:
        tile_m = fwd_tile_m(d, tile_n, base.causal, base.local, base.has_softcap, seqlen_q)
    fields = dict(
        tile_m=tile_m,
        tile_n=tile_n,
        defer_rescale=asked.get("defer_rescale", d in SM90_FWD_DEFER_RESCALE_DEFAULT),
        exp2_poly=asked.get("exp2_poly", 0),
        rescale_threshold=asked.get(
            "rescale_threshold", SM90_FWD_RESCALE_THRESHOLD_DEFAULT.get(d, 0)
        ),
        pingpong=asked.get("pingpong", True) or base.seqused_k,
        overlap=asked.get("overlap", True),
        tma_store=asked.get("tma_store", False) and fwd_tma_store_fits(base),
    )
    config = base.replace(tuning=Sm90FwdTuning(**fields))
    if base.split_kv or base.pack_gqa or base.page_size:  # one CTA a tile (split: fp32 O)
        return config
    persistent = config.with_tuning(num_ctas=SM90_SMS)
    if "num_ctas" in asked:
        by_default = bool(asked["num_ctas"])
    elif fwd_q_stages(persistent) == SM90_FWD_PERSISTENT_Q_STAGES:
        limit = (
            SM90_FWD_PERSISTENT_MAX_SEQLEN_CAUSAL if base.causal
            else SM90_FWD_PERSISTENT_MAX_SEQLEN
        )  # fmt: skip
        by_default = seqlen_q is not None and seqlen_q <= limit
    else:  # one Q stage (d 192, d 256): causal calls of a middle length only
        low, high = SM90_FWD_PERSISTENT_ONE_Q_STAGE_CAUSAL
        by_default = base.causal and seqlen_q is not None and low <= seqlen_q <= high
    if by_default and fwd_persistent_fits(config):
        config = persistent
    # The measured defaults for causal calls on the persistent grid with two consumers (a
    # persistent grid never takes seqused_k, whose V-tail zeroing needs the turns): no turns,
    # and for short ones no intra-warpgroup overlap either.
    tuning = config.tuning
    if not (base.causal and tuning.num_ctas and tuning.tile_m == SM90_FWD_TILE_M):
        return config
    if "pingpong" not in asked and d in SM90_FWD_PINGPONG_OFF_DEFAULT:
        config = config.with_tuning(pingpong=False)
    short = seqlen_q is not None and seqlen_q <= SM90_FWD_OVERLAP_OFF_DEFAULT.get(d, 0)
    if "overlap" not in asked and not config.tuning.pingpong and short:
        config = config.with_tuning(overlap=False)
    return config


def fwd_num_consumers(tile_m: int) -> int:
    """Consumer warpgroups of a forward tile of ``tile_m`` query rows."""
    return tile_m // SM90_FWD_WG_M


def fwd_num_warps(tile_m: int) -> int:
    """Warps of a forward CTA: the producer warpgroup and the consumers."""
    return 4 * (1 + fwd_num_consumers(tile_m))


def fwd_tile_ms(head_dim: int, local: bool = False, has_softcap: bool = False) -> tuple[int, ...]:
    """The query rows a CTA the sm90 forward can run for a head dim and features."""
    if head_dim in SM90_FWD_3WG_MAX_TILE_N and not (local or has_softcap):
        return (SM90_FWD_TILE_M, SM90_FWD_TILE_M_3WG)
    return (SM90_FWD_TILE_M,)


def fwd_tile_m(
    head_dim: int,
    tile_n: int,
    causal: bool = False,
    local: bool = False,
    has_softcap: bool = False,
    seqlen_q: int | None = None,
) -> int:
    """Query rows a CTA by default: 192 for the head dims of SM90_FWD_3WG_DEFAULT without a
    causal mask, or causal with ``seqlen_q`` (the call's longest query sequence) of at least
    SM90_FWD_3WG_CAUSAL_MIN_SEQLEN (and keys tile_n that three consumers hold), else 128."""
    tile_ms = fwd_tile_ms(head_dim, local, has_softcap)
    fits = SM90_FWD_TILE_M_3WG in tile_ms and tile_n <= SM90_FWD_3WG_MAX_TILE_N[head_dim]
    long_rows = seqlen_q is not None and seqlen_q >= SM90_FWD_3WG_CAUSAL_MIN_SEQLEN
    if head_dim in SM90_FWD_3WG_DEFAULT and fits and (not causal or long_rows):
        return SM90_FWD_TILE_M_3WG
    return SM90_FWD_TILE_M


def fwd_smem_bytes(
    config: FwdConfig, kv_stages: int = SM90_FWD_KV_STAGES, q_stages: int = 1
) -> int:
    """Shared memory of the Q stages and the K and V rings (16-bit elements), barriers and
    alignment included."""
    return (q_stages * config.tile_m * config.head_dim
            + kv_stages * config.tile_n * (config.head_dim + config.head_dim_v)) * 2 \
        + SM90_FWD_SMEM_SLACK  # fmt: skip


def _arch_mismatch(config: FwdConfig | BwdConfig) -> str:
    """Why an sm90 kernel cannot take ``config`` for its family or target ("" when it can)."""
    if config.arch != 90:
        return f"config is for sm{config.arch}, this kernel is sm90"
    if not config.target.startswith("sm_90"):
        return f"target {config.target} is not sm_90a (TMA and WGMMA need sm_90a)"
    return ""


def fwd_can_implement(config: FwdConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionForwardSm90 implements ``config``, else (False, why)."""
    why = _arch_mismatch(config)
    if why:
        return False, why
    if config.head_dim not in SM90_FWD_HEAD_DIMS:
        return False, f"head_dim {config.head_dim} not in {SM90_FWD_HEAD_DIMS} (sm90 forward)"
    if (config.head_dim, config.head_dim_v) not in SM90_FWD_HEAD_DIM_PAIRS:
        return False, (
            f"head_dim_v {config.head_dim_v} with head_dim {config.head_dim} is not supported "
            f"by the sm90 forward (pairs {SM90_FWD_HEAD_DIM_PAIRS})"
        )
    if not isinstance(config.tuning, Sm90FwdTuning):
        return False, f"tuning {type(config.tuning).__name__} is not an Sm90FwdTuning"
    tuning = config.tuning
    tile_ms = fwd_tile_ms(config.head_dim, config.local, config.has_softcap)
    if tuning.tile_m not in tile_ms:
        return False, (
            f"tile_m {tuning.tile_m} (three consumer warpgroups of {SM90_FWD_REGS[3][1]} "
            f"registers a thread) runs only head_dim {tuple(SM90_FWD_3WG_MAX_TILE_N)} without "
            f"{' or '.join(SM90_FWD_3WG_FLAGS_OFF)} (more spills)"
        )
    if (
        tuning.tile_m == SM90_FWD_TILE_M_3WG
        and tuning.tile_n > SM90_FWD_3WG_MAX_TILE_N[config.head_dim]
    ):
        return False, (
            f"tile_n {tuning.tile_n} with tile_m {tuning.tile_m}: three consumer warpgroups hold "
            f"S, P and O in {SM90_FWD_REGS[3][1]} registers a thread, which fits at most "
            f"{SM90_FWD_3WG_MAX_TILE_N[config.head_dim]} keys at head_dim {config.head_dim}"
        )
    smem = fwd_smem_bytes(config, fwd_kv_stages(config), fwd_q_stages(config))
    if smem > SMEM_CAPACITY.get(config.target, 0):
        return False, f"tiles need {smem} B of shared memory, more than {config.target} has"
    if not tuning.pingpong and config.seqused_k:
        return False, (
            "pingpong off with seqused_k: the consumers' turns "
            "order the zeroing of the V rows past seqused_k before any P V GEMM reads them"
        )
    if tuning.tma_store and not fwd_tma_store_fits(config):
        return False, (
            "tma_store takes dense query rows (no cu_seqlens_q / seqused_q), dv == d and no "
            "split-KV or pack_gqa"
        )
    if tuning.num_ctas and not fwd_persistent_fits(config):
        return False, (
            "a persistent grid (num_ctas) takes dense calls without a window, seqused, "
            "split-KV, pack_gqa or paged K/V (their tiles cost different amounts; Note "
            "[persistent tiles])"
        )
    align = fwd_page_box_align(config)
    if config.page_size and fwd_page_box(config) % align:
        return False, (
            f"paged K/V with pages of {config.page_size} keys: the sm90 forward loads a key "
            f"block as TMA boxes of gcd(page_size, tile_n {config.tuning.tile_n}) = "
            f"{fwd_page_box(config)} keys, which must be a multiple of {align} (the rows of a "
            f"swizzle atom; 16 at head dims 96 and 192); page sizes that are multiples of "
            f"{align} work"
        )
    if config.pack_gqa and not fwd_pack_gqa_fits(config.pack_gqa):
        return False, (
            f"pack_gqa with {config.pack_gqa} query heads per K/V head: the packed rows take "
            f"TMA boxes of {SM90_FWD_WG_M} rows, which needs the heads per K/V head to divide "
            f"{SM90_FWD_WG_M} (or be a multiple of it)"
        )
    return True, ""


# --------------------------------------------------------------------------------------------
# Backward (FlashAttentionBackwardSm90 in hopper/flash_bwd.py; checked on an H200 by
# tests/test_bwd_sm90_gpu.py; dispatched on sm_90a where it applies). One CTA owns tile_n = 128
# keys: two consumer warpgroups of 64 keys each (the M = 64 of a WGMMA) hold dK and dV of their
# keys in registers (2 * 64 * d / 128 fp32 a thread: 64 at d 64, 96 at d 96, 128 at d 128) and
# walk the query blocks tile_m = 64 rows at a time (d 64: 128), with
# S^T = K Q^T and dP^T = V dO^T (64 x tile_m fp32: 32 registers each, 64 at tile_m 128).
# Shared memory: K, V (tile_n x d, loaded once), SM90_BWD_Q_STAGES of Q and dO (tile_m x d) with
# their LSE and delta rows (fp32), two buffers of dS (tile_m x tile_n, 16-bit) and one fp32 dQ
# tile (tile_m x d, the source of the TMA reduce-add into dQaccum).
#   d 64: 32 + 32 + 32 + 16 KiB = 112 KiB (tile_m 128: 32 + 64 + 64 + 32 = 192 KiB);
#   d 96: 48 + 48 + 32 + 24 KiB = 152 KiB;
#   d 128: 64 + 64 + 32 + 32 KiB = 192 KiB (of 227); split d (below, 64 keys): d 192: 48 + 96 +
#   16 + 48 KiB = 208 KiB; d 256, one Q / dO stage: 64 + 64 + 16 + 64 KiB = 208 KiB.
# deterministic=True needs nothing more: the dQ writer warp spins on the caller's int32 semaphores
# (one per batch, head and tile_m query block) before its reduce-adds (the kernel's docstring).
# --------------------------------------------------------------------------------------------
SM90_BWD_TILE_M = 64
# Query rows a step where more than 64 fit the registers and measured faster: d 64 takes 128
# (S^T and dP^T of 64 keys x 128 rows, N = 128 WGMMAs; +12-14 % on the H200, docs/performance.md
# Log "d64, 128 query rows a step"), except with softcap, whose 1 - tanh^2 tile then spills.
SM90_BWD_TILE_M_BY_D = {64: 128}
# 80 query rows a step (a tuning choice, not a default; d 128 only): FA4's tile at d 128
# non-causal. S^T / dP^T are m64n80 WGMMAs (N = 80: a multiple of 16), dV / dK have k = 80;
# dQ, whose M would be the 80 rows (not a multiple of 64), is computed transposed, dQ^T = K^T
# dS^T: M = a consumer's 64 columns of d, N = the 80 rows (``bwd_dq_transposed``; the class
# docstring of hopper/flash_bwd.py). Registers a consumer thread: dK + dV 128, S^T + dP^T 80,
# then dQ^T 40 once S^T / dP^T are dead (0 spills; docs/log/sm90-backward.md, 2026-12-05).
# Shared memory: 32 + 32 (K, V) + 2 x (20 + 20) (Q, dO) + 2 x 20 (dS) + 40 (dQ) KiB, LSE and
# delta 1.25 KiB: 231,680 B of the 232,448 an sm_90a CTA may use, so one Q / dO stage more
# does not fit.
SM90_BWD_TILE_M_DQ_T = 80
SM90_BWD_TILE_M_DQ_T_HEAD_DIMS = (128,)
SM90_BWD_TILE_MS = (64, SM90_BWD_TILE_M_DQ_T, 128)
SM90_BWD_TILE_N = 128
SM90_BWD_WARPS = 12  # one producer and two consumer warpgroups
SM90_BWD_HEAD_DIMS = (64, 96, 128, 192, 256)
SM90_BWD_HEAD_DIM_PAIRS = tuple((d, d) for d in SM90_BWD_HEAD_DIMS) + ((192, 128), (128, 64))
SM90_BWD_Q_STAGES = 2
SM90_BWD_DS_BUFFERS = 2
# Above this head dim dK and dV of 64 keys (2 * 64 * d / 128 fp32 a thread) no longer fit one
# consumer's registers: both consumers share the CTA's tile_n = 64 keys and each owns half of
# the dK / dV columns (64 registers at d 192, ... 128 at d 256 for both accumulators: 2 * 64 *
# d / 2 / 128); consumer 0 computes S^T and consumer 1 dP^T of the 64 keys, exchanging P^T and
# dS^T through shared memory (an extra 16-bit P^T tile, sP; hopper/flash_bwd.py, split d).
SM90_BWD_SPLIT_D_ABOVE = 128
SM90_BWD_SPLIT_D_TILE_N = 64
# One Q / dO stage above this head dim (d 256: two stages need 278 KiB of shared memory).
SM90_BWD_TWO_Q_STAGES_MAX_D = 192


def bwd_dq_transposed(config: BwdConfig) -> bool:
    """Whether the sm90 backward computes dQ transposed (dQ^T = K^T dS^T, the query rows as
    the WGMMA's N): for a step of query rows that is not a multiple of 64, the M of a WGMMA
    (tile_m 80)."""
    return config.tile_m % 64 != 0


def bwd_split_d(head_dim: int) -> bool:
    """Whether the sm90 backward splits dK / dV along d between its consumers."""
    return head_dim > SM90_BWD_SPLIT_D_ABOVE


# Sm90BwdTuning.q_stages (2 or 3), the Q / dO (and LSE / delta) stages of the sm90
# backward where they fit in shared memory (3: d 64 at 64 rows, d 96, d 128 (226.5 KiB of 227);
# not d 64 at 128 rows, d 192 or d 256), else the default. 0 (the default): SM90_BWD_Q_STAGES
# (1 at d 256). Three measured 0.98-1.01 at d 128.


def bwd_q_stages(config: BwdConfig) -> int:
    """Q / dO (and LSE / delta) stages of the sm90 backward: ``tuning.q_stages`` when set, else
    two (one above SM90_BWD_TWO_Q_STAGES_MAX_D)."""
    if config.tuning.q_stages:
        return config.tuning.q_stages
    return SM90_BWD_Q_STAGES if config.head_dim <= SM90_BWD_TWO_Q_STAGES_MAX_D else 1


def bwd_default_tuning(head_dim: int, has_softcap: bool = False) -> Sm90BwdTuning:
    """The sm90 backward's tuning by default: 64 query rows a step (d 64: 128 without
    softcap); 128 keys a CTA, 64 with split d; the stages of ``bwd_q_stages``."""
    tile_n = SM90_BWD_SPLIT_D_TILE_N if bwd_split_d(head_dim) else SM90_BWD_TILE_N
    tile_m = SM90_BWD_TILE_M
    if not has_softcap:
        tile_m = SM90_BWD_TILE_M_BY_D.get(head_dim, SM90_BWD_TILE_M)
    return Sm90BwdTuning(tile_m=tile_m, tile_n=tile_n, **bwd_default_step_order(head_dim, tile_m))


def bwd_default_step_order(head_dim: int, tile_m: int) -> dict:
    """The step-order fields by default: d 64 with 128 query rows a step takes dQ by rows and
    dQ before dK (+2-7 % on the H200 at 2k / 8k, docs/log/sm90-backward.md, 2026-12-04); other
    tiles keep dV, dK, then dQ over d / 2 columns (dQ before dK at d128 measured -2 to -4 %
    causal)."""
    on = head_dim == 64 and tile_m == 128
    return {"dq_by_rows": on, "dq_before_dk": on}


def bwd_config(base: BwdConfig, asked: dict | None = None) -> BwdConfig:
    """The sm90 backward's compile key for the problem of ``base`` (its tuning ignored): the
    default tuning with the fields ``asked`` over it (``cute_fa/tuned.py``); step-order fields
    not asked follow the tile asked (``bwd_default_step_order``)."""
    asked = asked or {}
    default = bwd_default_tuning(base.head_dim, base.has_softcap)
    fields = dataclasses.asdict(default)
    fields.update(asked)
    for name, value in bwd_default_step_order(base.head_dim, fields["tile_m"]).items():
        if name not in asked:
            fields[name] = value
    return base.replace(tuning=Sm90BwdTuning(**fields))


def bwd_smem_bytes(config: BwdConfig) -> int:
    """Shared memory of the sm90 backward: K, V; the Q, dO, LSE and delta stages; the dS
    buffers (split d: and the P^T tile); the fp32 dQ tile; barriers and the 1024-byte
    alignment of the tiles."""
    tm, tn, d, dv = config.tile_m, config.tile_n, config.head_dim, config.head_dim_v
    stages = bwd_q_stages(config)
    ds_tiles = SM90_BWD_DS_BUFFERS + (1 if bwd_split_d(d) else 0)
    tiles = tn * (d + dv) + stages * tm * (d + dv) + ds_tiles * tm * tn
    return tiles * 2 + stages * 2 * tm * 4 + tm * d * 4 + SM90_FWD_SMEM_SLACK


def bwd_can_implement(config: BwdConfig) -> tuple[bool, str]:
    """(True, "") when FlashAttentionBackwardSm90 implements ``config``, else (False, why)."""
    why = _arch_mismatch(config)
    if why:
        return False, why
    if config.head_dim not in SM90_BWD_HEAD_DIMS:
        return False, f"head_dim {config.head_dim} not in {SM90_BWD_HEAD_DIMS} (sm90 backward)"
    if config.det_coresident:
        return False, "det_coresident is a mode of the sm80 backward"
    if (config.head_dim, config.head_dim_v) not in SM90_BWD_HEAD_DIM_PAIRS:
        return False, (
            f"head_dim_v {config.head_dim_v} with head_dim {config.head_dim} is not supported "
            f"by the sm90 backward (pairs {SM90_BWD_HEAD_DIM_PAIRS})"
        )
    if not isinstance(config.tuning, Sm90BwdTuning):
        return False, f"tuning {type(config.tuning).__name__} is not an Sm90BwdTuning"
    split_tile_n = SM90_BWD_SPLIT_D_TILE_N if bwd_split_d(config.head_dim) else SM90_BWD_TILE_N
    if config.tile_n != split_tile_n:
        return False, (
            f"tile_n {config.tile_n}: the sm90 backward at head_dim {config.head_dim} runs "
            f"{split_tile_n} keys a CTA (two consumers of {split_tile_n // 2} keys)"
        )
    if config.tile_m not in SM90_BWD_TILE_MS:
        return False, (
            f"tile_m {config.tile_m}: the sm90 backward steps 64, 80 (head_dim 128) or 128 "
            "query rows"
        )
    if bwd_dq_transposed(config):
        why = _dq_transposed_declines(config)
        if why:
            return False, f"tile_m {config.tile_m} (dQ transposed): {why}"
    if config.tuning.dq_by_rows and (config.tile_m != 128 or bwd_split_d(config.head_dim)):
        return False, (
            f"dq_by_rows with tile_m {config.tile_m} at head_dim {config.head_dim}: dQ by rows "
            "needs 128 query rows a step (64 a consumer) and no split d (d 64 without softcap)"
        )
    if config.tuning.dq_before_dk and bwd_split_d(config.head_dim):
        return False, (
            f"dq_before_dk at head_dim {config.head_dim}: with split d dQ's accumulator fits "
            "only after dV and dK completed (d <= 128 only)"
        )
    smem = bwd_smem_bytes(config)
    if smem > SMEM_CAPACITY.get(config.target, 0):
        return False, f"tiles need {smem} B of shared memory, more than {config.target} has"
    return True, ""


def _dq_transposed_declines(config: BwdConfig) -> str:
    """Why the 80-row step (dQ transposed) cannot run ``config`` ("" when it can)."""
    d = config.head_dim
    if (d, config.head_dim_v) not in tuple((h, h) for h in SM90_BWD_TILE_M_DQ_T_HEAD_DIMS):
        return (
            f"head_dim {d} / head_dim_v {config.head_dim_v}: 80 query rows a step run head_dim "
            f"{SM90_BWD_TILE_M_DQ_T_HEAD_DIMS} with head_dim_v = head_dim only (d 64 steps 128 "
            "rows; d 96 was not built; above 128 dK / dV are split along d; (128, 64) compiles "
            "without spills but has no GPU test of this tile)"
        )
    if config.has_softcap:
        return (
            "softcap: its 1 - tanh^2 tile (40 more fp32 registers a thread beside dK + dV's 128 "
            "and S^T + dP^T's 80) spills (54 LDL / STL, an 88-byte stack)"
        )
    if config.tuning.dq_before_dk:
        return (
            "dq_before_dk: with dQ^T's accumulator live while dK's WGMMAs run, ptxas "
            "serializes every WGMMA (one warpgroup.arrive each); the 80-row step keeps the base "
            "order (dV and dK, then dQ)"
        )
    if bwd_q_stages(config) > SM90_BWD_Q_STAGES:
        return (
            f"q_stages {bwd_q_stages(config)}: two Q / dO stages of 80 rows already take "
            f"{bwd_smem_bytes(config.with_tuning(q_stages=SM90_BWD_Q_STAGES))} B of shared "
            f"memory (a third needs {bwd_smem_bytes(config)} B, more than "
            f"{SMEM_CAPACITY.get(config.target, 0)})"
        )
    return ""
