"""A pure-Python model of the sm100 backward's MMA order and TMEM / smem reuse, checked over
every interleaving of its roles: the single-CTA kernel as built (blackwell/flash_bwd.py, the
class docstring's "MMA order" and pipelines) and the CTA pair's (192, 128) order as planned
(Note [backward TMEM plan] in blackwell/support.py; not built).

Nothing of the sm100 backward has run on a GPU here; a TMEM column that one GEMM overwrites
while a warp still needs it would not show in a compile. The model tracks what each TMEM cell
(32 columns) and smem tile holds, as labels such as ("S", i) or ("P", i, w), along every
interleaving of the roles (load, mma, compute warpgroup 0 / 1, dq), and asserts at each read
that the cell holds what the reader means to read. Pipelines are rings as in
tests/test_sm100_protocol.py: a producer's acquire of use u waits for every release of use
u - stages, a consumer's wait of use u for every commit of use u (both compute warpgroups arrive
on the barriers they share).

MMA timing, conservatively: an MMA's writes land when it is issued (a warp reading the cells
after the issue sees the new contents, so a read that the protocol does not order before the
issue fails), and its reads are checked again at the MMA thread's next commit or release (a
warp's write between the issue and that commit would be a race; writes of later MMAs of the
same thread are not, tcgen05 MMAs of one thread run in issue order). The pair is modeled from
one CTA's roles: the other CTA's compute and dq warps are symmetric (the even CTA's barriers
need both CTAs' arrivals, which only delays the MMA thread).
"""

from __future__ import annotations

import pytest
from cute_fa.blackwell.support import TMEM_COLUMNS, bwd_tmem_plan

CELL = 32  # TMEM columns a model cell
RING = {"kv": 1, "q": 2, "do": 1, "lse": 2, "s": 1, "dp": 1, "ds": 1, "dq": 1, "dkv": 1}


