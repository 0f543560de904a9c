"""Device architecture -> forward kernel class and compile key; the generated feature matrix.

Every GPU from sm80 up can run the sm80 kernel family (``cute_fa.ampere``), compiled for the
device's own target (``config.target_for_capability``); an sm90 device first asks the sm90
family (``cute_fa.hopper``), whose ``can_implement`` takes what it does and leaves the rest to
sm80. ``CUTE_FA_FWD_ARCH=80`` or ``90`` restricts dispatch to one family. A request no listed
kernel implements raises ``NotImplementedError`` naming the feature, the architecture and each
kernel's reason; nothing falls back silently to another library.

This module imports neither torch nor the CuTe DSL: kernels are known by ``KernelSpec`` (name,
family, a DSL-free ``can_implement``) and their classes are imported only to compile.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, fields

from .ampere import support as sm80_support
from .config import TARGETS, FwdConfig, SettingError, sm80_fwd_tile, target_for_capability
from .hopper import support as sm90_support

MIN_CAPABILITY = (8, 0)

# Arguments of flash_attn.cute that cute_fa accepts by name but does not implement yet, with the
# value that means "off". Setting one to anything else raises NotImplementedError.
UNIMPLEMENTED_ARGUMENTS = {
    "qv": "None",
    "gather_kv_indices": "None",
    "page_table": "None",
    "num_splits": "1 (or <= 0: automatic)",
    "pack_gqa": "None or False",
    "score_mod": "None",
    "score_mod_bwd": "None",
    "mask_mod": "None",
    "aux_tensors": "None",
    "aux_scalars": "None",
    "block_sparse_tensors": "None",
    "block_sparse_tensors_bwd": "None",
    "scheduler_metadata": "None",
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

    def describe(self) -> str:
        dims = f"head_dim={self.head_dim}"
        if self.head_dim_v != self.head_dim:
            dims += f", head_dim_v={self.head_dim_v}"
        flags = [f.name for f in fields(self) if f.type in ("bool", bool) and getattr(self, f.name)]
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
_FWD_SPECS = {80: SM80_FWD, 90: SM90_FWD}


# ``CUTE_FA_FWD_ARCH=80`` (or 90) restricts forward dispatch to that kernel family, e.g. to
# compare the families on one GPU. Read when a launch plan is made (once per input signature).
FWD_ARCH_ENV = "CUTE_FA_FWD_ARCH"
# Whether an sm90 device routes to the sm90 family without ``CUTE_FA_FWD_ARCH=90``.
SM90_FWD_BY_DEFAULT = True


def fwd_kernel_classes(capability: tuple[int, int]) -> list[KernelSpec]:
    """Forward kernels that may serve a device, best first."""
    if tuple(capability) < MIN_CAPABILITY:
        raise NotImplementedError(
            f"cute_fa needs an NVIDIA GPU of compute capability 8.0 (Ampere) or newer; "
            f"this one has {capability_name(capability)}"
        )
    forced = os.environ.get(FWD_ARCH_ENV, "").strip()
    specs = [SM80_FWD]
    if tuple(capability)[0] == 9 and (SM90_FWD_BY_DEFAULT or forced == "90"):
        specs.insert(0, SM90_FWD)
    if forced:
        if forced not in ("80", "90"):
            raise ValueError(f"{FWD_ARCH_ENV}={forced!r}: expected 80 or 90")
        specs = [s for s in specs if str(s.arch) == forced]
    return specs


def fwd_kernel_class(arch: int) -> type:
    """The kernel class of a config's ``arch`` family (80: ampere, 90: hopper, 100: blackwell);
    imports it (and the CuTe DSL)."""
    if arch in _FWD_SPECS:
        return _FWD_SPECS[arch].load()
    raise NotImplementedError(f"cute_fa has no sm{arch} forward kernel yet")


def _sm80_config(target: str, request: FwdRequest, seqlen_q: int | None = None) -> FwdConfig:
    tile_m, tile_n, num_warps = sm80_fwd_tile(request.head_dim, target, request.causal)
    flags = {f.name: getattr(request, f.name) for f in fields(request)}
    return FwdConfig(
        arch=80, target=target, tile_m=tile_m, tile_n=tile_n, num_warps=num_warps, **flags
    )


def _sm90_config(target: str, request: FwdRequest, seqlen_q: int | None = None) -> FwdConfig:
    tile_m, tile_n, num_warps = sm90_support.fwd_tile(
        request.head_dim, request.causal, local=request.local, has_softcap=request.has_softcap,
        seqlen_q=seqlen_q,
    )  # fmt: skip
    flags = {f.name: getattr(request, f.name) for f in fields(request)}
    return sm90_support.fwd_tuned(
        FwdConfig(
            arch=90, target=target, tile_m=tile_m, tile_n=tile_n, num_warps=num_warps, **flags
        ),
        seqlen_q,
    )


_CONFIG_BUILDERS = {80: _sm80_config, 90: _sm90_config}


def fwd_config_for_target(
    cls: KernelSpec | type, target: str, request: FwdRequest, seqlen_q: int | None = None
) -> tuple[FwdConfig | None, str]:
    """(config, "") when ``cls`` implements ``request`` on ``target``, else (None, reason).
    ``seqlen_q`` (the longest query sequence, when known) may pick the tile."""
    try:
        config = _CONFIG_BUILDERS[cls.arch](target, request, seqlen_q)
    except SettingError:
        raise
    except (NotImplementedError, ValueError) as e:
        return None, str(e)
    ok, reason = cls.can_implement(config)
    return (config, "") if ok else (None, reason)


def _try_plan(
    capability: tuple[int, int], request: FwdRequest, seqlen_q: int | None = None
) -> tuple[type | None, FwdConfig | None, str]:
    """(class, config, "") of the first kernel that implements ``request``, else (None, None,
    reasons)."""
    classes = fwd_kernel_classes(capability)
    target = target_for_capability(*capability)
    reasons = [] if classes else [f"{FWD_ARCH_ENV}={os.environ.get(FWD_ARCH_ENV)} leaves no family"]
    for cls in classes:
        config, reason = fwd_config_for_target(cls, target, request, seqlen_q)
        if config is not None:
            return cls, config, ""
        reasons.append(f"{cls.name}: {reason}")
    return None, None, "; ".join(reasons)


def fwd_plan(
    capability: tuple[int, int], request: FwdRequest, seqlen_q: int | None = None
) -> tuple[type, FwdConfig]:
    """Kernel class and compile key for ``request`` on a device of ``capability``;
    ``seqlen_q`` (the longest query sequence of the call, when known) may pick the tile."""
    capability = tuple(capability)
    cls, config, reasons = _try_plan(capability, request, seqlen_q)
    if cls is None:
        raise NotImplementedError(
            f"cute_fa: no forward kernel implements [{request.describe()}] on "
            f"{TARGETS[capability]} ({capability_name(capability)}): {reasons}"
        )
    return cls, config


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
        cls, _, why = _try_plan(capability, request)
        if cls is not None:
            return
        reasons.setdefault(why, []).append(TARGETS[capability])
    detail = "; ".join(f"{why} ({', '.join(targets)})" for why, targets in reasons.items())
    raise NotImplementedError(
        f"cute_fa: no forward kernel implements [{request.describe()}] on any GPU: {detail}"
    )


# --------------------------------------------------------------------------------------------
# Feature matrix


@dataclass(frozen=True)
class MatrixRow:
    label: str
    request: FwdRequest | None  # None: an interface argument no kernel implements yet
    note: str = ""
    backward: bool = False  # the row asks the backward kernels, not the forward
    deterministic: bool = False  # backward rows: deterministic=True


def _base(**changes) -> FwdRequest:
    values = dict(dtype="bf16", head_dim=128, head_dim_v=128)
    values.update(changes)
    return FwdRequest(**values)


def feature_rows() -> list[MatrixRow]:
    rows = []
    for d in (32, 64, 80, 96, 128, 160, 192, 256):
        rows.append(MatrixRow(f"bf16, head_dim {d}", _base(head_dim=d, head_dim_v=d)))
    rows.append(MatrixRow("fp16, head_dim 128", _base(dtype="fp16")))
    rows.append(MatrixRow("head_dim 192, head_dim_v 128", _base(head_dim=192, head_dim_v=128)))
    rows += [
        MatrixRow("causal", _base(causal=True)),
        MatrixRow("sliding window (local)", _base(local=True)),
        MatrixRow("softcap", _base(has_softcap=True)),
        MatrixRow("varlen (cu_seqlens q and k)", _base(varlen_q=True, varlen_k=True)),
        MatrixRow("varlen + causal", _base(varlen_q=True, varlen_k=True, causal=True)),
        MatrixRow("seqused_q", _base(varlen_q=True, varlen_k=True, seqused_q=True)),
        MatrixRow("seqused_k", _base(varlen_q=True, varlen_k=True, seqused_k=True)),
    ]
    names = ", ".join(UNIMPLEMENTED_ARGUMENTS)
    rows.append(
        MatrixRow(
            "other flash_attn.cute arguments",
            None,
            f"accepted by name; NotImplementedError unless off: {names}",
        )
    )
    for label, request in [
        ("backward, head_dim 64", _base(head_dim=64, head_dim_v=64)),
        ("backward, head_dim 128", _base()),
        ("backward, head_dim 256", _base(head_dim=256, head_dim_v=256)),
        ("backward, head_dim 192, head_dim_v 128", _base(head_dim=192, head_dim_v=128)),
        ("backward, softcap, head_dim 256", _base(head_dim=256, head_dim_v=256, has_softcap=True)),
        ("backward, causal", _base(causal=True)),
        ("backward, sliding window", _base(local=True)),
        ("backward, softcap", _base(has_softcap=True)),
        ("backward, varlen", _base(varlen_q=True, varlen_k=True)),
    ]:
        rows.append(MatrixRow(label, request, backward=True))
    rows.append(MatrixRow("backward, deterministic=True", _base(), backward=True,
                          deterministic=True))  # fmt: skip
    return rows


def _try_bwd(
    capability: tuple[int, int], request: FwdRequest, deterministic: bool = False
) -> tuple[int | None, str]:
    """(kernel family, "") when the backward kernels implement ``request``, else (None, why)."""
    from .backward import bwd_config  # the backward plan lives with the torch-side backward

    flags = {f.name: getattr(request, f.name) for f in fields(request)}
    target = target_for_capability(*capability)
    try:
        config = bwd_config(target, flags.pop("dtype"), flags.pop("head_dim"),
                            flags.pop("head_dim_v"), deterministic=deterministic,
                            **flags)  # fmt: skip
    except NotImplementedError as e:
        return None, str(e)
    return config.arch, ""


def feature_matrix() -> tuple[list[str], list[tuple[str, list[str]]], list[str]]:
    """(columns, rows, footnotes): each cell is the kernel family that serves the row on that
    target (e.g. "sm80"), or "-" with a footnote number saying why not."""
    capabilities = supported_capabilities()
    columns = [TARGETS[c] for c in capabilities]
    notes: list[str] = []
    table = []
    for row in feature_rows():
        cells = []
        for capability in capabilities:
            if row.request is None:
                why = row.note
            elif row.backward:
                arch, why = _try_bwd(capability, row.request, row.deterministic)
                if arch is not None:
                    cells.append(f"sm{arch}")
                    continue
            else:
                cls, _, why = _try_plan(capability, row.request)
                if cls is not None:
                    cells.append(f"sm{cls.arch}")
                    continue
            if why not in notes:
                notes.append(why)
            cells.append(f"-({notes.index(why) + 1})")
        table.append((row.label, cells))
    return columns, table, notes


def format_feature_matrix(markdown: bool = False) -> str:
    columns, table, notes = feature_matrix()
    header = ["feature", *columns]
    if markdown:
        lines = [
            "| " + " | ".join(header) + " |",
            "|" + "|".join("---" for _ in header) + "|",
        ]
        lines += ["| " + " | ".join([label, *cells]) + " |" for label, cells in table]
        lines.append("")
        lines += [f"{i + 1}. {note}" for i, note in enumerate(notes)]
    else:
        rows = [header] + [[label, *cells] for label, cells in table]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        lines += [f"({i + 1}) {note}" for i, note in enumerate(notes)]
    title = (
        "cute_fa features by compile target (cell: kernel family that runs it; "
        "generated from each kernel class's can_implement)"
    )
    return "\n".join([title, "", *lines])
