"""Planning: a request (what a call asks for) -> kernel class and compile key, forward and
backward.

Forward: every GPU from sm80 up can run the sm80 kernel family (``cute_fa.ampere``), compiled
for the device's own target (``config.target_for_capability``); an sm90 device first asks the
sm90 family (``cute_fa.hopper``), an sm100 / sm103 device (capability 10.x) the sm100 family
(``cute_fa.blackwell``), whose ``can_implement`` takes what it does and leaves the rest to sm80.
``CUTE_FA_FWD_ARCH=80``, ``90`` or ``100`` (``cute_fa.settings``) restricts dispatch to one
family; ``exclude`` leaves families out of one request (the first-use self-check's fallback,
``cute_fa.selftest``). A request no listed kernel implements raises ``NotImplementedError``
naming the feature, the architecture and each kernel's reason; nothing falls back silently to
another library.

Backward (Note [backward dispatch]): the sm90 main kernel on sm_90a where it implements the
request, else the sm80 one; both with the sm80 preprocess and postprocess.

Each compile key's ``tuning`` field is built in layers (``cute_fa/tuned.py``): the arch's
built-in default for the problem class, then the tuned table of the GPU (``table``), then the
active ``cute_fa.tuning`` overrides.

This module imports neither torch nor the CuTe DSL: kernels are known by ``KernelSpec`` (name,
family, a DSL-free ``can_implement``) and their classes are imported only to compile.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields

from . import settings, tuned
from .ampere import support as sm80_support
from .blackwell import support as sm100_support
from .config import (
    TARGETS,
    BwdConfig,
    FwdConfig,
    Tiles,
    TuningError,
    dq_accum_head_dim,
    sm80_bwd_tile,
    sm80_fwd_tile,
    target_for_capability,
)
from .hopper import support as sm90_support
from .settings import SettingError

MIN_CAPABILITY = (8, 0)

# Arguments of flash_attn.cute that cute_fa accepts by name but does not implement yet, with the
# value that means "off". Setting one to anything else raises NotImplementedError.
UNIMPLEMENTED_ARGUMENTS = {
    "qv": "None",
    "gather_kv_indices": "None",
    "score_mod": "None",
    "score_mod_bwd": "None",
    "mask_mod": "None",
    "aux_tensors": "None",
    "aux_scalars": "None",
    "block_sparse_tensors": "None",
    "block_sparse_tensors_bwd": "None",
    "seqlen_k_per_split": "None",
}


@dataclass(frozen=True)
class FwdRequest:
    """What a forward call asks for, before an architecture is chosen."""

    dtype: str
    head_dim: int
    head_dim_v: int
    causal: bool = False
    local: bool = False
    has_softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    split_kv: bool = False  # num_splits > 1: partial outputs of key splits, then a combine
    pack_gqa: int = 0  # query heads per K/V head packed into a tile's rows; 0: off
    page_size: int = 0  # paged K/V (page_table): keys per page; 0: not paged

    def describe(self) -> str:
        dims = f"head_dim={self.head_dim}"
        if self.head_dim_v != self.head_dim:
            dims += f", head_dim_v={self.head_dim_v}"
        flags = [f.name for f in fields(self) if f.type in ("bool", bool) and getattr(self, f.name)]
        if self.pack_gqa:
            flags.append(f"pack_gqa={self.pack_gqa}")
        if self.page_size:
            flags.append(f"page_size={self.page_size}")
        return ", ".join([self.dtype, dims, *flags])


def capability_name(capability: tuple[int, int]) -> str:
    return f"compute capability {capability[0]}.{capability[1]}"


@dataclass(frozen=True)
class KernelSpec:
    """A kernel class known by name: what it can do is asked without importing it (and so
    without importing the CuTe DSL); ``load()`` imports the class itself, for compiling."""

    name: str
    arch: int
    module: str
    can_implement: Callable[[FwdConfig], tuple[bool, str]]

    def load(self) -> type:
        return getattr(importlib.import_module(self.module), self.name)


SM80_FWD = KernelSpec(
    "FlashAttentionForwardSm80", 80, "cute_fa.ampere.flash_fwd", sm80_support.fwd_can_implement
)
SM90_FWD = KernelSpec(
    "FlashAttentionForwardSm90", 90, "cute_fa.hopper.flash_fwd", sm90_support.fwd_can_implement
)
SM100_FWD = KernelSpec(
    "FlashAttentionForwardSm100",
    100,
    "cute_fa.blackwell.flash_fwd",
    sm100_support.fwd_can_implement,
)
_FWD_SPECS = {80: SM80_FWD, 90: SM90_FWD, 100: SM100_FWD}


# Whether an sm90 device routes to the sm90 family without ``CUTE_FA_FWD_ARCH=90``.
SM90_FWD_BY_DEFAULT = True
# Whether an sm100 / sm103 device routes to the sm100 family without ``CUTE_FA_FWD_ARCH=100``.
# That family has never run on a Blackwell GPU in this project: each of its compiled variants
# passes the first-use self-check on the user's GPU before it serves a call, else the sm80
# kernel serves it (``cute_fa.selftest``, docs/blackwell.md).
SM100_FWD_BY_DEFAULT = True


def fwd_kernel_classes(
    capability: tuple[int, int], exclude: frozenset[int] | tuple[int, ...] = ()
) -> list[KernelSpec]:
    """Forward kernels that may serve a device, best first; ``exclude``: families (80, 90,
    100) to leave out."""
    if tuple(capability) < MIN_CAPABILITY:
        raise NotImplementedError(
            f"cute_fa needs an NVIDIA GPU of compute capability 8.0 (Ampere) or newer; "
            f"this one has {capability_name(capability)}"
        )
    forced = settings.forced_fwd_arch()
    major = tuple(capability)[0]
    specs = [SM80_FWD]
    if major == 9 and (SM90_FWD_BY_DEFAULT or forced == 90):
        specs.insert(0, SM90_FWD)
    if major == 10 and (SM100_FWD_BY_DEFAULT or forced == 100):
        specs.insert(0, SM100_FWD)
    if forced is not None:
        specs = [s for s in specs if s.arch == forced]
    return [s for s in specs if s.arch not in exclude]


def fwd_kernel_class(arch: int) -> type:
    """The kernel class of a config's ``arch`` family (80: ampere, 90: hopper, 100: blackwell);
    imports it (and the CuTe DSL)."""
    if arch in _FWD_SPECS:
        return _FWD_SPECS[arch].load()
    raise NotImplementedError(f"cute_fa has no sm{arch} forward kernel yet")


def _problem_fields(request: FwdRequest) -> dict:
    return {f.name: getattr(request, f.name) for f in fields(request)}


def _with_fields(tiles: Tiles, asked: dict) -> Tiles:
    return dataclasses.replace(tiles, **asked) if asked else tiles


def _sm80_config(
    target: str, request: FwdRequest, seqlen_q: int | None, table: tuned.Table | None
) -> FwdConfig:
    problem = tuned.problem_class(request.head_dim, request.head_dim_v, request.causal)
    tiles = sm80_fwd_tile(request.head_dim, target, request.causal)
    asked = tuned.asked_fields("sm80_fwd", problem, table)
    return FwdConfig(
        arch=80, target=target, tuning=_with_fields(tiles, asked), **_problem_fields(request)
    )


def _sm90_config(
    target: str, request: FwdRequest, seqlen_q: int | None, table: tuned.Table | None
) -> FwdConfig:
    problem = tuned.problem_class(request.head_dim, request.head_dim_v, request.causal)
    base = FwdConfig(
        arch=90, target=target, tuning=sm90_support.Sm90FwdTuning(), **_problem_fields(request)
    )
    return sm90_support.fwd_config(base, seqlen_q, tuned.asked_fields("sm90_fwd", problem, table))


def _sm100_config(
    target: str, request: FwdRequest, seqlen_q: int | None, table: tuned.Table | None
) -> FwdConfig:
    if request.split_kv:
        raise NotImplementedError("split-KV (num_splits > 1) is not implemented on sm100 yet")
    if request.page_size:
        raise NotImplementedError("paged K/V (page_table) is not implemented on sm100 yet")
    problem = tuned.problem_class(request.head_dim, request.head_dim_v, request.causal)
    flags = _problem_fields(request)
    flags.pop("split_kv")
    flags.pop("page_size")
    base = sm100_support.fwd_config(
        flags.pop("head_dim"), flags.pop("head_dim_v"), target, flags.pop("dtype"), **flags
    )
    if sm100_support.fwd_pair_wanted(base, seqlen_q):  # FA4's 2-CTA rule (support.py)
        base = dataclasses.replace(base, tuning=dataclasses.replace(base.tuning, cta_pair=True))
    asked = tuned.asked_fields("sm100_fwd", problem, table)
    return dataclasses.replace(base, tuning=_with_fields(base.tuning, asked))


_CONFIG_BUILDERS = {80: _sm80_config, 90: _sm90_config, 100: _sm100_config}


def fwd_config_for_target(
    cls: KernelSpec | type,
    target: str,
    request: FwdRequest,
    seqlen_q: int | None = None,
    table: tuned.Table | None = None,
) -> tuple[FwdConfig | None, str]:
    """(config, "") when ``cls`` implements ``request`` on ``target``, else (None, reason).
    ``seqlen_q`` (the longest query sequence, when known) may pick the tile; ``table`` is the
    GPU's tuned table (None: built-in defaults and overrides only)."""
    try:
        config = _CONFIG_BUILDERS[cls.arch](target, request, seqlen_q, table)
    except (SettingError, TuningError):
        raise
    except (NotImplementedError, ValueError) as e:
        return None, str(e)
    ok, reason = cls.can_implement(config)
    return (config, "") if ok else (None, reason)


