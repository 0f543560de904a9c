"""A pure-Python model of the sm100 forward's pipelines (blackwell/flash_fwd.py), checked over
every interleaving of its roles for a few key blocks: no deadlock, and the orderings the kernel
relies on but no SASS shows.

Nothing of the sm100 kernels has run on a GPU here, and a deadlock or a TMEM / smem overwrite
race would not show in a compile. The model is the class docstring's protocol, role by role, as
the code issues it (``load``, ``mma`` with ``issue_s`` / ``issue_pv``, ``softmax`` /
``softmax_step``, ``correction``, ``epilogue``): each role is a straight-line list of pipeline
operations for a given number of key blocks ``n``; a pipeline is a ring of stages (K/V:
``SM100_FWD_KV_STAGES``; Q and the epilogue: two; S, O and the statistics: one slot a Q tile,
each a ring of one stage). A producer's acquire of use ``u`` waits for the consumers' release of
use ``u - stages``; a consumer's wait of use ``u`` for the producer's commit of ``u``. A tcgen05
commit completes when every MMA issued before it by the MMA thread has completed (in-order
issue). The checker explores every reachable state (the roles' program counters determine the
state) and asserts, besides progress:

- S_i(j) = Q_i K[j]^T, which overwrites the TMEM columns of P_i(j - 1), is issued only after
  softmax_i released block j - 1 (P written) and after O_i += P_i(j - 1) V (which reads it) was
  issued by the same thread;
- the correction rescales O_i for block j only between the completion of O_i += P_i(j - 1) V and
  the issue of O_i += P_i(j) V, and reads O_i for the epilogue only after the last P V completed;
- the correction writes O_i over the Q tiles' smem only after every S = Q K^T GEMM completed;
- a K/V stage is overwritten by the load warp only after the GEMM that read its previous use
  completed.
"""

from __future__ import annotations

import sys

import pytest
from cute_fa.blackwell.support import SM100_FWD_KV_STAGES

Q_TILES = 2
# (pipeline) -> stages of its ring; per-slot pipelines are keyed (name, slot).
RING = {"q": 2, "epi": 2, "s": 1, "o": 1, "stats": 1}


