"""Compile-only checks of the sm90 forward kernel (FA3 design) on the CPU, with a SASS read.

What can be checked of ``FlashAttentionForwardSm90`` without a GPU (tests/test_fwd_gpu.py
checks its results on one): it cross-compiles for sm_90a, the cubin holds WGMMA
(``HGMMA``) and TMA loads (``UTMALDG``) and no mma.sync, nothing spills (no ``LDL``/``STL``, no
stack), the register reallocation took effect (``USETMAXREG`` down to the producer budget and up
to the consumer budget, no ptxas warning about it), and ``can_implement`` rejects what the
kernel does not do yet, with its reason.
"""

from __future__ import annotations

import re

import pytest
from cute_fa.hopper.support import SM90_FWD_TILE, fwd_can_implement

from cute_fa.config import FwdConfig
from cute_fa.dispatch import SM90_FWD, fwd_kernel_class, fwd_kernel_classes
from cute_fa.sass import compile_and_inspect


def _config(**changes) -> FwdConfig:
    tile_m, tile_n, num_warps = SM90_FWD_TILE
    values = dict(
        arch=90, target="sm_90a", dtype="bf16", head_dim=128, head_dim_v=128,
        tile_m=tile_m, tile_n=tile_n, num_warps=num_warps,
    )  # fmt: skip
    values.update(changes)
    return FwdConfig(**values)


def test_sm90_forward_is_reachable_by_name_but_not_dispatched() -> None:
    assert SM90_FWD.arch == 90
    assert SM90_FWD not in fwd_kernel_classes((9, 0))
    assert all(spec.arch == 80 for spec in fwd_kernel_classes((9, 0)))
    assert fwd_kernel_class(90).__name__ == "FlashAttentionForwardSm90"


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"arch": 80}, "sm80"),
        ({"target": "sm_100a"}, "sm_90a"),
        ({"head_dim": 96, "head_dim_v": 96}, "head_dim 96"),
        ({"head_dim": 256, "head_dim_v": 256}, "head_dim 256"),
        ({"head_dim_v": 64}, "head_dim_v"),
        ({"tile_n": 64}, "tile"),
        ({"local": True}, "local"),
        ({"has_softcap": True}, "has_softcap"),
        ({"varlen_q": True, "varlen_k": True}, "varlen_q"),
        ({"seqused_k": True}, "seqused_k"),
    ],
)
def test_sm90_can_implement_rejects_with_reason(changes: dict, needle: str) -> None:
    ok, reason = fwd_can_implement(_config(**changes))
    assert not ok and needle in reason


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_can_implement_accepts(d: int, dtype: str, causal: bool) -> None:
    config = _config(head_dim=d, head_dim_v=d, dtype=dtype, causal=causal)
    assert fwd_can_implement(config) == (True, "")


@pytest.mark.compile
@pytest.mark.parametrize(
    "d, dtype, causal",
    [(128, "bf16", False), (128, "bf16", True), (64, "bf16", False), (64, "fp16", True),
     (128, "fp16", False)],
)  # fmt: skip
def test_sm90_fwd_compiles_for_sm90a(d: int, dtype: str, causal: bool, capfd) -> None:
    info = compile_and_inspect(_config(head_dim=d, head_dim_v=d, dtype=dtype, causal=causal))
    out, err = capfd.readouterr()
    counts = info["sass_counts"]
    print(
        f"regs {info['regs']} stack {info['stack']} HGMMA {counts['HGMMA']} "
        f"UTMALDG {counts['UTMALDG']} spills {info['spills']}"
    )
    # S = Q K^T: d / 16 WGMMAs (k = 16 each), O += P V: tile_n / 16; both in the masked and
    # the unmasked loop, plus the peeled first (S only) and last (P V only) block.
    assert counts["HGMMA"] == 3 * (d // 16 + 128 // 16), "WGMMA (HGMMA) count"
    assert counts["UTMALDG"] > 0, "no TMA load (UTMALDG) in the SASS"
    assert counts["HMMA"] == 0 and counts["LDGSTS"] == 0
    assert info["spills"] == 0 and info["stack"] == 0 and info["local"] == 0
    # 384 threads: at most 65536 / 384 registers at launch, then setmaxnreg moves them.
    assert info["regs"] <= 168
    sass = info["sass_text"]
    assert re.search(r"USETMAXREG\.DEALLOC\S*\s+0x18\b", sass), "producer setmaxnreg.dec 24"
    assert re.search(r"USETMAXREG\.TRY_ALLOC\S*\s+\S+,\s*0xf0\b", sass), (
        "consumer setmaxnreg.inc 240"
    )
    assert "setmaxnreg" not in (out + err).lower(), "ptxas warned about setmaxnreg"