def try_plan(
    capability: tuple[int, int],
    request: FwdRequest,
    seqlen_q: int | None = None,
    table: tuned.Table | None = None,
    exclude: frozenset[int] | tuple[int, ...] = (),
) -> tuple[type | None, FwdConfig | None, str]:
    """(class, config, "") of the first kernel that implements ``request``, else (None, None,
    reasons). ``exclude``: families left out (``fwd_kernel_classes``)."""
    classes = fwd_kernel_classes(capability, exclude)
    target = target_for_capability(*capability)
    if classes:
        reasons = []
    elif exclude and fwd_kernel_classes(capability):
        reasons = [f"excluding sm{', sm'.join(map(str, sorted(exclude)))} leaves no family"]
    else:
        reasons = [f"{settings.FWD_ARCH}={settings.forced_fwd_arch()} leaves no family"]
    for cls in classes:
        config, reason = fwd_config_for_target(cls, target, request, seqlen_q, table)
        if config is not None:
            return cls, config, ""
        reasons.append(f"{cls.name}: {reason}")
    return None, None, "; ".join(reasons)


def fwd_plan(
    capability: tuple[int, int],
    request: FwdRequest,
    seqlen_q: int | None = None,
    table: tuned.Table | None = None,
    exclude: frozenset[int] | tuple[int, ...] = (),
) -> tuple[type, FwdConfig]:
    """Kernel class and compile key for ``request`` on a device of ``capability``;
    ``seqlen_q`` (the longest query sequence of the call, when known) may pick the tile;
    ``table``: the device's tuned table; ``exclude``: kernel families (80, 90, 100) this
    request may not use (a variant that failed its first-use self-check)."""
    capability = tuple(capability)
    cls, config, reasons = try_plan(capability, request, seqlen_q, table, exclude)
    if cls is None:
        raise NotImplementedError(
            f"cute_fa: no forward kernel implements [{request.describe()}] on "
            f"{TARGETS[capability]} ({capability_name(capability)}): {reasons}"
        )
    return cls, config