def _ops(n: int, kv: int) -> dict[str, list[tuple]]:
    """Each role's operations for ``n`` key blocks (n >= 1): ("acq" | "commit" | "wait" |
    "rel", pipeline key, use) or ("mma", name, tile, block) / ("check", name, tile, block)."""
    load, mma, corr, epi = [], [], [], []
    soft = {i: [] for i in range(Q_TILES)}

    def kv_load(u):  # load_kv: wait for the stage, TMA (lands as the commit)
        load.extend([("acq", "kv", u), ("commit", "kv", u)])

    for i in range(Q_TILES):  # load: Q0, K[0], Q1, V[0], K[1], V[1], ...
        load.extend([("acq", "q", i), ("commit", "q", i)])
        if i == 0:
            kv_load(0)
    for j in range(n - 1):
        kv_load(2 * j + 1)
        kv_load(2 * j + 2)
    kv_load(2 * n - 1)

    def issue_s(i, j, first):
        if first:
            mma.append(("acq", ("s", i), j))
        mma.append(("mma", "S", i, j))
        mma.append(("commit", ("s", i), j))

    def issue_pv(i, j):
        mma.append(("acq", ("s", i), j))  # P_i(j - 1) released by softmax_i
        mma.append(("acq", ("o", i), j - 1))  # the correction is done with O_i
        mma.append(("mma", "PV", i, j - 1))
        mma.append(("commit", ("o", i), j - 1))

    for i in range(Q_TILES):  # mma
        mma.append(("wait", "q", i))
        if i == 0:
            mma.append(("wait", "kv", 0))
        issue_s(i, 0, True)
    mma.append(("rel", "kv", 0))
    for j in range(1, n):
        mma.append(("wait", "kv", 2 * j - 1))
        for i in range(Q_TILES):
            issue_pv(i, j)
            if i == 0:
                mma.append(("wait", "kv", 2 * j))
            issue_s(i, j, False)
        mma.append(("rel", "kv", 2 * j - 1))
        mma.append(("rel", "kv", 2 * j))
    mma.append(("wait", "kv", 2 * n - 1))
    for i in range(Q_TILES):
        issue_pv(i, n)
    mma.append(("rel", "kv", 2 * n - 1))

    for i in range(Q_TILES):  # softmax_i: softmax_step per block, then the final statistics
        for j in range(n):
            soft[i].append(("wait", ("s", i), j))
            soft[i].append(("check", "read S", i, j))
            if j > 0:
                soft[i].extend([("acq", ("stats", i), j - 1), ("commit", ("stats", i), j - 1)])
            soft[i].append(("rel", ("s", i), j))  # P_i(j) in TMEM
        soft[i].extend([("acq", ("stats", i), n - 1), ("commit", ("stats", i), n - 1)])

    for j in range(1, n):  # correction: rescales, then the final step
        for i in range(Q_TILES):
            corr.extend([("wait", ("stats", i), j - 1), ("rel", ("stats", i), j - 1)])
            corr.append(("wait", ("o", i), j - 1))
            corr.append(("check", "rescale O", i, j))
            corr.append(("rel", ("o", i), j - 1))
    for i in range(Q_TILES):
        corr.extend([("wait", ("stats", i), n - 1), ("rel", ("stats", i), n - 1)])
        corr.append(("wait", ("o", i), n - 1))
        corr.append(("acq", "epi", i))
        corr.append(("check", "O to smem", i, n))
        corr.append(("rel", ("o", i), n - 1))
        corr.append(("commit", "epi", i))

    for i in range(Q_TILES):  # epilogue
        epi.extend([("wait", "epi", i), ("rel", "epi", i)])
    return {"load": load, "mma": mma, "softmax0": soft[0], "softmax1": soft[1],
            "correction": corr, "epilogue": epi}  # fmt: skip


def _stages(key, kv: int) -> int:
    name = key[0] if isinstance(key, tuple) else key
    return kv if name == "kv" else RING[name]


