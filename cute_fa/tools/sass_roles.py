"""Per-role SASS of a warp-specialized kernel: the key-block loop of each role, counted.

``split_roles(sass_text)`` reads ``nvdisasm -c`` output of a kernel whose warps take roles after
a ``setmaxnreg`` (``USETMAXREG``): the sm100 forward here and FA4's. It finds, per role, the
loop that runs once per K/V block and counts the instructions of its body, so the softmax,
correction and MMA roles of two kernels can be compared per block. ``python -m
cute_fa.tools.sass_roles`` prints the table of docs/performance.md (ours beside FA4's).

Method
  1. Control-flow graph of the kernel function (the trap subroutines after it are left out):
     basic blocks split at labels and after branches; edges from ``BRA`` (a predicated or
     uniform-predicated one also falls through), ``BRX`` (its ``BRANCH_TARGETS``), and fall-
     through; ``EXIT`` / ``RET`` / ``BPT.TRAP`` without a predicate end a path; ``CALL`` (the
     tcgen05 guard-rail traps) falls through.
  2. Role entries: each block holding a ``USETMAXREG``. A role's code is the blocks reachable
     from its entry and from no other entry (the shared prologue and teardown fall out). Which
     role an entry is comes from its code: MMA issues ``UTCHMMA``; softmax has ``MUFU.EX2``
     and ``STTM`` (P into TMEM); correction has ``LDTM``, ``STTM`` and ``FMUL2`` (O rescaled in
     TMEM) and no ``MUFU.EX2`` / ``UTCHMMA``; the rest (load, epilogue, idle) are not counted.
  3. Loops: natural loops of the role's code (a back edge u -> h with h dominating u, from the
     entry). A loop is a *spin* loop if it has no instruction of the role's signature (``MUFU
     .EX2`` / ``FMUL2`` / ``UTCHMMA``): the retry of an mbarrier wait (``SYNCS.PHASECHK`` then a
     branch back), moved out of line by ptxas. The key-block loop is the innermost non-spin
     loop that waits on an mbarrier (``SYNCS.PHASECHK``) in its own body; a persistent
     kernel's tile loop encloses it, and an inner loop without a wait (a runtime K-phase loop
     of the MMA) is inside it.
  4. Per block: the instructions of the key-block loop's blocks, less those of the spin loops
     nested in it (a wait that succeeds at its first try: the in-line ``SYNCS.PHASECHK``
     counts, its retry does not). Nested non-spin loops count once (their trip count is not
     in the SASS).

Checked by hand (2026-12-02) on our d 128 forward: the correction loop's 181 instructions are
its 15 in-line blocks (two waits, a conditional rescale of 64 FMUL2 a Q tile, arrivals), the
softmax's unmasked loop 487 straight-line instructions; the left-out blocks are the retry stubs
(MOV, ``SYNCS.PHASECHK`` / ``NANOSLEEP`` loop, ``BRA`` back) that ptxas puts after the kernel's
last ``EXIT``.

Table (``role_table``, ``main``)
  One row a key-block loop. A softmax role has one loop for blocks without a mask ("softmax
  unmasked") and, where the kernel has one, a loop for masked blocks ("softmax masked": one
  ``FSEL`` a column or more). "rows": the query rows one iteration serves, the normaliser
  between kernels: a softmax warpgroup owns one Q tile of 128 rows; the correction rescales
  ``FMUL2 * 2 / dv`` Q tiles; the MMA issues for those Q tiles of its CTA, twice that for a
  2-CTA MMA (``UTCHMMA.2CTA``: M = 256 over the CTA pair, issued by the leader CTA alone).
  A role marked ``*`` has a runtime loop inside its body (counted once).

Limits (read the numbers with these in mind)
  - Static counts: every arm of a branch inside the body counts (the correction's rescale that
    runs only when a row max moved, a masked and an unmasked copy if both sit in one loop), so
    a body is the union of its paths, not one path.
  - One iteration of the loop, which may be more than one K/V block (an unrolled loop) or one
    block of more rows (two Q tiles in the correction and MMA roles, a 2-CTA pair in FA4's
    d128 non-causal MMA): ``RoleLoop.blocks`` is the number of K/V blocks one iteration
    handles, from the MMA's issue count where it can be told; the caller normalises.
  - Blocks peeled off the loop (the first, masked block; the last O += P V) are outside the
    loop and not counted; a kernel that handles most blocks outside its loop (a loop only for
    the masked ones) would show a small body.
  - Irreducible control flow is not a natural loop and is not found.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_INSTR = re.compile(
    r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P[T0-9]+)\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)(.*)$"
)
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_BRX_TARGETS = re.compile(r"BRANCH_TARGETS\s+([^\"]+)\"")
_BRA_GUARD = re.compile(r"^\s*!?U?P[T0-9]+\s*,")

# Counted per role (each key is a column of the table): a predicate on the full opcode.
COLUMNS = {
    "MUFU.EX2": lambda op: op.startswith("MUFU.EX2"),
    "FFMA": lambda op: op.split(".")[0] == "FFMA",
    "FFMA2": lambda op: op.split(".")[0] == "FFMA2",
    "FMUL": lambda op: op.split(".")[0] == "FMUL",
    "FMUL2": lambda op: op.split(".")[0] == "FMUL2",
    "FADD2": lambda op: op.split(".")[0] == "FADD2",
    "FMNMX": lambda op: op.split(".")[0] in ("FMNMX", "FMNMX3"),
    "LDTM": lambda op: op.split(".")[0] == "LDTM",
    "STTM": lambda op: op.split(".")[0] == "STTM",
    "UTCHMMA": lambda op: op.split(".")[0] == "UTCHMMA",
    "BAR": lambda op: op.split(".")[0] == "BAR",
    "SYNCS": lambda op: op.split(".")[0] == "SYNCS",
}
ROLES = ("softmax", "correction", "mma")


@dataclass
class Instr:
    addr: int
    pred: str | None
    op: str  # full opcode with its modifiers, e.g. "MUFU.EX2"
    rest: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


@dataclass
class Block:
    index: int
    labels: list[str] = field(default_factory=list)
    instrs: list[Instr] = field(default_factory=list)
    succ: list[int] = field(default_factory=list)


@dataclass
class RoleLoop:
    """The key-block loop of one role: its counts per iteration."""

    role: str
    entry_addr: int  # the role's USETMAXREG
    maxnreg: int  # the register count its USETMAXREG asks for
    head_addr: int  # first instruction of the loop header
    instructions: int  # total per iteration (spin loops left out)
    counts: Counter  # opcode -> count per iteration (full opcodes)
    columns: dict[str, int]  # COLUMNS counted
    nested: int  # non-spin loops nested in the body (counted once)
    blocks: int = 1  # K/V blocks per iteration (set by the caller where it knows)


def kernel_instructions(sass_text: str) -> list[tuple[list[str], Instr]]:
    """(labels before it, instruction) of the kernel function: the first ``.text.kernel`` function
    of the listing, up to the next function."""
    out, labels, started = [], [], False
    for line in sass_text.splitlines():
        if not started:
            started = line.startswith(".text.") and "$__internal" not in line
            continue
        if line.lstrip().startswith((".weak", ".global", "//----", ".section")):
            break
        m = _LABEL.match(line)
        if m:
            labels.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            out.append((labels, Instr(int(m.group(1), 16), m.group(2), m.group(3), m.group(4))))
            labels = []
    if not out:
        raise ValueError("no kernel function in the SASS listing")
    return out


def _ends_block(ins: Instr) -> bool:
    return ins.base in ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "BPT")


def build_cfg(sass_text: str) -> list[Block]:
    """Basic blocks of the kernel function, with successor edges."""
    blocks: list[Block] = []
    cur = Block(0)
    for labels, ins in kernel_instructions(sass_text):
        if labels and cur.instrs:
            blocks.append(cur)
            cur = Block(len(blocks))
        cur.labels.extend(labels)
        cur.instrs.append(ins)
        if _ends_block(ins):
            blocks.append(cur)
            cur = Block(len(blocks))
    if cur.instrs:
        blocks.append(cur)
    by_label = {lab: b.index for b in blocks for lab in b.labels}
    for b in blocks:
        last = b.instrs[-1]
        nxt = [b.index + 1] if b.index + 1 < len(blocks) else []
        if last.base == "BRA":
            target = _TARGET.search(last.rest)
            conditional = last.pred is not None or bool(_BRA_GUARD.match(last.rest))
            if last.pred in ("@PT", "@UPT"):
                conditional = False
            b.succ = ([by_label[target.group(1)]] if target else []) + (nxt if conditional else [])
        elif last.base in ("BRX", "JMX"):
            m = _BRX_TARGETS.search(last.rest)
            names = [t.strip() for t in m.group(1).split(",")] if m else []
            b.succ = [by_label[t] for t in names if t in by_label]
        elif last.base in ("EXIT", "RET", "BPT", "JMP"):
            b.succ = nxt if last.pred is not None else []
        else:
            b.succ = nxt
    return blocks


def _preds(blocks: list[Block]) -> list[list[int]]:
    preds: list[list[int]] = [[] for _ in blocks]
    for b in blocks:
        for s in b.succ:
            preds[s].append(b.index)
    return preds


def _dominators(blocks: list[Block]) -> list[int]:
    """Immediate dominator of each block from block 0 (Cooper, Harvey and Kennedy); -1 for the
    entry and for blocks not reachable from it."""
    order, seen, stack = [], {0}, [(0, iter(blocks[0].succ))]
    while stack:  # reverse post-order
        node, it = stack[-1]
        nxt = next((s for s in it if s not in seen), None)
        if nxt is None:
            order.append(node)
            stack.pop()
        else:
            seen.add(nxt)
            stack.append((nxt, iter(blocks[nxt].succ)))
    order.reverse()
    rank = {n: i for i, n in enumerate(order)}
    preds = _preds(blocks)
    idom = [-1] * len(blocks)
    idom[0] = 0
    changed = True
    while changed:
        changed = False
        for n in order[1:]:
            new = -1
            for p in preds[n]:
                if idom[p] == -1:
                    continue
                if new == -1:
                    new = p
                    continue
                a, b = p, new
                while a != b:
                    while rank[a] > rank[b]:
                        a = idom[a]
                    while rank[b] > rank[a]:
                        b = idom[b]
                new = a
            if new != idom[n]:
                idom[n], changed = new, True
    idom[0] = -1
    return idom


def _dominates(idom: list[int], a: int, b: int) -> bool:
    while b != -1:
        if b == a:
            return True
        b = idom[b]
    return False


def _natural_loops(blocks: list[Block], idom: list[int]) -> dict[int, set[int]]:
    """Natural loops, header -> body (back edges to one header merged)."""
    preds = _preds(blocks)
    loops: dict[int, set[int]] = {}
    for b in blocks:
        for h in b.succ:
            if _dominates(idom, h, b.index):
                body = loops.setdefault(h, {h})
                stack = [b.index]
                while stack:
                    x = stack.pop()
                    if x not in body:
                        body.add(x)
                        stack.extend(preds[x])
    return loops


def _ops(blocks: list[Block], nodes: set[int]) -> Counter:
    return Counter(ins.op for n in nodes for ins in blocks[n].instrs)


def classify(ops: Counter) -> str:
    """Role of a region from its opcodes (module docstring, step 2)."""
    has = lambda pred: any(pred(op) for op in ops)  # noqa: E731
    if has(COLUMNS["UTCHMMA"]):
        return "mma"
    if has(COLUMNS["MUFU.EX2"]) and has(COLUMNS["STTM"]):
        return "softmax"
    if has(COLUMNS["LDTM"]) and has(COLUMNS["STTM"]) and has(COLUMNS["FMUL2"]):
        return "correction"
    return "other"


SIGNATURE = {
    "softmax": COLUMNS["MUFU.EX2"],
    "correction": COLUMNS["FMUL2"],
    "mma": COLUMNS["UTCHMMA"],
}


def _is_wait(op: str) -> bool:
    """An mbarrier wait or a named-barrier sync (FA4's correction waits on the softmax warps'
    row factors at a named barrier)."""
    return op.startswith(("SYNCS.PHASECHK", "BAR.SYNC"))


def _cold(
    blocks: list[Block],
    idom: list[int],
    loops: dict[int, set[int]],
    preds: list[list[int]],
    spin: list[set[int]],
    lp: set[int],
) -> set[int]:
    """The out-of-line retry paths of the waits in loop ``lp``: each spin loop nested in it, and
    the straight-line stub leading to it and back (the blocks dominated by the stub's first
    block), unless that stub dominates the loop's latch (an in-line wait: only its retry blocks
    are cold)."""
    head = next(h for h, b in loops.items() if b is lp)
    latches = [p for p in preds[head] if p in lp]
    out: set[int] = set()
    for sp in spin:
        if not sp < lp:
            continue
        start = next(h for h, b in loops.items() if b is sp)
        while True:
            into = [p for p in preds[start] if p not in sp]
            if len(into) != 1 or into[0] not in lp or len(blocks[into[0]].succ) != 1:
                break
            start = into[0]
        if any(_dominates(idom, start, la) for la in latches):
            out |= sp - {start}
        else:
            out |= {x for x in lp if _dominates(idom, start, x)}
    return out


def role_loops(sass_text: str) -> list[RoleLoop]:
    """The key-block loop(s) of each softmax / correction / MMA role region of the kernel."""
    blocks = build_cfg(sass_text)
    idom = _dominators(blocks)
    loops = _natural_loops(blocks, idom)
    entries = [b.index for b in blocks if any(i.base == "USETMAXREG" for i in b.instrs)]
    dominated = {e: {b.index for b in blocks if _dominates(idom, e, b.index)} for e in entries}
    preds = _preds(blocks)
    out = []
    for e in entries:
        region = dominated[e] - set().union(
            *(dominated[o] for o in entries if o != e and o in dominated[e])
        )
        role = classify(_ops(blocks, region))
        if role == "other":
            continue
        sig = SIGNATURE[role]
        mine = [body for h, body in loops.items() if h in region]
        spin = [lp for lp in mine if not any(sig(op) for op in _ops(blocks, lp))]
        real = [lp for lp in mine if not any(lp is s for s in spin)]

        body = {id(lp): lp - _cold(blocks, idom, loops, preds, spin, lp) for lp in real}
        waiting = [
            lp for lp in real if any(_is_wait(i.op) for n in body[id(lp)] for i in blocks[n].instrs)
        ]
        inner = [lp for lp in waiting if not any(o < lp for o in waiting)]
        setmax = next(i for i in blocks[e].instrs if i.base == "USETMAXREG")
        for head in sorted(h for h, b in loops.items() if any(b is x for x in inner)):
            lp = loops[head]
            ops = _ops(blocks, body[id(lp)])
            out.append(
                RoleLoop(
                    role=role,
                    entry_addr=setmax.addr,
                    maxnreg=int(re.search(r"0x[0-9a-f]+", setmax.rest).group(0), 16),
                    head_addr=blocks[head].instrs[0].addr,
                    instructions=sum(ops.values()),
                    counts=ops,
                    columns={
                        k: sum(c for op, c in ops.items() if f(op)) for k, f in COLUMNS.items()
                    },
                    nested=sum(1 for o in real if o < lp),
                )
            )
    return out


def is_masked(loop: RoleLoop, tile_n: int = 128) -> bool:
    """A softmax loop whose body selects scores away (a mask: one FSEL a column or more)."""
    return loop.role == "softmax" and loop.counts.get("FSEL", 0) >= tile_n // 2


def role_table(sass_text: str, head_dim_v: int, tile_q: int = 128) -> list[dict]:
    """One row per key-block loop: role (softmax split into "softmax unmasked" / "softmax
    masked"), the rows of queries one iteration covers, and the COLUMNS counts.

    Rows: a softmax warpgroup owns one Q tile (``tile_q`` rows, a thread a row); the correction
    rescales ``FMUL2 * 2 / head_dim_v`` Q tiles (FMUL2: two columns of O); the MMA issues for
    that many Q tiles of the CTA, times 2 for a 2-CTA MMA (``UTCHMMA.2CTA``: M spans the pair)."""
    loops = role_loops(sass_text)
    corr = [lp for lp in loops if lp.role == "correction"]
    q_tiles = max(1, round(corr[0].columns["FMUL2"] * 2 / head_dim_v)) if corr else 1
    rows = []
    for lp in loops:
        name, n_rows = lp.role, tile_q
        if lp.role == "softmax":
            name = "softmax masked" if is_masked(lp) else "softmax unmasked"
        elif lp.role == "correction":
            n_rows = q_tiles * tile_q
        else:
            two_cta = any(".2CTA" in op for op in lp.counts if op.startswith("UTCHMMA"))
            n_rows = q_tiles * tile_q * (2 if two_cta else 1)
            name = "mma (2-CTA)" if two_cta else "mma"
        if lp.nested:
            name += " *"  # a runtime loop inside the body, counted once
        rows.append(dict(role=name, rows=n_rows, maxnreg=lp.maxnreg, loop=lp, **lp.columns,
                         instr=lp.instructions))  # fmt: skip
    order = ("softmax unmasked", "softmax masked", "correction", "mma")
    rows.sort(key=lambda r: next(i for i, o in enumerate(order) if r["role"].startswith(o)))
    return rows


TABLE_COLUMNS = ("MUFU.EX2", "FFMA", "FFMA2", "FMUL", "FMUL2", "LDTM", "STTM", "UTCHMMA", "BAR",
                 "SYNCS")  # fmt: skip


def cubin_report(cubin_path: str | Path, head_dim_v: int) -> dict:
    """REG / STACK of the kernel (cuobjdump) and its role table (nvdisasm)."""
    from cute_fa.tools.sass import disassemble, resource_usage

    usage = resource_usage(cubin_path)
    name, res = max(usage.items(), key=lambda item: item[1]["regs"])
    return dict(kernel=name, regs=res["regs"], stack=res["stack"],
                roles=role_table(disassemble(cubin_path), head_dim_v))  # fmt: skip


def markdown(reports: list[tuple[str, dict]]) -> str:
    head = ["kernel", "REG", "STACK", "role (setmaxnreg)", "rows", *TABLE_COLUMNS, "instr."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rep in reports:
        for i, r in enumerate(rep["roles"]):
            first = [label, str(rep["regs"]), str(rep["stack"])] if i == 0 else ["", "", ""]
            cells = [*first, f"{r['role']} ({r['maxnreg']})", str(r["rows"])]
            cells += [str(r[c]) for c in TABLE_COLUMNS] + [str(r["instr"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_FA4_DIR = re.compile(r"d(\d+)_c([01])$")


def fa4_cubins(root: str | Path) -> list[tuple[int, bool, Path]]:
    """(d, causal, cubin) under ``root``/d{D}_c{0,1}/ (one FA4 forward compile a folder: module
    docstring of ``main``); the folder's largest cubin is the forward kernel."""
    out = []
    for sub in sorted(Path(root).iterdir(), key=lambda p: p.name):
        m = _FA4_DIR.match(sub.name)
        cubins = sorted(sub.glob("*.cubin"), key=lambda p: p.stat().st_size) if m else []
        if cubins:
            out.append((int(m.group(1)), m.group(2) == "1", cubins[-1]))
    out.sort(key=lambda t: (t[0], t[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the per-role table of our sm100 forward (compiled here) and of FA4's cubins.

    FA4's cubins: one folder a config, as made by (``/work/shared/peers/README.md`` for the
    set-up)::

        for d in 64 128 256; do for c in 0 1; do PYTHONPATH=/tmp/fa4site D=$d CAUSAL=$c MODE=fwd \\
            DUMP_DIR=/tmp/fa4-cubins/d${d}_c$c python /work/shared/peers/fa4_sm100.py; done; done
    """
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m cute_fa.tools.sass_roles",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--head-dims", default="64,128",
                        help="our forward's d (dv = d; 192: dv 128) to compile")  # fmt: skip
    parser.add_argument("--causal", default="0,1", help="causal flags to compile (0,1)")
    parser.add_argument("--target", default="sm_100a")
    parser.add_argument("--fa4-cubins", help="folder of FA4 cubins, d{D}_c{0,1}/*.cubin")
    parser.add_argument("--cubin", action="append", default=[], metavar="LABEL=PATH:DV",
                        help="any other cubin (its dv for the correction's rows)")  # fmt: skip
    args = parser.parse_args(argv)

    from cute_fa.tools.sass import compile_cubin

    reports: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="cute-fa-roles-") as tmp:
        for d in [int(x) for x in args.head_dims.split(",") if x]:
            dv = 128 if d == 192 else d
            for causal in [x == "1" for x in args.causal.split(",") if x]:
                from cute_fa.blackwell.support import fwd_config

                config = fwd_config(d, dv, target=args.target, causal=causal)
                path = Path(tmp) / f"ours-d{d}-c{int(causal)}.cubin"
                path.write_bytes(compile_cubin(config))
                reports.append((f"ours d{d}{' causal' if causal else ''}", cubin_report(path, dv)))
        if args.fa4_cubins:
            for d, causal, path in fa4_cubins(args.fa4_cubins):
                reports.append((f"FA4 d{d}{' causal' if causal else ''}", cubin_report(path, d)))
        for spec in args.cubin:
            label, rest = spec.split("=", 1)
            path, dv = rest.rsplit(":", 1)
            reports.append((label, cubin_report(path, int(dv))))
    print(markdown(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
