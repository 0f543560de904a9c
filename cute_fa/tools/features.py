"""``python -m cute_fa features``: the feature matrix, generated from each kernel's
``can_implement`` through planning (what runs where, and why not)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from cute_fa.config import TARGETS, target_for_capability
from cute_fa.planning import (
    UNIMPLEMENTED_ARGUMENTS,
    FwdRequest,
    bwd_config,
    supported_capabilities,
    try_plan,
)


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
    for d in (32, 40, 64, 80, 96, 112, 128, 160, 192, 224, 256):
        rows.append(MatrixRow(f"bf16, head_dim {d}", _base(head_dim=d, head_dim_v=d)))
    rows.append(MatrixRow("fp16, head_dim 128", _base(dtype="fp16")))
    rows.append(MatrixRow("head_dim 192, head_dim_v 128", _base(head_dim=192, head_dim_v=128)))
    rows.append(MatrixRow("head_dim 128, head_dim_v 64", _base(head_dim=128, head_dim_v=64)))
    rows.append(MatrixRow("head_dim 64, head_dim_v 128", _base(head_dim=64, head_dim_v=128)))
    rows += [
        MatrixRow("causal", _base(causal=True)),
        MatrixRow("sliding window (local)", _base(local=True)),
        MatrixRow("softcap", _base(has_softcap=True)),
        MatrixRow("varlen (cu_seqlens q and k)", _base(varlen_q=True, varlen_k=True)),
        MatrixRow("varlen + causal", _base(varlen_q=True, varlen_k=True, causal=True)),
        MatrixRow("seqused_q", _base(varlen_q=True, varlen_k=True, seqused_q=True)),
        MatrixRow("seqused_k", _base(varlen_q=True, varlen_k=True, seqused_k=True)),
        MatrixRow(
            "split-KV (num_splits > 1)",
            _base(split_kv=True),
            "partial O/LSE of key splits, then flash_attn_combine's kernel (sm80+)",
        ),
        MatrixRow(
            "pack_gqa (4 query heads a K/V head)",
            _base(pack_gqa=4),
            "sm90: G divides 64; sm80: G divides tile_m; elsewhere pack_gqa=True runs unpacked",
        ),
        MatrixRow(
            "paged K/V (page_table, pages of 16)",
            _base(page_size=16, seqused_k=True),
            "sm90: page sizes multiples of 8 (TMA boxes); sm80: any (row gather); forward only",
        ),
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
        ("backward, head_dim 80", _base(head_dim=80, head_dim_v=80)),
        ("backward, head_dim 128", _base()),
        ("backward, head_dim 160", _base(head_dim=160, head_dim_v=160)),
        ("backward, head_dim 256", _base(head_dim=256, head_dim_v=256)),
        ("backward, head_dim 192, head_dim_v 128", _base(head_dim=192, head_dim_v=128)),
        ("backward, head_dim 128, head_dim_v 64", _base(head_dim=128, head_dim_v=64)),
        ("backward, softcap, head_dim 256", _base(head_dim=256, head_dim_v=256, has_softcap=True)),
        ("backward, causal", _base(causal=True)),
        ("backward, sliding window", _base(local=True)),
        ("backward, softcap", _base(has_softcap=True)),
        ("backward, varlen", _base(varlen_q=True, varlen_k=True)),
        (
            "backward, seqused_q / seqused_k",
            _base(varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True),
        ),
    ]:
        rows.append(MatrixRow(label, request, backward=True))
    rows.append(MatrixRow("backward, deterministic=True", _base(), backward=True,
                          deterministic=True))  # fmt: skip
    return rows


def _try_bwd(
    capability: tuple[int, int], request: FwdRequest, deterministic: bool = False
) -> tuple[int | None, str]:
    """(kernel family, "") when the backward kernels implement ``request``, else (None, why)."""
    flags = {f.name: getattr(request, f.name) for f in fields(request)}
    flags.pop("split_kv")  # a forward choice: the backward of a split forward is the usual one
    flags.pop("pack_gqa")  # likewise: the backward takes the heads unpacked
    flags.pop("page_size")  # a forward-only path (decode): no backward of paged K/V
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
                cls, _, why = try_plan(capability, row.request)
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
