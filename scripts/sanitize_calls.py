"""One small forward + backward call per kernel variant and feature path, for compute-sanitizer.

``scripts/sanitize`` runs this file once without a sanitizer (compiles every kernel into the
cache directory it sets) and then once under each of ``compute-sanitizer --tool memcheck``,
``racecheck`` and ``synccheck``; ``--report LOG...`` reads those logs back and prints the table.

    python scripts/sanitize_calls.py --list
    python scripts/sanitize_calls.py [--only NAME[,NAME...]] [--after NAME]   # run the calls
    compute-sanitizer --tool synccheck python scripts/sanitize_calls.py --only sm90-seqused_k
    python scripts/sanitize_calls.py --report memcheck.log racecheck.log synccheck.log

Each call is named ``sm{80,90}-<path>``: the forward runs on that kernel family
(``CUTE_FA_FWD_ARCH``) and so does the backward's main kernel (``CUTE_FA_BWD_ARCH``). Around each
call it prints ``@@ BEGIN name`` and ``@@ END name <status>`` after a device synchronize, so the
sanitizer's reports (printed when a kernel completes) fall between the two and ``--report`` can
attribute them. A name may match several calls (``--only seqused_k``: both families). When a
call leaves the CUDA context broken (a sanitizer stops a kernel after a report), it prints
``@@ STICKY name`` and exits with status 3; ``scripts/sanitize`` then goes on with
``--after name`` in a new process, appending to the same log.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import traceback
from collections.abc import Callable

ARCHS = (90, 80)
B, H, D = 2, 4, 64  # batch, heads, head dim of the small calls
SEQ_Q, SEQ_K = 113, 203  # not multiples of any tile: every tail path runs


def _randn(*shape, torch):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)


def _dense(torch, d=D, h=H, h_kv=None, dv=None, **kwargs):
    import cute_fa

    q = _randn(B, SEQ_Q, h, d, torch=torch)
    k = _randn(B, SEQ_K, h_kv or h, d, torch=torch)
    v = _randn(B, SEQ_K, h_kv or h, dv or d, torch=torch)
    out = cute_fa.flash_attn_func(q, k, v, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn_like(out))
    return [out, q.grad, k.grad, v.grad]


def _varlen(torch, cu_q, cu_k, seqused_q=None, seqused_k=None, h=H, h_kv=None, d=D, **kwargs):
    """Packed sequences (cu_seqlens); rows past seqused are NaN (not inputs: the kernels must
    not read them into any result)."""
    import cute_fa

    def cu(x):
        return torch.tensor(x, device="cuda", dtype=torch.int32)

    def packed(total, heads, cu_list, used):
        x = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16)
        if used is not None:
            for b, n in enumerate(used):
                x[cu_list[b] + n : cu_list[b + 1]] = float("nan")
        return x.requires_grad_()

    q = packed(cu_q[-1], h, cu_q, seqused_q)
    k = packed(cu_k[-1], h_kv or h, cu_k, seqused_k)
    v = packed(cu_k[-1], h_kv or h, cu_k, seqused_k)
    lens_q = [b - a for a, b in itertools.pairwise(cu_q)]
    lens_k = [b - a for a, b in itertools.pairwise(cu_k)]
    out = cute_fa.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu(cu_q), cu_seqlens_k=cu(cu_k), max_seqlen_q=max(lens_q),
        max_seqlen_k=max(lens_k), seqused_q=None if seqused_q is None else cu(seqused_q),
        seqused_k=None if seqused_k is None else cu(seqused_k), **kwargs,
    )  # fmt: skip
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn_like(out)
    if seqused_q is not None:  # rows past seqused_q: no output, no gradient flows in
        for b, n in enumerate(seqused_q):
            dout[cu_q[b] + n : cu_q[b + 1]] = 0
    out.backward(dout)
    return []  # rows past seqused hold no defined values: no finiteness check


def _seqused_q(torch):
    return _varlen(torch, [0, 100, 200, 713], [0, 100, 200, 713], seqused_q=[60, 0, 400])


def _seqused_k(torch):
    """The calls of the seqused_k synccheck report (d 64, GQA 8 / 2 heads): an empty sequence,
    full lengths, and a causal one with an empty sequence in the middle."""
    gqa = {"h": 8, "h_kv": 2}
    _varlen(torch, [0, 100, 200], [0, 100, 200], seqused_k=[0, 100], **gqa)
    _varlen(torch, [0, 100, 200, 713], [0, 100, 200, 713], seqused_k=[100, 100, 513], **gqa)
    return _varlen(torch, [0, 100, 200, 713], [0, 100, 300, 711], seqused_k=[37, 0, 300],
                   causal=True, **gqa)  # fmt: skip


def _paged(torch, page_size):
    """Forward only (paged K/V has no backward): 3 sequences over a shuffled pool of pages with
    unused pages, partial last pages (NaN past seqused_k, never read into a result), an empty
    cache, decode and prefill rows; then packed GQA with split-KV on top."""
    import cute_fa

    lens_k = [300, 0, 203]
    counts = [-(-n // page_size) for n in lens_k]
    total = sum(counts) + 2
    k = torch.full((total, page_size, 2, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    v = torch.full_like(k, float("nan"))
    order = torch.randperm(total, device="cuda")
    table = torch.full((3, max(counts)), -1, dtype=torch.int32, device="cuda")
    slot = 0
    for b, n in enumerate(lens_k):
        for j in range(counts[b]):
            page, rows = int(order[slot]), min(page_size, n - j * page_size)
            slot += 1
            table[b, j] = page
            k[page, :rows] = torch.randn(rows, 2, D, device="cuda", dtype=torch.bfloat16)
            v[page, :rows] = torch.randn(rows, 2, D, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 1, 8, 121], device="cuda", dtype=torch.int32)
    q = torch.randn(121, 8, D, device="cuda", dtype=torch.bfloat16)
    used = torch.tensor(lens_k, device="cuda", dtype=torch.int32)
    outs = []
    with torch.no_grad():
        for kw in ({}, {"pack_gqa": True, "num_splits": 3}):
            out = cute_fa.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=113, seqused_k=used, page_table=table,
                causal=True, **kw,
            )  # fmt: skip
            outs.append(out[0] if isinstance(out, tuple) else out)
    return outs  # every row finite (the empty cache: 0)


def _persistent(torch):
    import cute_fa

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with cute_fa.tuning(sm90_fwd={"num_ctas": sms}):
        return _dense(torch)


# path -> (call, archs). Every call: d 64 bf16 unless its name says otherwise.
PATHS: dict[str, tuple[Callable, tuple[int, ...]]] = {
    "dense": (lambda t: _dense(t), ARCHS),
    "causal": (lambda t: _dense(t, causal=True), ARCHS),
    "local": (lambda t: _dense(t, window_size=(48, 16)), ARCHS),
    "softcap": (lambda t: _dense(t, softcap=15.0), ARCHS),
    "gqa": (lambda t: _dense(t, h=8, h_kv=2, causal=True), ARCHS),
    "deterministic": (lambda t: _dense(t, causal=True, deterministic=True), ARCHS),
    "d128": (lambda t: _dense(t, d=128), ARCHS),
    "d256": (lambda t: _dense(t, d=256, causal=True), (90,)),  # sm90 backward: split d
    "d128x64": (lambda t: _dense(t, d=128, dv=64, causal=True), (90,)),  # a narrower V / O
    "persistent": (_persistent, (90,)),  # the sm90 forward's persistent grid
    "varlen": (lambda t: _varlen(t, [0, 100, 200, 713], [0, 90, 300, 711], causal=True), ARCHS),
    "seqused_q": (lambda t: _seqused_q(t), ARCHS),
    "seqused_k": (lambda t: _seqused_k(t), ARCHS),
    # sm90 forward only: packed GQA (4 query heads a K/V head in one tile's rows), split-KV
    # with the combine kernel, and both over packed sequences with seqused_k.
    "pack_gqa": (lambda t: _dense(t, h=8, h_kv=2, causal=True, pack_gqa=True), (90,)),
    "split": (lambda t: _dense(t, h=8, h_kv=2, pack_gqa=False, num_splits=3), (90, 80)),
    "pack_split_varlen": (
        lambda t: _varlen(
            t,
            [0, 1, 5, 12],
            [0, 300, 301, 1000],
            seqused_k=[257, 0, 640],
            h=8,
            h_kv=2,
            causal=True,
            pack_gqa=True,
            num_splits=3,
        ),
        (90,),
    ),
    "paged16": (lambda t: _paged(t, 16), (90,)),  # forward only: no backward of paged K/V
    "paged128": (lambda t: _paged(t, 128), (90,)),
}


def calls() -> dict[str, tuple[int, Callable]]:
    return {f"sm{arch}-{path}": (arch, fn) for path, (fn, archs) in PATHS.items() for arch in archs}


def selected(only: str | None, after: str | None = None) -> list[str]:
    names = list(calls())
    if after:
        if after not in names:
            sys.exit(f"--after {after}: no such call (--list shows them)")
        names = names[names.index(after) + 1 :]
    if not only:
        return names
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    picked = [n for n in names if any(w == n or w == n.split("-", 1)[1] or w in n for w in wanted)]
    if not picked:
        sys.exit(f"--only {only}: no call matches (--list shows them)")
    return picked


def run(names: list[str]) -> int:
    import torch

    table = calls()
    failed = 0
    for name in names:
        arch, fn = table[name]
        os.environ["CUTE_FA_FWD_ARCH"] = os.environ["CUTE_FA_BWD_ARCH"] = str(arch)
        print(f"@@ BEGIN {name}", flush=True)
        status = "ok"
        try:
            torch.manual_seed(0)
            results = fn(torch)
            torch.cuda.synchronize()
            if any(not torch.isfinite(r).all() for r in results):
                status = "nonfinite"
        except Exception as e:  # noqa: BLE001 - reported in the table, the next call runs
            traceback.print_exc()
            status = f"exception:{type(e).__name__}"
        failed += status != "ok"
        print(f"@@ END {name} {status}", flush=True)
        if status != "ok" and not _context_alive(torch):
            # A sanitizer that stops a kernel (or a fault) leaves the CUDA context unusable:
            # every later call in this process would fail. scripts/sanitize starts a new
            # process with --after this call.
            print(f"@@ STICKY {name}", flush=True)
            return STICKY
    return 1 if failed else 0


STICKY = 3  # exit status: the CUDA context broke after a call; go on in a new process


def _context_alive(torch) -> bool:
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return False


# Sanitizer lines that are not reports of a kernel (banner, summaries, host-side notes).
_NOT_A_REPORT = re.compile(
    r"COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Target application"
    r"|Saved host backtrace|^\s|^$"
)


def report(logs: list[str]) -> int:
    """Per call and tool: 'ok', the number of sanitizer reports, or the call's own failure."""
    tools, cells, names = [], {}, []
    bad = 0
    for path in logs:
        tool = os.path.basename(path).split(".")[0]
        tools.append(tool)
        current, counts, status = None, {}, {}
        stray = 0
        with open(path, errors="replace") as f:
            for line in f:
                m = re.match(r"@@ (BEGIN|END) (\S+)(?: (\S+))?", line)
                if m:
                    current = m.group(2) if m.group(1) == "BEGIN" else None
                    if m.group(1) == "BEGIN":
                        counts.setdefault(m.group(2), 0)
                        if m.group(2) not in names:
                            names.append(m.group(2))
                    else:
                        status[m.group(2)] = m.group(3)
                    continue
                if line.startswith("========= "):
                    body = line[len("========= ") :]
                    if not _NOT_A_REPORT.search(body):
                        if current:
                            counts[current] = counts.get(current, 0) + 1
                        else:
                            stray += 1
        for name, n in counts.items():
            s = status.get(name, "crashed")
            cell = "ok" if s == "ok" else s
            if n:
                cell = f"{n} reports" + ("" if s == "ok" else f", {s}")
            cells[name, tool] = cell
            bad += cell != "ok"
        if stray:
            cells["(outside calls)", tool] = f"{stray} reports"
            if "(outside calls)" not in names:
                names.append("(outside calls)")
            bad += 1
    width = max([len(n) for n in names] + [4])
    print(f"{'call':<{width}}  " + "  ".join(f"{t:<14}" for t in tools))
    for name in names:
        row = "  ".join(f"{cells.get((name, t), 'not run'):<14}" for t in tools)
        print(f"{name:<{width}}  {row}")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated call names, paths or substrings")
    parser.add_argument("--after", metavar="NAME", help="only the calls after this one")
    parser.add_argument("--list", action="store_true", help="print the call names")
    parser.add_argument("--report", nargs="+", metavar="LOG", help="table of sanitizer logs")
    args = parser.parse_args()
    if args.list:
        print("\n".join(selected(args.only, args.after)))
        return 0
    if args.report:
        return report(args.report)
    return run(selected(args.only, args.after))


if __name__ == "__main__":
    sys.exit(main())