class Model:
    def __init__(self, n: int, kv: int):
        self.n, self.kv = n, kv
        self.roles = _ops(n, kv)
        self.names = list(self.roles)

    def done(self, pcs, role, op) -> bool:
        """Whether ``op`` (a tuple) of ``role`` has executed at ``pcs``."""
        return op in self.roles[role][: pcs[self.names.index(role)]]

    def executed(self, pcs):
        for r, name in enumerate(self.names):
            yield from ((name, op) for op in self.roles[name][: pcs[r]])

    def has(self, pcs, kind, key, use) -> bool:
        return any(op[:3] == (kind, key, use) for _, op in self.executed(pcs))

    def enabled(self, pcs, op) -> bool:
        kind = op[0]
        if kind == "acq":
            key, use = op[1], op[2]
            stages = _stages(key, self.kv)
            return use < stages or self.has(pcs, "rel", key, use - stages)
        if kind == "wait":
            return self.has(pcs, "commit", op[1], op[2])
        return True

    def mma_before_commit(self, pcs, key, use) -> list[tuple]:
        """The MMAs issued before the commit ``(key, use)`` (complete once a waiter sees it)."""
        ops = self.roles["mma"]
        at = ops.index(("commit", key, use))
        return [op for op in ops[:at] if op[0] == "mma"]

    def check(self, pcs, name, i, j) -> None:
        mma_pc = pcs[self.names.index("mma")]
        issued = [op for op in self.roles["mma"][:mma_pc] if op[0] == "mma"]
        if name == "read S":  # softmax_i reads S_i(j): issued and committed, nothing newer
            assert ("mma", "S", i, j) in issued
            assert ("mma", "S", i, j + 1) not in issued, f"S_{i}({j + 1}) over S_{i}({j})"
        elif name == "rescale O":  # between O_i += P_i(j-1) V complete and P_i(j) V issued
            assert ("mma", "PV", i, j - 1) in self.mma_before_commit(pcs, ("o", i), j - 1)
            assert ("mma", "PV", i, j) not in issued, f"O_{i} rescaled under P V({j})"
        elif name == "O to smem":  # every S GEMM and the last P V complete
            complete = self.mma_before_commit(pcs, ("o", i), j - 1)
            for t in range(Q_TILES):
                for b in range(self.n):
                    assert ("mma", "S", t, b) in complete, f"sO_{i} over Q_{t} before S({b})"
            assert ("mma", "PV", i, j - 1) in complete

    def check_order(self) -> None:
        """Static orderings of the MMA thread's program (in-order issue): S_i(j) after
        O_i += P_i(j - 1) V, and a K/V stage released only after the GEMMs that read it."""
        ops = self.roles["mma"]
        for i in range(Q_TILES):
            for j in range(1, self.n):
                assert ops.index(("mma", "PV", i, j - 1)) < ops.index(("mma", "S", i, j))
                # S_i(j) overwrites P_i(j - 1): its acquire waited for softmax_i's release.
                acq = ops.index(("acq", ("s", i), j))
                assert acq < ops.index(("mma", "S", i, j))

    def explore(self) -> int:
        """Every reachable state, depth first; returns how many. AssertionError on a deadlock
        or a broken ordering."""
        start = tuple(0 for _ in self.names)
        seen, stack = {start}, [start]
        ends = tuple(len(self.roles[r]) for r in self.names)
        while stack:
            pcs = stack.pop()
            moved = False
            for r, name in enumerate(self.names):
                if pcs[r] == ends[r]:
                    continue
                op = self.roles[name][pcs[r]]
                if not self.enabled(pcs, op):
                    continue
                if op[0] == "check":
                    self.check(pcs, *op[1:])
                moved = True
                nxt = pcs[:r] + (pcs[r] + 1,) + pcs[r + 1 :]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
            if not moved and pcs != ends:
                stuck = {
                    name: self.roles[name][pcs[r]]
                    for r, name in enumerate(self.names)
                    if pcs[r] < ends[r]
                }
                raise AssertionError(f"deadlock at {stuck}")
        return len(seen)


@pytest.mark.parametrize("kv", sorted(set(SM100_FWD_KV_STAGES.values())))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_sm100_forward_protocol_has_no_deadlock_and_keeps_its_orderings(n: int, kv: int) -> None:
    model = Model(n, kv)
    model.check_order()
    states = model.explore()
    assert states > n  # the roles interleave


def test_the_model_finds_a_deadlock_and_a_race() -> None:
    """The checker is not vacuous: the same model with the MMA warp releasing K[0]'s stage
    only at the end deadlocks (two stages: the load warp needs it for K[1], which the MMA warp
    waits for first), and one that issues S(j) before waiting for P(j - 1) races."""
    broken = Model(2, 2)
    mma = broken.roles["mma"]
    mma.remove(("rel", "kv", 0))
    mma.append(("rel", "kv", 0))
    with pytest.raises(AssertionError, match="deadlock"):
        broken.explore()
    racy = Model(2, 2)
    mma = racy.roles["mma"]
    # Issue S_0(1) before O_0 += P_0(0) V and without waiting for P_0(0): softmax_0 may read
    # S_0(0) after S_0(1) was issued.
    s_at = mma.index(("mma", "S", 0, 1))
    mma.insert(mma.index(("acq", ("s", 0), 1)), mma.pop(s_at))
    with pytest.raises(AssertionError):
        racy.check_order()
    with pytest.raises(AssertionError):
        racy.explore()


if __name__ == "__main__":  # state counts, for the docs
    for kv in sorted(set(SM100_FWD_KV_STAGES.values())):
        for n in (1, 2, 3, 4):
            print(f"n {n} kv_stages {kv}: {Model(n, kv).explore()} states", file=sys.stderr)
