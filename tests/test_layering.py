"""The library's import structure, from the source (ast, function-level imports included):
no import cycles among library modules, no import of the tools from the library, no torch in
``cute_fa/dsl`` or the arch packages' kernel and support modules, and no environment reads
outside ``cute_fa/settings.py`` (the tools and tests may read it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {
    "cute_fa": ROOT / "cute_fa",
    "cute_fa.ampere": ROOT / "ampere",
    "cute_fa.hopper": ROOT / "hopper",
    "cute_fa.blackwell": ROOT / "blackwell",
}
TOOLS = "cute_fa.tools"
ENTRY_POINT = "cute_fa.__main__"  # runs the tools; nothing imports it


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known and n != name}
        out |= {n for n in names if n.split(".")[0] in ("torch", "os")}
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def library(g) -> list[str]:
    return [m for m in g if not m.startswith(TOOLS) and m != ENTRY_POINT]


def test_no_import_cycles_in_the_library():
    g = graph()
    lib = set(library(g))
    faces = {m for m in g if modules()[m].name == "__init__.py"}
    edges = {m: {t for t in g[m] if t in lib and t not in faces} for m in lib - faces}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_library_never_imports_the_tools():
    g = graph()
    bad = [(m, t) for m in library(g) for t in g[m] if t.startswith(TOOLS)]
    assert bad == []


def test_no_torch_in_the_dsl_layer_or_the_kernel_packages():
    g = graph()
    torch_free = [m for m in g if m.startswith(("cute_fa.dsl", "cute_fa.ampere", "cute_fa.hopper",
                                                 "cute_fa.blackwell"))]  # fmt: skip
    assert torch_free, "the layout changed: update PACKAGE_DIRS"
    bad = [m for m in torch_free if any(t.split(".")[0] == "torch" for t in g[m])]
    assert bad == []


def test_only_the_settings_module_reads_the_environment():
    readers = []
    for name, path in modules().items():
        if name.startswith(TOOLS) or name in (ENTRY_POINT, "cute_fa.settings"):
            continue
        text = path.read_text()
        if "os.environ" in text or "getenv" in text:
            readers.append(name)
    assert readers == []
