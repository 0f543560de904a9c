"""Where a kernel's tuning comes from: built-in defaults, a per-GPU tuned table, overrides.

Each kernel family's tuning is one frozen dataclass (``cute_fa.config``: ``Tiles`` for the
sm80 kernels, ``Sm90FwdTuning``, ``Sm90BwdTuning``), a field of its compile key. Planning
builds it in three layers, later ones winning field by field:

1. **built-in defaults**: a pure function of the problem class in the arch's ``support.py``
   (``cute_fa.config`` for the sm80 tile tables);
2. **the tuned table** of this GPU, written by ``python -m cute_fa tune --write``: a JSON file
   under the cache directory (``<cache dir>/tuned/<gpu>.json``) holding, per family and problem
   class (head dims and causal, ``problem_class``), the fields that won. It is keyed by GPU
   name, SM count, CUDA driver, CuTe DSL version and cute_fa version; a table whose key differs
   from this process's is ignored with a one-line note, never applied; a corrupt file is
   ignored with a warning. ``CUTE_FA_TUNED=0`` ignores it;
3. **overrides**: ``with cute_fa.tuning(sm90_fwd={"tile_n": 80}):`` (a dict of fields, or a
   whole tuning instance) for the calls made inside the block. Forward launch plans are kept
   per override state, so one process can time several settings of the same signature
   (``bench --peers cute_fa,cute_fa:sm90_fwd.tile_n=80``).

A field the arch's planning cannot honour for a call (a TMA store with packed queries, a
persistent grid with a window) is left at what that call can run, as the support module's
``*_tuning`` functions document; a tuning whose kernel cannot implement the call (a tile that
does not fit in shared memory) makes that family decline it, and the next family or a
``NotImplementedError`` follows, as for any unsupported call.

This module imports neither torch nor the CuTe DSL.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import re
import threading
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from . import settings
from .cache import atomic_write
from .config import TUNING_CLASSES, check_field_types

FORMAT = 1  # version of the table file's layout

# --------------------------------------------------------------------------------------------
# Overrides

# family -> tuple of (field, value), sorted: hashable, so launch plans can be keyed by it.
_overrides: contextvars.ContextVar[tuple] = contextvars.ContextVar("cute_fa_tuning", default=())


def _fields_of(family: str, value: Any) -> dict[str, Any]:
    """The fields an override of ``family`` sets (TypeError naming an unknown family/field)."""
    cls = TUNING_CLASSES.get(family)
    if cls is None:
        raise TypeError(f"unknown tuning family {family!r}; known: {', '.join(TUNING_CLASSES)}")
    if isinstance(value, cls):
        return dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise TypeError(f"{family}: expected a dict of fields or a {cls.__name__}, got {value!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise TypeError(f"{family} has no field {', '.join(unknown)}; fields: {sorted(names)}")
    check_field_types(cls, {k: v for k, v in value.items() if v is not None})
    return dict(value)


@contextlib.contextmanager
def tuning(**families: Any):
    """Override tuning fields for the calls made inside the block, e.g.
    ``with cute_fa.tuning(sm90_fwd={"pingpong": False, "tile_n": 112}):``. Keys are family
    names (``sm80_fwd``, ``sm80_bwd``, ``sm90_fwd``, ``sm90_bwd``), values a dict of fields or
    a whole tuning instance. Nested blocks add to the outer one's fields. Each field's value is
    checked when a kernel's tuning is built (``ValueError`` for a value out of range)."""
    merged = {family: dict(fields) for family, fields in _overrides.get()}
    for family, value in families.items():
        merged.setdefault(family, {}).update(_fields_of(family, value))
    token = _overrides.set(
        tuple(sorted((f, tuple(sorted(v.items()))) for f, v in merged.items() if v))
    )
    try:
        yield
    finally:
        _overrides.reset(token)


def snapshot() -> tuple:
    """The active overrides, to re-enter elsewhere (``restored``): autograd may run a
    backward on its own worker thread, which does not see the caller's context."""
    return _overrides.get()


@contextlib.contextmanager
def restored(overrides: tuple):
    """The overrides of a ``snapshot`` for the block (replacing the current ones)."""
    token = _overrides.set(overrides)
    try:
        yield
    finally:
        _overrides.reset(token)


def override_fields(family: str) -> dict[str, Any]:
    """The fields the active ``tuning`` blocks set for ``family``."""
    for name, fields in _overrides.get():
        if name == family:
            return dict(fields)
    return {}


def state() -> tuple:
    """A hashable token of everything that may change tuning in this process now (overrides and
    the tuned tables' generation): launch plans made under one state serve only that state."""
    return (_overrides.get(), _generation)


def parse_assignment(text: str) -> tuple[str, str, Any]:
    """``family.field=value`` (the command-line form) as (family, field, value); values are
    ints, or true / false."""
    match = re.fullmatch(r"([a-z0-9_]+)\.([a-z_0-9]+)=(\S+)", text.strip())
    if match is None:
        raise ValueError(f"{text!r}: expected family.field=value, e.g. sm90_fwd.tile_n=80")
    family, name, raw = match.groups()
    _fields_of(family, {name: None})
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return family, name, lowered == "true"
    try:
        return family, name, int(raw)
    except ValueError:
        raise ValueError(f"{text!r}: a tuning value is an int, true or false") from None


# --------------------------------------------------------------------------------------------
# Problem classes and layered resolution


