"""Forward correctness on a GPU against the fp32 reference (marker ``gpu``; skipped without CUDA).

Tolerance (as FA4 checks it): ``out_ref`` is ``attention_ref`` in fp32, ``out_pt`` the same
math in the input dtype; a result passes when ``max|out - out_ref| <= 2 * max|out_pt -
out_ref| + atol`` (``cute_fa.reference.check_close``), atol 2-4 ulps of the input dtype at the
largest magnitude of this ``out_ref`` (Note [check_close's atol]; tests/test_tolerance.py shows
what it catches: in bf16 a 1 % softmax-scale error hides in the baseline's own error, in fp16 it
does not). LSE the same way with ``LSE_ATOL`` on rows that see a key;
rows that see no key must be exactly ``out = 0`` and ``lse = -inf`` (checked against an
independent count of visible keys, not only against the reference). No NaN may appear anywhere.

Unwritten output: the API allocates ``out`` and ``lse`` itself, so before each launch every free
block of torch's CUDA caching allocator is filled with 0xFF bytes (NaN in bf16, fp16 and fp32;
see ``poison_free_memory`` for how and for its limits). An element the kernel forgets to write
then reads as NaN. ``test_poison_reaches_output`` checks that the output really lands in
poisoned memory, so a change in the allocator cannot silently switch this guard off.

Inputs are fresh random tensors every run. Each test prints its seed (pytest shows it on
failure); ``CUTE_FA_TEST_SEED=<seed>`` replays a run.

Kernel families: on an sm90 GPU dispatch picks the sm90 forward for what it implements and the
sm80 forward for the rest; run the module a second time with ``CUTE_FA_FWD_ARCH=80`` to cover
the sm80 kernel on every case (``CUTE_FA_FWD_ARCH=90`` with ``-k`` restricts it to the sm90 one).
The sm90 tuning cases (``run_sm90_case``: a field of ``Sm90FwdTuning`` set with
``cute_fa.tuning(sm90_fwd=...)``) skip under ``CUTE_FA_FWD_ARCH=80`` and off sm90; each checks
that the compile key of the kernel its call launched holds the fields it asked for.

Compile configs this module touches (a new one costs a compile of a few seconds; the rest of
the cases reuse compiled kernels, since sequence lengths, batch and head counts are dynamic):
bf16 batched: d in {64, 96, 128, 192, 256} x {no mask, causal, local} x softcap {off, on} = 30;
bf16 varlen (cu_seqlens q and k): d in {64, 128} x {no mask, causal, local} = 6, plus softcap 1,
seqused_k 2, seqused_q 1; bf16 varlen d in {96, 192, 256} x {no mask, causal, local} = 9;
bf16 d 192 x dv 128: {no mask, causal, local} x softcap {off, on} = 6; fp16: d in {64, 128} x
{no mask, causal} = 4. About 59 requests (on sm90 the query length picks among a few keys of
one request: 128 or 192 rows, the persistent grid). The sm90 tuning cases add 57 keys, 43 of
which no call plans by default (tests/test_dispatch.py plans every case on the CPU).

Compiling them one after another is most of a cold run. To compile them in parallel first
(into a cache directory the tests then read; --target defaults to this machine's GPU, and the
kernels are those dispatch picks there, with this GPU's tuned table, the backward's included;
CUTE_FA_FWD_ARCH=80 runs need ``--arch sm80``); precompile knows no overrides, so the tuning
cases compile their own keys as they run:

    export CUTE_FA_CACHE_DIR=/tmp/cute-fa-cache
    python -m cute_fa precompile --jobs 16 --dtypes bf16 \
        --variants plain,causal,local,softcap,causal+softcap,local+softcap
    python -m cute_fa precompile --jobs 16 --dtypes bf16 --head-dims 64,128 --variants \
        varlen,varlen+causal,varlen+local,varlen+causal+softcap,varlen+seqused_k,varlen+causal+seqused_k,varlen+seqused_q
    python -m cute_fa precompile --jobs 16 --dtypes fp16 --head-dims 64,128
    python -m pytest -m gpu -q
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from gpu_support import (  # noqa: F401
    cu_seqlens,
    empty_rows,
    fwd_plan_configs,
    needs_sm90_forward,
    poison_free_memory,
    seed,
)

import cute_fa
from cute_fa import settings
from cute_fa.reference import attention_ref, check_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEAD_DIMS = (64, 96, 128, 192, 256)
NHEADS = 6
# Absolute slack on LSE (fp32, natural log): the kernel's exp2/log2 approximations and the
# folded scale move it by a few fp32 ulps of values up to ~20; the 2x-baseline term dominates
# everywhere except where the baseline happens to be exact (e.g. a single key).
LSE_ATOL = 1e-4

# (causal, window_size), named for the test ids.
MASKS = [
    pytest.param(False, (None, None), id="full"),
    pytest.param(True, (None, None), id="causal"),
    pytest.param(False, (64, 0), id="win64_0"),
    pytest.param(False, (32, 32), id="win32_32"),
    pytest.param(False, (-16, 48), id="band-16_48"),
    pytest.param(False, (None, 0), id="winNone_0"),
    pytest.param(False, (100, None), id="win100_None"),
]

SEQLENS = [
    (1, 1),
    (17, 17),
    (113, 203),
    (203, 113),
    (127, 127),
    (128, 128),
    (129, 129),
    (1000, 1000),
    (1000, 17),
    (17, 1000),
    (1, 4224),
    (4224, 4224),
]


# ------------------------------------------------------------------------------------------
# Fixtures and helpers


def _bytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _reserve_for(out_shape, dtype, lse_shape) -> int:
    return 2 * (_bytes(out_shape, dtype) + _bytes(lse_shape, torch.float32)) + (16 << 20)


def check_against_ref(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window=(None, None),
    softcap: float = 0.0,
    softmax_scale: float | None = None,
) -> None:
    """Compare (out, lse) of one batched call with attention_ref; q/k/v are (b, s, h, d)."""
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    assert out.shape == (b, sq, h, v.shape[-1]), out.shape
    assert lse.shape == (b, h, sq), lse.shape
    assert lse.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in out (an element the kernel did not write?)"
    assert not torch.isnan(lse).any(), "NaN in lse (an element the kernel did not write?)"
    if sq == 0:
        return
    dead = empty_rows(sq, sk, causal, window).to(out.device)
    if dead.any():
        assert (out[:, dead] == 0).all(), "rows that see no key must be exactly 0"
        assert torch.isneginf(lse[:, :, dead]).all(), "rows that see no key must have lse = -inf"
    if sk == 0:
        return
    if h_kv != h:
        k = k.repeat_interleave(h // h_kv, dim=2)
        v = v.repeat_interleave(h // h_kv, dim=2)
    kwargs = dict(softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap)
    out_ref, lse_ref = attention_ref(q, k, v, upcast=True, **kwargs)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kwargs)
    check_close(out, out_ref, out_pt, name="out")
    # check_close also requires the -inf of rows that see no key to match exactly.
    check_close(lse, lse_ref, lse_pt, atol=LSE_ATOL, name="lse")


def _qkv(b, sq, sk, h, h_kv, d, dtype, softcap=0.0):
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    if softcap:
        # Spread the scores so that tanh capping actually bends them (as FA4's tests do).
        q = (q.float() * (softcap / 4)).to(dtype)
    k = torch.randn(b, sk, h_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, h_kv, d, device="cuda", dtype=dtype)
    return q, k, v


def run_and_check(
    b, sq, sk, h, h_kv, d, *, dtype=torch.bfloat16, causal=False, window=(None, None), softcap=0.0
):
    q, k, v = _qkv(b, sq, sk, h, h_kv, d, dtype, softcap)
    poison_free_memory(_reserve_for((b, sq, h, d), dtype, (b, h, sq)))
    out, lse = cute_fa.flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True
    )
    check_against_ref(out, lse, q, k, v, causal=causal, window=window, softcap=softcap)
    return q, k, v, out, lse


# ------------------------------------------------------------------------------------------
# Batched sweep


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("h_kv", [6, 2, 1], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("softcap", [0.0, 15.0], ids=["nocap", "cap15"])
@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_fwd(d, causal, window, softcap, h_kv, seqlen_q, seqlen_k):
    batch = 2 if max(seqlen_q, seqlen_k) <= 1000 else 1
    run_and_check(
        batch, seqlen_q, seqlen_k, NHEADS, h_kv, d, causal=causal, window=window, softcap=softcap
    )


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", [(113, 203), (1000, 1000)], ids=["113x203", "1000x1000"]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_fwd_fp16(d, causal, seqlen_q, seqlen_k):
    run_and_check(2, seqlen_q, seqlen_k, NHEADS, 2, d, dtype=torch.float16, causal=causal)


# Query lengths around multiples of 64, 128 and 192: the rows of one consumer warpgroup and of
# a CTA of two or three of them (the sm90 forward runs d64 non-causal with 192 rows).
TILE_EDGE_SEQLENS = [(191, 191), (192, 192), (193, 193), (320, 257), (385, 385), (577, 130)]


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", TILE_EDGE_SEQLENS, ids=[f"{a}x{b}" for a, b in TILE_EDGE_SEQLENS]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_fwd_query_tile_edges(d, causal, seqlen_q, seqlen_k):
    run_and_check(2, seqlen_q, seqlen_k, NHEADS, 2, d, causal=causal)


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k",
    [(113, 203), (203, 113), (1000, 1000), (1, 4224)],
    ids=["113x203", "203x113", "1000x1000", "1x4224"],
)
@pytest.mark.parametrize("softcap", [0.0, 15.0], ids=["nocap", "cap15"])
@pytest.mark.parametrize("causal,window", [MASKS[0], MASKS[1], MASKS[3]])
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64)], ids=["d192x128", "d128x64"])
def test_fwd_dv_pairs(d, dv, causal, window, softcap, seqlen_q, seqlen_k):
    """A value head dim below the head dim, (192, 128) (q/k 192, v 128) and (128, 64): the sm90
    forward on sm90 GPUs, the sm80 forward elsewhere and under CUTE_FA_FWD_ARCH=80."""
    b, h, h_kv = 2, NHEADS, 2
    q, k, _ = _qkv(b, seqlen_q, seqlen_k, h, h_kv, d, torch.bfloat16, softcap)
    v = torch.randn(b, seqlen_k, h_kv, dv, device="cuda", dtype=torch.bfloat16)
    poison_free_memory(_reserve_for((b, seqlen_q, h, dv), torch.bfloat16, (b, h, seqlen_q)))
    out, lse = cute_fa.flash_attn_func(
        q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True
    )
    check_against_ref(out, lse, q, k, v, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", [(0, 0), (0, 128), (128, 0), (1, 0)], ids=["0x0", "0x128", "128x0", "1x0"]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_fwd_seqlen_zero(d, causal, seqlen_q, seqlen_k):
    _, _, _, out, lse = run_and_check(2, seqlen_q, seqlen_k, NHEADS, 2, d, causal=causal)
    if seqlen_q == 0:
        assert out.numel() == 0 and lse.numel() == 0
    if seqlen_k == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal,window",
    [
        (128, 128, False, (-200, -150)),  # the band lies wholly outside the keys
        (300, 100, True, (None, None)),  # causal with sq > sk: the first 200 rows see nothing
        (129, 17, True, (None, None)),
        (200, 200, False, (-190, None)),  # only the first 10 rows see a key
        (64, 1000, False, (None, -1000)),  # right bound before key 0 for every row
    ],
    ids=["band-200_-150", "causal300x100", "causal129x17", "win-190_None", "winNone_-1000"],
)
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_fwd_fully_masked_rows(d, seqlen_q, seqlen_k, causal, window):
    assert empty_rows(seqlen_q, seqlen_k, causal, window).any()
    _, _, _, out, lse = run_and_check(
        2, seqlen_q, seqlen_k, NHEADS, 2, d, causal=causal, window=window
    )
    dead = empty_rows(seqlen_q, seqlen_k, causal, window).to(out.device)
    assert torch.equal(out[:, dead], torch.zeros_like(out[:, dead]))
    assert torch.isneginf(lse[:, :, dead]).all()
    assert torch.isfinite(lse[:, :, ~dead]).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_noncontiguous_qkv(causal):
    """q, k, v as views of one packed (b, s, 3, h, d) tensor; GQA k/v from a packed kv too."""
    b, s, h, d = 2, 257, NHEADS, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out, lse = cute_fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check_against_ref(out, lse, q, k, v, causal=causal)

    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(b, s + 31, 2, 2, d, device="cuda", dtype=torch.bfloat16)
    k, v = kv.unbind(2)
    out, lse = cute_fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check_against_ref(out, lse, q, k, v, causal=causal)


def test_fwd_softmax_scale_and_inputs_untouched():
    q, k, v = _qkv(2, 150, 230, NHEADS, 3, 128, torch.bfloat16)
    before = [t.clone() for t in (q, k, v)]
    scale = 0.37 / math.sqrt(128)
    out, lse = cute_fa.flash_attn_func(q, k, v, softmax_scale=scale, return_lse=True)
    check_against_ref(out, lse, q, k, v, softmax_scale=scale)
    for t, t0 in zip((q, k, v), before, strict=True):
        assert torch.equal(t, t0), "inputs must not be modified"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_fwd_negative_softmax_scale(d, causal):
    """softmax(scale * q k^T) for scale < 0, with scores spread so far (|scale| * spread ~ 100
    nats) that exponentials taken against the max of the unscaled scores would overflow
    (Note [softmax_scale the kernels take])."""
    q, k, v = _qkv(2, 300, 517, NHEADS, 2, d, torch.bfloat16)
    q = (q.float() * 20).to(torch.bfloat16)
    scale = -1.0 / math.sqrt(d)
    out, lse = cute_fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                       return_lse=True)  # fmt: skip
    check_against_ref(out, lse, q, k, v, softmax_scale=scale, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_zero_softmax_scale(causal):
    """softmax_scale=0: uniform weights over the visible keys, no NaN from masked -inf * 0."""
    q, k, v = _qkv(2, 300, 517, NHEADS, 2, 128, torch.bfloat16)
    out, lse = cute_fa.flash_attn_func(q, k, v, softmax_scale=0.0, causal=causal,
                                       return_lse=True)  # fmt: skip
    check_against_ref(out, lse, q, k, v, softmax_scale=0.0, causal=causal)


def test_fwd_deterministic_run_to_run():
    q, k, v = _qkv(2, 1000, 1000, NHEADS, 2, 128, torch.bfloat16)
    out1, lse1 = cute_fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    out2, lse2 = cute_fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


# ------------------------------------------------------------------------------------------
# sm90 forward tuning fields (``cute_fa.tuning(sm90_fwd=...)``, Sm90FwdTuning): each case runs
# the kernel of a non-default field against attention_ref, and checks that the compile key of
# the kernel its call launched holds the field (``fwd_plan_configs``).


def require_sm90_forward() -> None:
    """Skip unless dispatch runs the sm90 forward here (an sm90 GPU, CUTE_FA_FWD_ARCH not 80)."""
    if torch.cuda.get_device_capability()[0] != 9 or settings.forced_fwd_arch() == 80:
        pytest.skip("an sm90 forward tuning field (an sm90 GPU, CUTE_FA_FWD_ARCH unset or 90)")


# The mask arguments of the tuning cases' mask names.
SWITCH_MASKS = {"full": (False, (None, None)), "causal": (True, (None, None)),
                "win64_0": (False, (64, 0))}  # fmt: skip


def sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def assert_fields(config, fields: dict) -> None:
    """``config`` (the compile key of the kernel that ran) holds the tuning ``fields`` asked:
    ``num_ctas`` > 0 asks for the persistent grid, which planning gives one CTA an SM."""
    assert config.arch == 90, config.name
    for name, value in fields.items():
        want = (sm_count() if value else 0) if name == "num_ctas" else value
        assert getattr(config.tuning, name) == want, f"{name}={value!r} asked; ran {config.name}"


def run_sm90_case(monkeypatch, fields, d, seqlen_q, seqlen_k, mask, softcap, dtype, spread,
                  h_kv, repeat=False):  # fmt: skip
    """One forward call under ``cute_fa.tuning(sm90_fwd=fields)`` ({}: the defaults), checked
    against attention_ref; returns the compile key of the kernel the call launched, after
    checking that it holds ``fields``. Launch plans are emptied first, so that the call's own
    plan is the only one. ``spread`` multiplies q (wider scores); ``repeat``: a second call
    gives the same bytes."""
    require_sm90_forward()
    monkeypatch.setattr(cute_fa.ops, "_plans", {})
    causal, window = SWITCH_MASKS[mask]
    q, k, v = _qkv(2, seqlen_q, seqlen_k, NHEADS, h_kv, d, dtype, softcap)
    q = (q.float() * spread).to(dtype)
    poison_free_memory(_reserve_for((2, seqlen_q, NHEADS, d), dtype, (2, NHEADS, seqlen_q)))
    kw = dict(causal=causal, window_size=window, softcap=softcap, return_lse=True)
    with cute_fa.tuning(sm90_fwd=fields):
        out, lse = cute_fa.flash_attn_func(q, k, v, **kw)
        again = cute_fa.flash_attn_func(q, k, v, **kw) if repeat else None
    (config,) = fwd_plan_configs()
    assert_fields(config, fields)
    check_against_ref(out, lse, q, k, v, causal=causal, window=window, softcap=softcap)
    if again is not None:
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), "not run-to-run equal"
    return config


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(4096, 4096), (4500, 4111), (5000, 6000)])
def test_fwd_three_consumers_persistent_causal_default(monkeypatch, seqlen_q, seqlen_k):
    """d64 causal calls of 4096 to 8192 query rows: planning's built-in default is 192 rows on
    the persistent grid (hopper/support.py; the tuned table off, so that only the built-in
    defaults count); against attention_ref."""
    monkeypatch.setenv(settings.TUNED, "0")
    config = run_sm90_case(monkeypatch, {}, 64, seqlen_q, seqlen_k, "causal", 0.0,
                           torch.bfloat16, 1.0, NHEADS)  # fmt: skip
    assert config.tile_m == 192 and config.tuning.num_ctas == sm_count(), config.name


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 777), (800, 800), (777, 1000)])
def test_fwd_persistent_three_consumers_causal(monkeypatch, seqlen_q, seqlen_k):
    """d64 causal with 192 rows on the persistent grid (pairs of tiles), which below 4096 rows
    only ``tile_m=192`` with ``num_ctas`` selects: against attention_ref and bitwise equal
    across two runs."""
    run_sm90_case(monkeypatch, {"tile_m": 192, "num_ctas": 1}, 64, seqlen_q, seqlen_k,
                  "causal", 0.0, torch.bfloat16, 1.0, NHEADS, repeat=True)  # fmt: skip


# (d, dv, seqlen_q, seqlen_k): several tiles a CTA at batch 6 x 16 heads. Causal with
# seqlen_q > seqlen_k has tiles that see no key (d256: all but the last row); 800 rows are an
# odd number of query blocks (a causal pair of one tile).
PERSISTENT_CASES = [(64, 64, 1000, 777), (96, 96, 800, 800), (128, 128, 1000, 777),
                    (192, 128, 700, 300), (128, 64, 1000, 777), (256, 256, 1000, 1)]  # fmt: skip


@pytest.mark.parametrize("softcap", [0.0, 15.0], ids=["nocap", "cap15"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "d,dv,seqlen_q,seqlen_k", PERSISTENT_CASES, ids=[f"d{c[0]}x{c[1]}" for c in PERSISTENT_CASES]
)
def test_fwd_persistent_grid(monkeypatch, d, dv, seqlen_q, seqlen_k, causal, softcap):
    """``num_ctas`` > 0 (one CTA an SM looping over tiles; causal: over pairs of tiles) where
    the default is one CTA a tile for some of these calls: several work units a CTA, against
    attention_ref, bitwise equal across two runs, and the kernel that ran is persistent."""
    require_sm90_forward()
    monkeypatch.setattr(cute_fa.ops, "_plans", {})
    b, h, h_kv = 6, 16, 4
    q, k, v = _qkv(b, seqlen_q, seqlen_k, h, h_kv, d, torch.bfloat16, softcap)
    v = torch.randn(b, seqlen_k, h_kv, dv, device="cuda", dtype=torch.bfloat16)
    poison_free_memory(_reserve_for((b, seqlen_q, h, dv), torch.bfloat16, (b, h, seqlen_q)))
    kw = dict(causal=causal, softcap=softcap, return_lse=True)
    with cute_fa.tuning(sm90_fwd={"num_ctas": 1}):
        out, lse = cute_fa.flash_attn_func(q, k, v, **kw)
        out2, lse2 = cute_fa.flash_attn_func(q, k, v, **kw)
    (config,) = fwd_plan_configs()
    assert_fields(config, {"num_ctas": 1})
    m_blocks = -(-seqlen_q // config.tile_m)
    units = b * h * (-(-m_blocks // 2) if causal else m_blocks)
    assert units > 1.4 * sm_count(), f"{units} work units: too few for several a CTA"
    check_against_ref(out, lse, q, k, v, causal=causal, softcap=softcap)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


# (d, seqlen_q, seqlen_k, mask, softcap, dtype, k, score spread): ``exp2_poly=k``.
# A spread of 4 multiplies q, so that scores span ~100 units of log2 (the clamp at -126 and
# the rounding of large negative exponents are exercised); 4224 causal rows run 192 rows a CTA.
EXP2_POLY_CASES = [
    (64, 1000, 777, "full", 0.0, torch.bfloat16, 8, 1.0),
    (64, 4224, 4224, "causal", 0.0, torch.bfloat16, 8, 1.0),
    (64, 300, 1000, "causal", 0.0, torch.float16, 2, 4.0),
    (64, 1000, 1000, "full", 0.0, torch.bfloat16, 4, 4.0),
    (128, 1000, 1000, "full", 15.0, torch.bfloat16, 4, 1.0),
    (128, 513, 2049, "full", 0.0, torch.float16, 16, 1.0),
    (128, 1000, 1000, "win64_0", 0.0, torch.bfloat16, 8, 1.0),
    (256, 777, 1000, "causal", 0.0, torch.bfloat16, 4, 1.0),
]


@pytest.mark.parametrize(
    "d,seqlen_q,seqlen_k,mask,softcap,dtype,every,spread", EXP2_POLY_CASES,
    ids=[f"d{c[0]}-{c[1]}x{c[2]}-{c[3]}-poly{c[6]}-{str(c[5])[6:]}" for c in EXP2_POLY_CASES],
)  # fmt: skip
def test_fwd_exp2_poly(monkeypatch, d, seqlen_q, seqlen_k, mask, softcap, dtype, every, spread):
    """``exp2_poly=k`` (every k-th exponential of an unmasked block by a polynomial, Note [exp2
    on the FMA pipe]): against attention_ref at the usual tolerance, with the field in the
    kernel that ran."""
    config = run_sm90_case(monkeypatch, {"exp2_poly": every}, d, seqlen_q, seqlen_k, mask,
                           softcap, dtype, spread, h_kv=2)  # fmt: skip
    assert f"poly{every}" in config.name, config.name


# (d, seqlen_q, seqlen_k, mask, fields): the deferred rescale against each head dim's default
# (on at d64, off elsewhere: SM90_FWD_DEFER_RESCALE_DEFAULT), with two and three consumers.
DEFER_CASES = [(64, 1000, 777, "causal", {"defer_rescale": False}),
               (64, 1000, 1000, "full", {"defer_rescale": False, "tile_m": 192}),
               (128, 777, 1000, "full", {"defer_rescale": True}),
               (256, 1000, 1000, "causal", {"defer_rescale": True})]  # fmt: skip


@pytest.mark.parametrize("d,seqlen_q,seqlen_k,mask,fields", DEFER_CASES,
                         ids=[f"d{c[0]}-{c[1]}x{c[2]}-{c[3]}-defer{int(c[4]['defer_rescale'])}"
                              + ("-192rows" if "tile_m" in c[4] else "")
                              for c in DEFER_CASES])  # fmt: skip
def test_fwd_defer_rescale(monkeypatch, d, seqlen_q, seqlen_k, mask, fields):
    """``defer_rescale`` (the O rescale and the P conversion of a key block just before its
    P V GEMM is issued) turned from each head dim's default: against attention_ref, with the
    field in the kernel that ran."""
    run_sm90_case(monkeypatch, fields, d, seqlen_q, seqlen_k, mask, 0.0, torch.bfloat16, 4.0,
                  h_kv=2)  # fmt: skip


NO_PINGPONG = {"pingpong": False}
ROWS_192 = {"tile_m": 192}
NO_OVERLAP = {"overlap": False}
TMA_STORE = {"tma_store": True}
PERSISTENT = {"num_ctas": 1}
ONE_CTA_A_TILE = {"num_ctas": 0}
# (d, seqlen_q, seqlen_k, mask, fields): pingpong off; three consumers at d128 (64 / 80 keys);
# the intra-warpgroup overlap off; O by TMA store (17 rows: a box past the end of the tensor;
# 1000 x 300 causal: tiles that see no key store zeros; d128 1000 x 777 runs the persistent
# grid by default, so its TMA store runs there). d64 causal calls of up to 1k rows run without
# turns and without the overlap by default (on the persistent grid): their cases here ask for
# one CTA a tile, where both are on by default.
SCHEDULE_SWITCH_CASES = [
    (64, 1000, 777, "causal", {**NO_PINGPONG, **ONE_CTA_A_TILE}),
    (64, 1000, 1000, "full", {**NO_PINGPONG, **ROWS_192}),
    (128, 777, 1000, "full", NO_PINGPONG),
    (128, 1000, 1000, "causal", {**NO_PINGPONG, **PERSISTENT}),
    (256, 1000, 1000, "causal", NO_PINGPONG),
    (128, 1000, 777, "full", {**ROWS_192, "tile_n": 80}),
    (128, 1000, 1000, "causal", {**ROWS_192, "tile_n": 80, **PERSISTENT}),
    (128, 777, 1000, "causal", {**ROWS_192, "tile_n": 64}),
    (64, 1000, 777, "causal", {**NO_OVERLAP, **ONE_CTA_A_TILE}),
    (128, 1000, 1000, "full", NO_OVERLAP),
    (256, 777, 1000, "causal", NO_OVERLAP),
    (128, 1000, 777, "full", TMA_STORE),
    (128, 17, 1000, "full", TMA_STORE),
    (128, 1000, 300, "causal", TMA_STORE),
    (64, 1000, 777, "causal", TMA_STORE),
    (64, 1000, 1000, "full", {**TMA_STORE, **ROWS_192}),
    (256, 777, 1000, "causal", TMA_STORE),
]


def fields_id(fields: dict) -> str:
    return "-".join(f"{name}{int(value)}" for name, value in fields.items())


@pytest.mark.parametrize("d,seqlen_q,seqlen_k,mask,fields", SCHEDULE_SWITCH_CASES,
                         ids=[f"d{c[0]}-{c[1]}x{c[2]}-{c[3]}-{fields_id(c[4])}"
                              for c in SCHEDULE_SWITCH_CASES])  # fmt: skip
def test_fwd_schedule_switches(monkeypatch, d, seqlen_q, seqlen_k, mask, fields):
    """``pingpong=False`` (no consumer turns), ``tile_m=192`` at d128 with 64 or 80 keys,
    ``overlap=False``, ``tma_store=True``, alone or with a persistent grid or three consumers:
    against attention_ref, with the fields in the kernel that ran."""
    config = run_sm90_case(monkeypatch, fields, d, seqlen_q, seqlen_k, mask, 0.0,
                           torch.bfloat16, 4.0, h_kv=2)  # fmt: skip
    labels = {"pingpong": "nopingpong", "overlap": "nooverlap", "tma_store": "tmastore"}
    for name in fields.keys() & labels.keys():
        assert labels[name] in config.name, config.name


# (d, seqlen_q, seqlen_k, mask, softcap, dtype, threshold, score spread, other fields).
DEFER_AND_POLY4 = {"defer_rescale": True, "exp2_poly": 4}
RESCALE_THRESHOLD_CASES = [
    (64, 1000, 777, "full", 0.0, torch.bfloat16, 8, 1.0, {}),
    (64, 4224, 4224, "causal", 0.0, torch.bfloat16, 8, 4.0, {}),
    (128, 1000, 2049, "full", 0.0, torch.float16, 8, 4.0, {}),
    (128, 1000, 1000, "causal", 15.0, torch.bfloat16, 4, 1.0, {}),
    (128, 1000, 1000, "win64_0", 0.0, torch.bfloat16, 8, 4.0, {}),
    (128, 700, 900, "full", 0.0, torch.bfloat16, 8, 4.0, DEFER_AND_POLY4),
    (256, 777, 1000, "causal", 0.0, torch.bfloat16, 8, 4.0, {}),
    (256, 1000, 1000, "full", 0.0, torch.float16, 4, 1.0, {}),
]


@pytest.mark.parametrize(
    "d,seqlen_q,seqlen_k,mask,softcap,dtype,threshold,spread,fields", RESCALE_THRESHOLD_CASES,
    ids=[f"d{c[0]}-{c[1]}x{c[2]}-{c[3]}-thr{c[6]}-{str(c[5])[6:]}-x{c[7]:g}"
         + (f"-{fields_id(c[8])}" if c[8] else "") for c in RESCALE_THRESHOLD_CASES],
)  # fmt: skip
def test_fwd_rescale_threshold(
    monkeypatch, d, seqlen_q, seqlen_k, mask, softcap, dtype, threshold, spread, fields
):
    """``rescale_threshold=t`` (a row max moves only by more than t in log2 units; O rescaled
    only when a row of the warp moved; Note [rescale threshold]): against attention_ref, with
    the field in the kernel that ran. A spread of 4 makes row maxima move by more than t
    often; at 1 they mostly stay."""
    run_sm90_case(monkeypatch, {"rescale_threshold": threshold, **fields}, d, seqlen_q,
                  seqlen_k, mask, softcap, dtype, spread, h_kv=3)  # fmt: skip


def test_poison_reaches_output():
    """The NaN guard is live: out and lse of a call land in memory poisoned just before it."""
    b, s, h, d = 2, 300, NHEADS, 128
    q, k, v = _qkv(b, s, s, h, h, d, torch.bfloat16)
    poison = poison_free_memory(_reserve_for((b, s, h, d), torch.bfloat16, (b, h, s)))
    out, lse = cute_fa.flash_attn_func(q, k, v, return_lse=True)
    assert poison.covers(out), "out was not allocated from poisoned memory: the NaN guard is off"
    assert poison.covers(lse), "lse was not allocated from poisoned memory: the NaN guard is off"
    check_against_ref(out, lse, q, k, v)


def test_new_seqlen_does_not_recompile():
    from cute_fa.cache import compile_count as counter

    run_and_check(2, 128, 128, NHEADS, 2, 128, causal=True)
    before = counter()
    for b, sq, sk in [(1, 300, 300), (3, 77, 1000), (2, 1000, 17)]:
        run_and_check(b, sq, sk, NHEADS, 2, 128, causal=True)
    run_and_check(2, 128, 128, 12, 4, 128, causal=True)  # other head counts
    assert counter() == before, "a new sequence length, batch or head count recompiled"


# ------------------------------------------------------------------------------------------
# Varlen

LENS_Q = [17, 0, 300, 1, 129, 300, 0]
LENS_K = [300, 17, 129, 1, 0, 17, 0]


def run_varlen_and_check(
    lens_q,
    lens_k,
    d,
    *,
    causal=False,
    window=(None, None),
    softcap=0.0,
    used_k=None,
    used_q=None,
    h=NHEADS,
    h_kv=2,
    dtype=torch.bfloat16,
    nan_past_used_k=False,
):
    """Packed varlen call; each sequence is checked on its own against attention_ref.

    ``nan_past_used_k``: the key and value rows past seqused_k (which are no input) hold NaN,
    as uninitialised memory may; no NaN may reach the output.
    """
    total_q, total_k = sum(lens_q), sum(lens_k)
    q = torch.randn(total_q, h, d, device="cuda", dtype=dtype)
    if softcap:
        q = (q.float() * (softcap / 4)).to(dtype)
    k = torch.randn(total_k, h_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(total_k, h_kv, d, device="cuda", dtype=dtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    if nan_past_used_k:
        for i, lk in enumerate(lens_k):
            k0 = int(cu_k[i])
            k[k0 + used_k[i] : k0 + lk] = float("nan")
            v[k0 + used_k[i] : k0 + lk] = float("nan")
    extra = {}
    if used_k is not None:
        extra["seqused_k"] = torch.tensor(used_k, dtype=torch.int32, device="cuda")
    if used_q is not None:
        extra["seqused_q"] = torch.tensor(used_q, dtype=torch.int32, device="cuda")
    poison_free_memory(_reserve_for((total_q, h, d), dtype, (h, total_q)))
    out, lse = cute_fa.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(lens_q),
        max_seqlen_k=max(lens_k),
        causal=causal,
        window_size=window,
        softcap=softcap,
        return_lse=True,
        **extra,
    )
    assert out.shape == (total_q, h, d) and lse.shape == (h, total_q)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        q0, k0 = int(cu_q[i]), int(cu_k[i])
        lq_used = lq if used_q is None else used_q[i]
        lk_used = lk if used_k is None else used_k[i]
        rows = slice(q0, q0 + lq_used)
        keys = slice(k0, k0 + lk_used)
        try:
            check_against_ref(
                out[rows][None],
                lse[:, rows][None],
                q[rows][None],
                k[keys][None],
                v[keys][None],
                causal=causal,
                window=window,
                softcap=softcap,
            )
        except AssertionError as e:
            raise AssertionError(f"sequence {i} (len_q={lq_used}, len_k={lk_used}): {e}") from e
        if lq_used < lq:  # rows past seqused_q: 0 and -inf, as attention_varlen_ref has them
            tail = slice(q0 + lq_used, q0 + lq)
            assert (out[tail] == 0).all(), f"sequence {i}: rows past seqused_q must be 0"
            assert torch.isneginf(lse[:, tail]).all(), f"sequence {i}: lse past seqused_q"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("causal,window", [MASKS[0], MASKS[1], MASKS[3]])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_varlen(d, causal, window):
    run_varlen_and_check(LENS_Q, LENS_K, d, causal=causal, window=window)


@pytest.mark.parametrize("causal,window", [MASKS[0], MASKS[1], MASKS[3]])
def test_varlen_random_lengths(causal, window):
    n = 9
    lens_q = [random.choice([0, 1, random.randrange(2, 400)]) for _ in range(n)]
    lens_k = [random.choice([0, 1, random.randrange(2, 400)]) for _ in range(n)]
    print(f"lens_q={lens_q} lens_k={lens_k}")
    run_varlen_and_check(lens_q, lens_k, 128, causal=causal, window=window)


def test_varlen_softcap():
    run_varlen_and_check(LENS_Q, LENS_K, 128, causal=True, softcap=15.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_varlen_seqused_k(d, causal):
    """cu_seqlens_k gives each sequence's room; seqused_k how many of those keys count."""
    used_k = [min(lk, u) for lk, u in zip(LENS_K, [300, 5, 64, 0, 0, 17, 0], strict=True)]
    run_varlen_and_check(LENS_Q, LENS_K, d, causal=causal, used_k=used_k)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_varlen_seqused_k_nan_past_used(d, causal):
    """Key/value rows between seqused_k and the sequence end hold NaN: they must not leak."""
    used_k = [min(lk, u) for lk, u in zip(LENS_K, [200, 5, 64, 0, 0, 10, 0], strict=True)]
    run_varlen_and_check(LENS_Q, LENS_K, d, causal=causal, used_k=used_k, nan_past_used_k=True)


@pytest.mark.parametrize("causal,window", [MASKS[0], MASKS[1], MASKS[3]])
@pytest.mark.parametrize("d", [96, 192, 256], ids=["d96", "d192", "d256"])
def test_varlen_head_dims(d, causal, window):
    """The head dims whose sm90 key block is not 128 (d 192: 112, d 256: 80) or whose rows
    are not a power of two of 16-byte vectors (d 96)."""
    run_varlen_and_check(LENS_Q, LENS_K, d, causal=causal, window=window)


def test_varlen_seqused_q():
    """seqused_q: the used rows against the reference, the rows past it 0 with lse -inf."""
    used_q = [min(lq, u) for lq, u in zip(LENS_Q, [10, 0, 300, 1, 0, 150, 0], strict=True)]
    run_varlen_and_check(LENS_Q, LENS_K, 128, used_q=used_q)