def cells(start: int, cols: int) -> tuple[int, ...]:
    """TMEM cells of columns [start, start + cols)."""
    assert start % CELL == 0 and cols % CELL == 0
    return tuple(range(start // CELL, (start + cols) // CELL))


def _layout(d: int, dv: int, ctas: int) -> dict[str, tuple]:
    """Cells of each region from the support module's plan (tile_m 128, two compute
    warpgroups, warpgroup w owning queries [64 w, 64 w + 64))."""
    plan = bwd_tmem_plan(128, d, dv, ctas)
    lay = {
        "S": [cells(plan["S"] + 64 * w, 64) for w in range(2)],
        "P": [cells(plan["P"] + 64 * w, 32) for w in range(2)],  # each in its own S^T half
        "dP": [cells(plan["dP"] + 64 * w, 64) for w in range(2)],
        "dQ": cells(plan["dQ"], d // ctas),
        "dV": cells(plan["dV"], dv),
        "dK": cells(plan["dK"], d),
    }
    if ctas == 2:  # dS^T (16-bit) over the first half of each warpgroup's own dP^T columns
        lay["dS"] = [cells(plan["dS"] + 64 * w, 32) for w in range(2)]
    assert max(lay["dK"]) < TMEM_COLUMNS // CELL
    return lay


def _acc(cells_: tuple, name: str, first: bool) -> tuple[tuple, tuple]:
    """(reads, writes) of an accumulating GEMM into ``cells_``."""
    reads = () if first else tuple((c, (name,)) for c in cells_)
    return reads, tuple((c, (name,)) for c in cells_)


def _roles(n: int, d: int, dv: int, ctas: int) -> dict[str, list[tuple]]:
    """Each role's operations for ``n`` query blocks: ("acq" | "commit" | "wait" | "rel",
    pipeline, use), ("mma", name, reads, writes), ("rd", reads), ("wr", writes); a read or
    write is (cell, label), a cell an int (TMEM) or a smem tile's name."""
    lay = _layout(d, dv, ctas)
    pair = ctas == 2
    sq = ["sQ0", "sQ1"]
    load = [("acq", "kv", 0), ("wr", (("sK", ("K",)), ("sV", ("V",)))), ("commit", "kv", 0)]
    for i in range(n):
        load += [("acq", "q", i), ("wr", ((sq[i % 2], ("Q", i)),)), ("commit", "q", i),
                 ("acq", "lse", i), ("commit", "lse", i),
                 ("acq", "do", i), ("wr", (("sdO", ("dO", i)),)), ("commit", "do", i)]  # fmt: skip

    def w_all(region, label):
        return tuple((c, label) for c in region)

    s_cells = lay["S"][0] + lay["S"][1]
    dp_cells = lay["dP"][0] + lay["dP"][1]

    def mma_s(i):
        return [("wait", "q", i),
                ("mma", f"S{i}", (("sK", ("K",)), (sq[i % 2], ("Q", i))), w_all(s_cells, ("S", i))),
                ("commit", "s", i)]  # fmt: skip

    def mma_dp(i):
        return [("mma", f"dP{i}", (("sV", ("V",)), ("sdO", ("dO", i))), w_all(dp_cells, ("dP", i))),
                ("commit", "dp", i)]  # fmt: skip

    def mma_dv(i):
        p = tuple((lay["P"][w][0], ("P", i, w)) for w in range(2))
        reads, writes = _acc(lay["dV"], "dV", i == 0)
        return [("mma", f"dV{i}", p + (("sdO", ("dO", i)),) + reads, writes)]

    def mma_dk_dq(i):
        if pair:  # dK's A: dS^T from TMEM; dQ's A: the dS operand tile in smem
            ds = tuple((lay["dS"][w][0], ("dS", i, w)) for w in range(2))
        else:
            ds = tuple((f"sdS{w}", ("dS", i)) for w in range(2))
        sds = tuple((f"sdS{w}", ("dS", i)) for w in range(2))
        reads, writes = _acc(lay["dK"], "dK", i == 0)
        return [("wait", "ds", i),
                ("mma", f"dK{i}", ds + ((sq[i % 2], ("Q", i)),) + reads, writes),
                ("rel", "q", i),
                ("mma", f"dQ{i}", sds + (("sK", ("K",)),), w_all(lay["dQ"], ("dQ", i))),
                ("commit", "dq", i), ("rel", "ds", i)]  # fmt: skip

    mma: list[tuple] = [("wait", "kv", 0), ("acq", "s", 0)] + mma_s(0)
    if not pair:
        # S(0); dP(0); per block: dV(i), S(i + 1), dK(i), dQ(i), dP(i + 1) (the docstring).
        mma += [("wait", "do", 0), ("acq", "dp", 0), ("acq", "dq", 0)] + mma_dp(0)
        for i in range(n):
            mma += [("acq", "s", i + 1)] + mma_dv(i) + [("rel", "do", i)]
            if i + 1 < n:
                mma += mma_s(i + 1)
            mma += mma_dk_dq(i)
            if i + 1 < n:
                mma += [("wait", "do", i + 1), ("acq", "dp", i + 1), ("acq", "dq", i + 1)]
                mma += mma_dp(i + 1)
    else:
        # The plan: dV(i) once P^T(i) is stored, then dP(i) over S^T's second half (in issue
        # order after the dV that reads the second warpgroup's P^T there), dK(i), dQ(i), and
        # S(i + 1) only once dQ(i) is drained.
        for i in range(n):
            mma += [("acq", "s", i + 1), ("wait", "do", i)] + mma_dv(i)
            mma += [("acq", "dp", i), ("acq", "dq", i)] + mma_dp(i) + [("rel", "do", i)]
            mma += mma_dk_dq(i)
            if i + 1 < n:
                mma += [("acq", "dq", i + 1)] + mma_s(i + 1)
    mma.append(("commit", "dkv", 0))

    roles = {"load": load, "mma": mma}
    for w in range(2):
        ops: list[tuple] = []
        for i in range(n):
            ops += [("wait", "lse", i), ("wait", "s", i),
                    ("rd", w_all(lay["S"][w], ("S", i))),
                    ("wr", w_all(lay["P"][w], ("P", i, w))), ("rel", "s", i),
                    ("wait", "dp", i), ("acq", "ds", i),
                    ("rd", w_all(lay["dP"][w], ("dP", i)))]  # fmt: skip
            if pair:
                ops.append(("wr", w_all(lay["dS"][w], ("dS", i, w))))
            ops += [("rel", "dp", i), ("wr", ((f"sdS{w}", ("dS", i)),)), ("commit", "ds", i),
                    ("rel", "lse", i)]  # fmt: skip
        ops += [("wait", "dkv", 0), ("rd", w_all(lay["dV"], ("dV",)) + w_all(lay["dK"], ("dK",)))]
        roles[f"compute{w}"] = ops
    roles["dq"] = [op for i in range(n)
                   for op in (("wait", "dq", i), ("rd", w_all(lay["dQ"], ("dQ", i))),
                              ("rel", "dq", i))]  # fmt: skip
    return roles


class Model:
    def __init__(self, n: int, d: int = 128, dv: int = 128, ctas: int = 1):
        self.roles = _roles(n, d, dv, ctas)

    def explore(self) -> int:
        """Every reachable state (program counters, cell contents, the MMA thread's pending
        reads with each cell's count of warp writes); AssertionError on a deadlock or a read
        that finds the wrong contents."""
        names = list(self.roles)
        progs = [self.roles[r] for r in names]
        signals: dict[tuple, list[tuple[int, int]]] = {}
        for r, ops in enumerate(progs):
            for at, op in enumerate(ops):
                if op[0] in ("commit", "rel"):
                    signals.setdefault(op[:3], []).append((r, at))

        def done(pcs, kind, key, use):
            found = signals.get((kind, key, use))
            return bool(found) and all(pcs[r] > at for r, at in found)

        def enabled(pcs, op):
            if op[0] == "acq":
                use = op[2] - RING[op[1]]
                return use < 0 or done(pcs, "rel", op[1], use)
            if op[0] == "wait":
                return done(pcs, "commit", op[1], op[2])
            return True

        mma_r = names.index("mma")
        start = (tuple(0 for _ in progs), (), ())
        seen, stack = {start}, [start]
        ends = tuple(len(p) for p in progs)
        while stack:
            pcs, mem_t, pending = stack.pop()
            moved = False
            for r, ops in enumerate(progs):
                if pcs[r] == ends[r] or not enabled(pcs, ops[pcs[r]]):
                    continue
                op = ops[pcs[r]]
                mem = dict(mem_t)
                pend = pending
                where = f"{names[r]} {op[0]} {op[1]}"
                if op[0] == "rd":
                    for c, label in op[1]:
                        got = mem.get(c, (None, 0))[0]
                        assert got == label, f"{where}: cell {c} holds {got}, not {label}"
                elif op[0] == "wr":
                    for c, label in op[1]:
                        mem[c] = (label, mem.get(c, (None, 0))[1] + 1)
                elif op[0] == "mma":
                    for c, label in op[2]:
                        got = mem.get(c, (None, 0))
                        assert got[0] == label, f"{where}: cell {c} holds {got[0]}, not {label}"
                        pend = pend + ((c, got[1], op[1]),)
                    for c, label in op[3]:
                        mem[c] = (label, mem.get(c, (None, 0))[1])
                elif r == mma_r and op[0] in ("commit", "rel"):
                    for c, writes, gemm in pend:
                        assert mem.get(c, (None, 0))[1] == writes, (
                            f"a warp wrote cell {c} under {gemm} (before its commit)"
                        )
                    pend = ()
                moved = True
                nxt = (pcs[:r] + (pcs[r] + 1,) + pcs[r + 1 :], tuple(sorted(mem.items(),
                       key=repr)), pend)  # fmt: skip
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
            if not moved and pcs != ends:
                stuck = {names[r]: progs[r][pcs[r]] for r in range(len(progs)) if pcs[r] < ends[r]}
                raise AssertionError(f"deadlock at {stuck}")
        return len(seen)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("d", [64, 128])
def test_sm100_backward_single_cta_order_keeps_tmem_and_smem(n: int, d: int) -> None:
    assert Model(n, d, d).explore() > n


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("d, dv", [(128, 128), (192, 128)])
def test_sm100_backward_pair_plan_order_keeps_tmem_and_smem(n: int, d: int, dv: int) -> None:
    assert Model(n, d, dv, ctas=2).explore() > n


def test_the_backward_model_finds_races() -> None:
    """Not vacuous: the single CTA issuing dP(i + 1) before dQ(i) is drained overwrites dQ
    under the dq warps; the pair's (192, 128) plan issuing S(i + 1) without that wait
    overwrites dQ(i) too (S^T and dP^T share columns), and so does its dP(i) issued before the
    dV(i) that reads the P^T under it; a compute warpgroup writing P^T before it read its S^T
    reads its own P."""
    single = Model(2)
    mma = single.roles["mma"]
    mma.remove(("acq", "dq", 1))
    with pytest.raises(AssertionError, match="holds"):
        single.explore()
    pair = Model(2, 192, 128, ctas=2)
    pair.roles["mma"].remove(("acq", "dq", 1))
    with pytest.raises(AssertionError, match="holds"):
        pair.explore()
    # The pair's (192, 128) dP(i) over the second warpgroup's P^T, issued before dV(i).
    swapped = Model(1, 192, 128, ctas=2)
    mma = swapped.roles["mma"]
    dv = next(op for op in mma if op[0] == "mma" and op[1] == "dV0")
    mma.remove(dv)
    mma.insert(mma.index(("commit", "dp", 0)), dv)
    with pytest.raises(AssertionError, match="holds"):
        swapped.explore()
    early = Model(1)
    ops = early.roles["compute0"]
    rd = next(op for op in ops if op[0] == "rd")
    ops.remove(rd)
    ops.insert(ops.index(("rel", "s", 0)), rd)
    with pytest.raises(AssertionError, match="holds"):
        early.explore()