# Note [split-KV heuristic]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# ``num_splits`` 0 or None asks for a split count from the problem (``num_splits_heuristic``).
# A forward launches one CTA a tile (query block, head, batch). When those tiles fill less than
# half of the GPU's SMs (a decode step: one query block a head, few sequences) and each has a long
# key range, the SMs idle while a few CTAs walk every key block. Splitting each tile's key blocks
# into S ranges runs S times as many CTAs, at the cost of writing fp32 partial outputs and one
# combine pass over them (2 * S * dv * 4 bytes a query row, against the split's own K and V
# reads of at least SPLIT_MIN_KEY_BLOCKS * tile_n * (d + dv) * 2 bytes). The rule: no split
# when the tiles fill at least half the SMs or the key range has fewer than
# 2 * SPLIT_MIN_KEY_BLOCKS blocks; otherwise S = min(SMs // tiles, key_blocks //
# SPLIT_MIN_KEY_BLOCKS, SPLIT_MAX): one wave of CTAs, each split at least SPLIT_MIN_KEY_BLOCKS
# key blocks long. FA4's rule (flash_attn/cute/interface.py num_splits_heuristic) is
# min(SMs // tiles, 128, key_blocks) above 4 key blocks; this one is more conservative about short
# splits. Not measured yet: a starting point to tune on the GPU.
SPLIT_MIN_KEY_BLOCKS = 4
SPLIT_MAX = 128
# The split index shares the grid's z dimension with the batch (hopper/flash_fwd.py).
GRID_Z_MAX = 65535