def problem_class(head_dim: int, head_dim_v: int, causal: bool) -> str:
    """The key of a tuned table's entry: head dims and causality, e.g. ``d128``,
    ``d192x128-causal``."""
    dv = "" if head_dim_v == head_dim else f"x{head_dim_v}"
    return f"d{head_dim}{dv}" + ("-causal" if causal else "")


def asked_fields(family: str, problem: str, table: Table | None) -> dict[str, Any]:
    """The fields the tuned table (for ``problem``) and then the overrides set for
    ``family``: what planning applies over the built-in default."""
    fields = dict(table.entry(family, problem)) if table is not None else {}
    fields.update(override_fields(family))
    return fields


def sources(
    family: str, problem: str, default: Any, table: Table | None
) -> dict[str, tuple[Any, str]]:
    """field -> (value, where it came from: "built-in", "tuned table", "override") for
    ``tune --show``; ``default`` is the built-in tuning of the problem."""
    table_fields = table.entry(family, problem) if table is not None else {}
    overrides = override_fields(family)
    out = {}
    for f in dataclasses.fields(default):
        if f.name in overrides:
            out[f.name] = (overrides[f.name], "override")
        elif f.name in table_fields:
            out[f.name] = (table_fields[f.name], "tuned table")
        else:
            out[f.name] = (getattr(default, f.name), "built-in")
    return out


# --------------------------------------------------------------------------------------------
# Per-GPU tuned tables


class TableKey(NamedTuple):
    """What a tuned table was measured on; a table applies only where all of it matches."""

    gpu: str  # device name, e.g. "NVIDIA H200"
    sm_count: int
    driver: int  # CUDA driver API version (cuDriverGetVersion), 0 when unknown
    dsl: str  # nvidia-cutlass-dsl version
    cute_fa: str  # cute_fa version


@dataclasses.dataclass
class Table:
    """A tuned table: family -> problem class -> {field: value}."""

    key: TableKey
    entries: dict[str, dict[str, dict[str, Any]]]
    path: Path | None = None

    def entry(self, family: str, problem: str) -> dict[str, Any]:
        return self.entries.get(family, {}).get(problem, {})

    def to_json(self) -> str:
        return json.dumps(
            {"format": FORMAT, "key": self.key._asdict(), "entries": self.entries},
            indent=2,
            sort_keys=True,
        )


_generation = 0  # bumped by every write or reset: launch plans made before are not reused
_loaded: dict[TableKey, Table | None] = {}
_lock = threading.Lock()
_noted: set[str] = set()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "gpu"


def table_path(key: TableKey) -> Path:
    """Where the tuned table of a GPU lives: ``<cache dir>/tuned/<gpu>-<sms>sm.json``."""
    return settings.cache_base_dir() / "tuned" / f"{_slug(key.gpu)}-{key.sm_count}sm.json"


def _note(message: str, category: type[Warning] = UserWarning) -> None:
    if message not in _noted:
        _noted.add(message)
        warnings.warn(message, category, stacklevel=3)


def _validate_entries(entries: Any) -> dict:
    """The entries of a parsed table file, each checked against its family's fields and
    values (ValueError / TypeError when one is not a valid tuning)."""
    if not isinstance(entries, dict):
        raise TypeError("entries is not an object")
    for family, problems in entries.items():
        if not isinstance(problems, dict):
            raise TypeError(f"entries.{family} is not an object")
        for problem, fields in problems.items():
            if not isinstance(fields, dict):
                raise TypeError(f"entries.{family}.{problem} is not an object")
            _fields_of(family, fields)
    return entries


def read_table(path: Path) -> Table:
    """The table in ``path`` (ValueError / TypeError / OSError when it is not a valid one)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} tuned table")
    key = TableKey(**data["key"])
    return Table(key, _validate_entries(data["entries"]), path)


def load_table(key: TableKey) -> Table | None:
    """This GPU's tuned table, or None (none written, ``CUTE_FA_TUNED=0``, written for another
    GPU or version: a one-line note; corrupt: a warning). Read once per process and key."""
    if not settings.tuned_table_enabled():
        return None
    with _lock:
        if key in _loaded:
            return _loaded[key]
        path = table_path(key)
        table = None
        if path.exists():
            try:
                found = read_table(path)
            except (OSError, ValueError, TypeError, KeyError) as e:
                _note(f"cute_fa: ignoring the tuned table {path}: unreadable ({e})")
            else:
                if found.key == key:
                    table = found
                else:
                    differs = [
                        f"{name} {theirs!r} != {ours!r}"
                        for name, theirs, ours in zip(key._fields, found.key, key, strict=True)
                        if theirs != ours
                    ]
                    _note(
                        f"cute_fa: ignoring the tuned table {path}: written for another setup "
                        f"({'; '.join(differs)}); run `python -m cute_fa tune --write` again"
                    )
        _loaded[key] = table
        return table


def write_table(table: Table) -> Path:
    """Write ``table`` atomically to its GPU's path (merging nothing: the caller passes the
    whole table); later plans use it."""
    global _generation
    _validate_entries(table.entries)
    path = table_path(table.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, table.to_json().encode())
    with _lock:
        _loaded[table.key] = Table(table.key, table.entries, path)
        _generation += 1
    return path


def reset_table(key: TableKey) -> bool:
    """Remove this GPU's tuned table; True when there was one."""
    global _generation
    path = table_path(key)
    existed = path.exists()
    if existed:
        path.unlink()
    with _lock:
        _loaded.pop(key, None)
        _generation += 1
    return existed


def forget_loaded() -> None:
    """Drop the tables read so far (tests; a process that changes the cache dir)."""
    global _generation
    with _lock:
        _loaded.clear()
        _noted.clear()
        _generation += 1
