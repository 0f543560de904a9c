"""The fuzz sweep's harness (tests/test_fuzz_gpu.py) on the CPU: its calls, layouts, slicing and
checks run against stand-ins for cute_fa's functions that compute the reference (so every case
must pass), and a stand-in with a 1 % softmax-scale error must fail with the reproducer. Only
the harness is under test here; the kernels are checked by the sweep itself on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import test_fuzz_gpu as fuzz
import torch

import cute_fa
from cute_fa.reference import attention_ref


def _ref_rows(q, k, v, window, softcap, scale_error):
    """Reference (out (sq, h, dv), lse (h, sq)) of one sequence at the inputs' precision."""
    scale = q.shape[-1] ** -0.5 * (1 + scale_error)
    if k.shape[0] == 0:
        # (0 * the inputs keeps the zeros on their autograd graph, as the library's outputs are)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        out = out + 0 * (q.sum() + k.sum() + v.sum())
        return out, torch.full((q.shape[1], q.shape[0]), -torch.inf)
    o, lse = attention_ref(q[None], k[None], v[None], softmax_scale=scale, window_size=window,
                           softcap=softcap, upcast=False, reorder_ops=True)  # fmt: skip
    return o[0], lse[0]


def _stand_ins(scale_error: float = 0.0):
    def varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, seqused_q=None, seqused_k=None, page_table=None,
               window_size=(None, None), softcap=0.0, **_):  # fmt: skip
        batched = cu_seqlens_q is None
        batch = q.shape[0] if batched else len(cu_seqlens_q) - 1
        outs, lses = [], []
        for b in range(batch):
            qb = q[b] if batched else q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]]
            if page_table is not None:
                n = int(seqused_k[b])
                pages = page_table[b, : -(-n // k.shape[1])].long()
                kb, vb = (x[pages].flatten(0, 1)[:n] for x in (k, v))
            elif cu_seqlens_k is not None:
                kb, vb = (x[cu_seqlens_k[b] : cu_seqlens_k[b + 1]] for x in (k, v))
            else:
                kb, vb = k[b], v[b]
            if seqused_k is not None:
                kb, vb = kb[: int(seqused_k[b])], vb[: int(seqused_k[b])]
            nq = qb.shape[0] if seqused_q is None else int(seqused_q[b])
            o, lse = _ref_rows(qb[:nq], kb, vb, window_size, softcap, scale_error)
            o = torch.cat([o, torch.zeros(qb.shape[0] - nq, *o.shape[1:], dtype=o.dtype)])
            lse = torch.cat([lse, torch.full((lse.shape[0], qb.shape[0] - nq), -torch.inf)], 1)
            outs.append(o)
            lses.append(lse)
        if batched:
            return torch.stack(outs), torch.stack(lses)
        return torch.cat(outs), torch.cat(lses, 1)

    def dense(q, k, v, **kw):
        return varlen(q, k, v, **kw)

    return dense, varlen


def _small(case: fuzz.Case) -> fuzz.Case:
    """The same case with short sequences (the CPU reference is slow)."""
    lens_q = tuple(min(n, 40) for n in case.lens_q)
    lens_k = tuple(min(n, 70) for n in case.lens_k)
    used_q = (
        None
        if case.used_q is None
        else tuple(min(a, b) for a, b in zip(case.used_q, lens_q, strict=True))
    )
    used_k = (
        None
        if case.used_k is None
        else tuple(min(a, b) for a, b in zip(case.used_k, lens_k, strict=True))
    )
    return dataclasses.replace(case, lens_q=lens_q, lens_k=lens_k, used_q=used_q, used_k=used_k)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(fuzz, "DEVICE", "cpu")

    def use(scale_error=0.0):
        dense, varlen = _stand_ins(scale_error)
        monkeypatch.setattr(cute_fa, "flash_attn_func", dense)
        monkeypatch.setattr(cute_fa, "flash_attn_varlen_func", varlen)

    return use


# One case of every layout and the backward, from the default seed's list.
def _picked() -> list[fuzz.Case]:
    picked, seen = [], set()
    for case in fuzz.ALL_CASES:
        f = case.family
        key = (f.layout, f.backward, f.seqused_q, f.seqused_k, f.mask)
        if key not in seen:
            seen.add(key)
            picked.append(_small(case))
    return picked[:24]


@pytest.mark.parametrize("case", _picked(), ids=lambda c: f"case{c.index:04d}")
def test_the_harness_passes_the_reference(on_cpu, case):
    on_cpu()
    fuzz._run_case(case)


def test_the_harness_fails_a_scale_error_with_a_reproducer(on_cpu):
    on_cpu(scale_error=0.01)
    case = next(
        c for c in map(_small, fuzz.ALL_CASES)
        if all(n > 8 for n in c.lens_k) and all(n > 4 for n in c.lens_q)
        and c.used_q is None and c.used_k is None and c.family.layout == "dense"
    )  # fmt: skip
    with pytest.raises(AssertionError, match="CUTE_FA_FUZZ_SEED="):
        fuzz.test_fuzz(case)


def test_every_option_is_drawn():
    """Over a few seeds' families every layout, page size, head-dim pair, mask and switch
    appears."""
    import random

    families = [fuzz._family(random.Random(s)) for s in range(400)]
    assert {f.layout for f in families} == {"dense", "varlen", "paged"}
    assert {f.page_size for f in families} == {0, *fuzz.PAGE_SIZES}
    assert {(f.d, f.dv) for f in families} == set(fuzz.DIMS)
    assert {f.mask for f in families} == {"none", "causal", "window"}
    assert {f.pack_gqa for f in families} == {None, True, False}
    for name in ("softcap", "seqused_q", "seqused_k", "split", "backward", "deterministic"):
        assert {getattr(f, name) for f in families} == {False, True}, name
