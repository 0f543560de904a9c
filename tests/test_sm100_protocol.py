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

The CTA pair (``Sm100FwdTuning.cta_pair``, the class docstring's "CTA pair"): every role but the
MMA runs once per CTA; a barrier's phase completes when all of its signallers have signalled
(both CTAs' loads for the even CTA's full barriers, both CTAs' softmax / correction threads for
its S / O empty barriers; the MMA's commits reach both CTAs); the correction warps end with the
TMEM handshake; and nothing may arrive on the barriers of a CTA whose roles have all ended.
"""

from __future__ import annotations

import sys

import pytest
from cute_fa.blackwell.support import SM100_FWD_KV_STAGES

Q_TILES = 2
# (pipeline) -> stages of its ring; per-slot pipelines are keyed (name, slot).
RING = {"s": 1, "o": 1, "stats": 1}  # q, epi: a stage per Q tile (``_stages``)


def _kv_load(u: int) -> list[tuple]:
    """load_kv: wait for the stage, TMA (lands as the commit)."""
    return [("acq", "kv", u), ("commit", "kv", u)]


def _ops(n: int, kv: int, ctas: int = 1, q_tiles: int = Q_TILES) -> dict[str, list[tuple]]:
    """Each role's operations for ``n`` key blocks (n >= 1): ("acq" | "commit" | "wait" |
    "rel", pipeline key, use) or ("mma", name, tile, block) / ("check", name, tile, block).
    ``ctas`` 2: the CTA pair (the class docstring's "CTA pair"): every role but the MMA once per
    CTA (named ``role.c``), one MMA thread (the even CTA's) for both; the statistics and
    epilogue pipelines are per CTA (keys with the CTA), the others the pair's. ``q_tiles`` 1:
    one Q tile a CTA (tile_m 128: d 256, (192, 192)), every "for each Q tile" once."""
    roles: dict[str, list[tuple]] = {}
    mma: list[tuple] = []

    def role(name: str, c: int) -> str:
        return name if ctas == 1 else f"{name}.{c}"

    for c in range(ctas):  # load: Q0, K[0], Q1, V[0], K[1], V[1], ...
        load: list[tuple] = []
        for i in range(q_tiles):
            load.extend([("acq", "q", i), ("commit", "q", i)])
            if i == 0:
                load.extend(_kv_load(0))
        for j in range(n - 1):
            load.extend(_kv_load(2 * j + 1) + _kv_load(2 * j + 2))
        load.extend(_kv_load(2 * n - 1))
        if ctas == 2:  # the tail: every stage's last use released before the CTA leaves
            load.extend(("acq", "kv", 2 * n + s) for s in range(kv))
        roles[role("load", c)] = load

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

    for i in range(q_tiles):  # mma
        mma.append(("wait", "q", i))
        if i == 0:
            mma.append(("wait", "kv", 0))
        issue_s(i, 0, True)
    mma.append(("rel", "kv", 0))
    for j in range(1, n):
        mma.append(("wait", "kv", 2 * j - 1))
        for i in range(q_tiles):
            issue_pv(i, j)
            if i == 0:
                mma.append(("wait", "kv", 2 * j))
            issue_s(i, j, False)
        mma.append(("rel", "kv", 2 * j - 1))
        mma.append(("rel", "kv", 2 * j))
    mma.append(("wait", "kv", 2 * n - 1))
    for i in range(q_tiles):
        issue_pv(i, n)
    mma.append(("rel", "kv", 2 * n - 1))
    roles["mma"] = mma

    for c in range(ctas):
        for i in range(q_tiles):  # softmax_i: softmax_step per block, then the final statistics
            soft: list[tuple] = []
            for j in range(n):
                soft.append(("wait", ("s", i), j))
                soft.append(("check", "read S", i, j))
                if j > 0:
                    soft.extend([("acq", ("stats", c, i), j - 1),
                                 ("commit", ("stats", c, i), j - 1)])  # fmt: skip
                soft.append(("rel", ("s", i), j))  # P_i(j) in TMEM
            soft.extend([("acq", ("stats", c, i), n - 1), ("commit", ("stats", c, i), n - 1)])
            roles[role(f"softmax{i}", c)] = soft

        corr: list[tuple] = []
        for j in range(1, n):  # correction: rescales, then the final step
            for i in range(q_tiles):
                corr.extend([("wait", ("stats", c, i), j - 1), ("rel", ("stats", c, i), j - 1)])
                corr.append(("wait", ("o", i), j - 1))
                corr.append(("check", "rescale O", i, j))
                corr.append(("rel", ("o", i), j - 1))
        for i in range(q_tiles):
            corr.extend([("wait", ("stats", c, i), n - 1), ("rel", ("stats", c, i), n - 1)])
            corr.append(("wait", ("o", i), n - 1))
            corr.append(("acq", ("epi", c), i))
            corr.append(("check", "O to smem", i, n))
            if ctas == 1:  # the pair leaves out this release (no MMA waits for it)
                corr.append(("rel", ("o", i), n - 1))
            corr.append(("commit", ("epi", c), i))
        if ctas == 2:  # TMEM release: arrive on the other CTA's barrier, wait on its own
            corr.extend([("commit", ("dealloc", 1 - c), 0), ("wait", ("dealloc", c), 0)])
        roles[role("correction", c)] = corr

        if ctas == 1:  # epilogue
            epi = ("epi", 0)
            roles["epilogue"] = [op for i in range(q_tiles)
                                 for op in (("wait", epi, i), ("rel", epi, i))]  # fmt: skip
        # (The pair's model leaves the epilogue warps out: the correction's two acquires of
        # the two-stage epilogue ring never wait, and a CTA without them leaves earlier, which
        # only makes the check that nothing arrives on a CTA that has left stricter.)
    return roles


def _stages(key, kv: int, q_tiles: int = Q_TILES) -> int:
    name = key[0] if isinstance(key, tuple) else key
    if name in ("q", "epi"):  # a stage per Q tile
        return q_tiles
    return kv if name == "kv" else RING[name]


class Model:
    def __init__(self, n: int, kv: int, ctas: int = 1, q_tiles: int = Q_TILES):
        self.n, self.kv, self.ctas, self.q_tiles = n, kv, ctas, q_tiles
        self.roles = _ops(n, kv, ctas, q_tiles)
        self.names = list(self.roles)
        self.cta_roles = {c: [r for r, name in enumerate(self.names) if self.cta_of(name) == c]
                          for c in range(ctas)}  # fmt: skip

    def index(self) -> None:
        """(kind, key, use) -> [(role index, op index)] of its commits / releases (made when
        the exploration starts: tests edit the roles first)."""
        self.by_op: dict[tuple, list[tuple[int, int]]] = {}
        for r, ops in enumerate(self.roles.values()):
            for at, op in enumerate(ops):
                if op[0] in ("commit", "rel"):
                    self.by_op.setdefault(op[:3], []).append((r, at))

    def cta_of(self, role: str) -> int:
        return 0 if self.ctas == 1 or role == "mma" else int(role.rsplit(".", 1)[1])

    def signalled(self, pcs, kind: str, key, use: int) -> bool:
        """Whether every ``kind`` op (commit / rel) of ``(key, use)`` has executed: a
        barrier's phase completes when all of them have (the pair's full barrier of a K/V
        stage takes both CTAs' loads, the even CTA's S / O empty barrier both CTAs'
        releases)."""
        found = self.by_op.get((kind, key, use))
        return bool(found) and all(pcs[r] > at for r, at in found)

    def enabled(self, pcs, op) -> bool:
        kind = op[0]
        if kind == "acq":
            key, use = op[1], op[2]
            stages = _stages(key, self.kv, self.q_tiles)
            return use < stages or self.signalled(pcs, "rel", key, use - stages)
        if kind == "wait":
            return self.signalled(pcs, "commit", op[1], op[2])
        return True

    def targets(self, role: str, op) -> set[int]:
        """The CTAs whose barriers ``op`` arrives on (the class docstring's pair protocol)."""
        if op[0] not in ("commit", "rel"):
            return set()
        key = op[1]
        name = key[0] if isinstance(key, tuple) else key
        everyone = set(range(self.ctas))
        if name in ("q", "kv"):  # TMA bytes: the even CTA's full barrier; release: multicast
            return {0} if op[0] == "commit" else everyone
        if name in ("s", "o"):  # commit: multicast; release: the even CTA's empty barrier
            return everyone if op[0] == "commit" else {0}
        if name == "dealloc":
            return {key[1]}
        return {self.cta_of(role)}  # statistics, epilogue: within the CTA

    def exited(self, pcs, cta: int) -> bool:
        """Whether every role of ``cta`` has run to its end (the CTA may have left)."""
        return all(pcs[r] == len(self.roles[self.names[r]]) for r in self.cta_roles[cta])

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
            for t in range(self.q_tiles):
                for b in range(self.n):
                    assert ("mma", "S", t, b) in complete, f"sO_{i} over Q_{t} before S({b})"
            assert ("mma", "PV", i, j - 1) in complete

    def check_order(self) -> None:
        """Static orderings of the MMA thread's program (in-order issue): S_i(j) after
        O_i += P_i(j - 1) V, and a K/V stage released only after the GEMMs that read it."""
        ops = self.roles["mma"]
        for i in range(self.q_tiles):
            for j in range(1, self.n):
                assert ops.index(("mma", "PV", i, j - 1)) < ops.index(("mma", "S", i, j))
                # S_i(j) overwrites P_i(j - 1): its acquire waited for softmax_i's release.
                acq = ops.index(("acq", ("s", i), j))
                assert acq < ops.index(("mma", "S", i, j))

    def explore(self) -> int:
        """Every reachable state, depth first; returns how many. AssertionError on a deadlock
        or a broken ordering."""
        self.index()
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
                for cta in self.targets(name, op):  # nothing arrives on a CTA that has left
                    assert not self.exited(pcs, cta), f"{name}: {op} after CTA {cta} left"
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


@pytest.mark.parametrize("kv", [2, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sm100_forward_one_q_tile_protocol(n: int, kv: int) -> None:
    """One Q tile a CTA (d 256: 2 K/V stages, (192, 192): 3): the same roles with one slot of
    every per-tile pipeline and one-stage Q and epilogue rings."""
    model = Model(n, kv, q_tiles=1)
    assert not any(op[2] == 1 for op in model.roles["epilogue"])  # tile 0 only
    model.check_order()
    assert model.explore() > n


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


def _pair_model_checks(n: int, kv: int) -> int:
    model = Model(n, kv, ctas=2)
    model.check_order()
    return model.explore()


def test_sm100_forward_pair_protocol() -> None:
    """The CTA pair (one MMA thread for two CTAs; both CTAs' loads complete the even CTA's full
    barriers, both CTAs' softmax / correction threads release its S / O empty barriers, the
    MMA's commits reach both CTAs): no deadlock, the orderings above, and nothing arrives on
    the barriers of a CTA whose roles have all ended. One key block with two K/V stages (the
    state space of eleven roles grows fast: more under the exhaustive marker)."""
    assert _pair_model_checks(1, 2) > 1000


@pytest.mark.exhaustive
@pytest.mark.parametrize("n, kv", [(2, 2), (1, 5), (2, 5)])
def test_sm100_forward_pair_protocol_more_blocks(n: int, kv: int) -> None:
    assert _pair_model_checks(n, kv) > 1000


def test_the_pair_model_catches_a_release_to_a_gone_cta() -> None:
    """Without the load warp's tail, the odd CTA may leave while the MMA's last K/V release
    (a commit multicast to both CTAs) is still to come: the model says so."""
    model = Model(1, 2, ctas=2)
    load = model.roles["load.1"]
    assert load[-2:] == [("acq", "kv", 2), ("acq", "kv", 3)]
    del load[-2:]
    with pytest.raises(AssertionError, match="after CTA 1 left"):
        model.explore()


if __name__ == "__main__":  # state counts, for the docs
    for kv in sorted(set(SM100_FWD_KV_STAGES.values())):
        for n in (1, 2, 3, 4):
            print(f"n {n} kv_stages {kv}: {Model(n, kv).explore()} states", file=sys.stderr)