def num_splits_heuristic(tiles: int, key_blocks: int, sm_count: int) -> int:
    """Split count for ``num_splits`` 0 / None (Note [split-KV heuristic]): ``tiles`` CTAs
    without splits (query blocks x heads x batch), ``key_blocks`` of the longest (or, for
    packed keys of unknown lengths, the average) key range, ``sm_count`` SMs."""
    if tiles <= 0 or 2 * tiles > sm_count or key_blocks < 2 * SPLIT_MIN_KEY_BLOCKS:
        return 1
    return max(1, min(sm_count // tiles, key_blocks // SPLIT_MIN_KEY_BLOCKS, SPLIT_MAX))


def clamp_num_splits(num_splits: int, batch: int) -> int:
    """``num_splits`` limited so that batch * num_splits fits the grid's z dimension."""
    return max(1, min(num_splits, GRID_Z_MAX // max(batch, 1)))


# Note [pack_gqa heuristic]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``pack_gqa=None`` packs the query heads of a K/V head into one tile (Note [packed GQA] in
# cute_fa/dsl/pack_gqa.py) when that fills the tiles' rows better: with ``seqlen_q`` query rows
# a head and ``tile_m`` rows a tile, the share of computed rows that are real is
# seqlen_q / (ceil(seqlen_q / tile_m) * tile_m) unpacked and the same with G * seqlen_q rows
# packed; pack when the unpacked share is at most PACK_GQA_MAX_SHARE of the packed one (a
# decode step: 1 of 128 rows against G of 128). Prefills fill their tiles either way and stay
# unpacked. FA3's ``should_pack_gqa`` packs below 0.9 of the packed share and FA4 packs every GQA
# call; here a packed tile gives up the sm90 forward's persistent grid, which its defaults pick
# for dense calls up to 2k rows (measured faster there), so only calls whose rows packing at
# least doubles pack by default. Not measured between the two yet. The sm80 forward (Ampere,
# sm86 / sm89 / sm120, Hopper with CUTE_FA_FWD_ARCH=80) takes the same rule on its own tile_m
# (128 at most head dims): it has no persistent grid to give up, so the rule is if anything
# conservative there; unmeasured on sm80 (the H200 runs the sm90 forward by default).
PACK_GQA_MAX_SHARE = 0.5


def pack_gqa_helps(seqlen_q: int, qhead_per_kvhead: int, tile_m: int) -> bool:
    """Whether ``pack_gqa=None`` packs a call of ``seqlen_q`` query rows (the longest
    sequence) with ``qhead_per_kvhead`` query heads per K/V head into tiles of ``tile_m``
    rows (Note [pack_gqa heuristic])."""
    if qhead_per_kvhead < 2 or seqlen_q <= 0:
        return False

    def filled(rows: int) -> float:
        return rows / (-(-rows // tile_m) * tile_m)

    return filled(seqlen_q) <= PACK_GQA_MAX_SHARE * filled(seqlen_q * qhead_per_kvhead)


def supported_capabilities() -> list[tuple[int, int]]:
    return sorted(c for c in TARGETS if c >= MIN_CAPABILITY)


@functools.lru_cache(maxsize=256)
def check_fwd_implementable_somewhere(request: FwdRequest) -> None:
    """Raise NotImplementedError when no kernel implements ``request`` on any known target.

    Lets the interface reject e.g. an unsupported head dim on any machine, GPU or not, before
    it looks at the device.
    """
    reasons: dict[str, list[str]] = {}
    for capability in supported_capabilities():
        cls, _, why = try_plan(capability, request)
        if cls is not None:
            return
        reasons.setdefault(why, []).append(TARGETS[capability])
    detail = "; ".join(f"{why} ({', '.join(targets)})" for why, targets in reasons.items())
    raise NotImplementedError(
        f"cute_fa: no forward kernel implements [{request.describe()}] on any GPU: {detail}"
    )


# --------------------------------------------------------------------------------------------
# Backward


def bwd_kernel_classes(arch: int) -> tuple[type, type, type]:
    """(preprocess, main, postprocess) kernel classes of an arch family."""
    if arch == 80:
        from .ampere import (  # noqa: I001 (imported here: these import the CuTe DSL)
            FlashAttentionBackwardPostprocessSm80,
            FlashAttentionBackwardPreprocessSm80,
            FlashAttentionBackwardSm80,
        )

        return (
            FlashAttentionBackwardPreprocessSm80,
            FlashAttentionBackwardSm80,
            FlashAttentionBackwardPostprocessSm80,
        )
    if arch == 90:
        pre_cls, _, post_cls = bwd_kernel_classes(80)
        from .hopper.flash_bwd import FlashAttentionBackwardSm90

        return pre_cls, FlashAttentionBackwardSm90, post_cls
    if arch == 100:
        pre_cls, _, post_cls = bwd_kernel_classes(80)
        from .blackwell.flash_bwd import FlashAttentionBackwardSm100

        return pre_cls, FlashAttentionBackwardSm100, post_cls
    raise NotImplementedError(f"cute_fa has no sm{arch} backward kernel yet")


def bwd_config(
    target: str,
    dtype: str,
    head_dim: int,
    head_dim_v: int,
    *,
    causal: bool = False,
    local: bool = False,
    has_softcap: bool = False,
    varlen_q: bool = False,
    varlen_k: bool = False,
    seqused_q: bool = False,
    seqused_k: bool = False,
    deterministic: bool = False,
    arch: int | None = None,
    table: tuned.Table | None = None,
) -> BwdConfig:
    """The main kernel's compile key for a request on ``target``: the sm90 kernel on sm_90a
    and the sm100 kernel on sm_100a / sm_103a where they implement the request, else the sm80
    kernel (Note [backward dispatch]; ``CUTE_FA_BWD_ARCH``, or ``arch``, forces a family);
    NotImplementedError naming the reason when the kernel cannot implement it. ``table``: the
    GPU's tuned table."""
    forced = arch if arch is not None else settings.forced_bwd_arch()
    if forced not in (None, 80, 90, 100):
        raise SettingError(f"backward arch {forced!r}: expected 80, 90 or 100")
    problem = tuned.problem_class(head_dim, head_dim_v, causal)
    flags = dict(
        target=target, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal,
        local=local, has_softcap=has_softcap, varlen_q=varlen_q, varlen_k=varlen_k,
        seqused_q=seqused_q, seqused_k=seqused_k, deterministic=deterministic,
    )  # fmt: skip
    tried = []  # the reasons of the families that declined, for the error
    if forced == 90 or (forced is None and target.startswith("sm_90")):
        base = BwdConfig(arch=90, tuning=sm90_support.Sm90BwdTuning(), **flags)
        config = sm90_support.bwd_config(base, tuned.asked_fields("sm90_bwd", problem, table))
        ok, reason = sm90_support.bwd_can_implement(config)
        if ok:
            return config
        tried.append(f"FlashAttentionBackwardSm90: {reason}")
        if forced == 90:
            raise NotImplementedError(
                f"cute_fa: no backward kernel implements [{config.name}] on {target}: "
                f"FlashAttentionBackwardSm90: {reason}"
            )
    if forced == 100 or (forced is None and target in sm100_support.SM100_FWD_TARGETS):
        config = sm100_support.bwd_config(
            head_dim, head_dim_v, **{k: v for k, v in flags.items() if "head_dim" not in k}
        )
        if sm100_support.bwd_pair_wanted(config):  # FA4's 2-CTA rule (support.py)
            config = config.replace(tuning=dataclasses.replace(config.tuning, cta_pair=True))
        ok, reason = sm100_support.bwd_can_implement(config)
        if ok:
            return config
        tried.append(f"FlashAttentionBackwardSm100: {reason}")
        if forced == 100:
            raise NotImplementedError(
                f"cute_fa: no backward kernel implements [{config.name}] on {target}: "
                f"FlashAttentionBackwardSm100: {reason}"
            )
    asked = tuned.asked_fields("sm80_bwd", problem, table)
    tiles = _with_fields(sm80_bwd_tile(head_dim, target), asked)
    config = BwdConfig(arch=80, tuning=tiles, **flags)
    ok, reason = sm80_support.bwd_can_implement(config)
    if not ok:
        tried.append(f"FlashAttentionBackwardSm80: {reason}")
        raise NotImplementedError(
            f"cute_fa: no backward kernel implements [{config.name}] on {target}: "
            + "; ".join(tried)
        )
    return config


# Note [backward dispatch]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# On the H200 the sm90 backward measured 0.96-1.18x SDPA CUDNN and 1.34-1.76x SDPA FLASH at d64,
# d128 and d256, 1.06-1.20x CUDNN at d96 / d192 (docs/performance.md), against 0.99-1.13x FLASH
# for the sm80 kernel (242-343 TFLOPs at 2k-16k), so an sm_90a device runs it wherever it can
# (every call the sm80 kernel takes, and (d, dv) = (192, 128) / (128, 64), which only the sm90
# backward has).
# deterministic=True runs the sm90 kernel too (its dQ writer warp takes the turns of the
# semaphores that run_backward allocates with the config's tile_m); on the H200 the sm80
# kernel's deterministic mode measured 266-291 TFLOPs at d128 8k, where the sm90 kernel's
# default measured 502-518 and its deterministic mode 0.94x (non-causal) / 0.87x (causal) of
# that (docs/performance.md, 2026-12-01).
# On sm_100a / sm_103a the sm100 backward (blackwell/flash_bwd.py: cross-compiled, never run
# here) takes what it implements, behind the first-use self-check of each variant
# (cute_fa/selftest.py: dq, dk, dv against the reference; a failing variant falls back to
# the sm80 backward, which serves the rest).


def coresident_fits(config: BwdConfig, max_seqlen_k: int, sm_count: int) -> bool:
    """Whether a deterministic call of the sm80 kernel may take its turns in coresident order
    (Note [deterministic dQ] in ampere/flash_bwd.py): the key blocks of one (batch, head) wait
    for each other, so all of them must be resident at once. The kernel runs at least one CTA
    an SM; half the SMs leaves room for other work on the GPU. ``CUTE_FA_BWD_DET_ORDER=chain``
    turns it off (a GPU shared in ways the SM count does not show: MPS limits, green
    contexts)."""
    if config.arch != 80 or not config.deterministic or config.local:
        return False
    if settings.deterministic_chain_order():
        return False
    return -(-max_seqlen_k // config.tile_n) <= sm_count // 2


def pre_config(config: BwdConfig, has_dlse: bool):
    """Compile key of the preprocess kernel that goes with a main-kernel config (the sm80
    kernel for every main kernel); its head_dim is the dQ accumulator's columns (the sm80
    main kernel's tile head dim, Note [rounded head dims] in cute_fa/config.py)."""
    from .ampere.flash_bwd_prepost import BwdPreConfig

    return BwdPreConfig(
        arch=80, target=config.target, dtype=config.dtype,
        head_dim=dq_accum_head_dim(config.arch, config.head_dim), head_dim_v=config.head_dim_v,
        has_dlse=has_dlse,
    )  # fmt: skip


def post_config(config: BwdConfig):
    """Compile key of the postprocess kernel that goes with a main-kernel config (the sm80
    kernel for every main kernel; for the sm80 main kernel it reads dQaccum in that kernel's
    fragment order, Note [dQ accumulator in fragment order] in ``ampere/support.py``)."""
    from .ampere.flash_bwd_prepost import BwdPostConfig

    fragments = {}
    if config.arch == 80:
        fragments = dict(tile_m=config.tile_m, num_warps=config.num_warps, varlen_q=config.varlen_q)
        acc = dq_accum_head_dim(config.arch, config.head_dim)
        if acc != config.head_dim:  # a rounded head dim (Note [rounded head dims])
            fragments["acc_head_dim"] = acc
    return BwdPostConfig(
        arch=80, target=config.target, dtype=config.dtype, head_dim=config.head_dim, **fragments
    )
