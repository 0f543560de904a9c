"""The per-role SASS splitter (cute_fa/tools/sass_roles.py): on a hand-written listing, and on
the sm100 forward at d 128 (cross-compiled on the CPU), whose per-block counts follow from the
kernel's design (blackwell/flash_fwd.py's class docstring)."""

from __future__ import annotations

import dataclasses

import pytest
from cute_fa.blackwell.support import fwd_config, fwd_regs

from cute_fa.tools.sass_roles import role_loops, role_table

# A role dispatch (BRX), a softmax-like role whose key loop waits on an mbarrier (in-line try,
# retry out of line after the EXIT), and an MMA-like role: the shape ptxas gives the kernels.
_LISTING = """
.text.kernel_x:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   BRX R2 -0x20 (*"BRANCH_TARGETS .L_x_1,.L_x_5"*);
.L_x_1:
        /*0020*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0 ;
.L_x_2:
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*0040*/              @!P0 BRA `(.L_x_9) ;
.L_x_3:
        /*0050*/                   LDTM.x32 R4, tmem[UR5] ;
        /*0060*/                   MUFU.EX2 R6, R4 ;
        /*0070*/                   MUFU.EX2 R7, R5 ;
        /*0080*/                   STTM.x32 tmem[UR5], R6 ;
        /*0090*/                   BRA.U UP0, `(.L_x_2) ;
        /*00a0*/                   EXIT ;
.L_x_5:
        /*00b0*/                   USETMAXREG.DEALLOC.CTAPOOL 0x30 ;
.L_x_6:
        /*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6], R5 ;
        /*00d0*/                   UTCHMMA gdesc[UR8], gdesc[UR10], tmem[UR12], idesc[UR15], UPT ;
        /*00e0*/              @!P0 BRA `(.L_x_6) ;
        /*00f0*/                   EXIT ;
.L_x_9:
        /*0100*/                   MOV R6, UR4 ;
.L_x_10:
        /*0110*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R6], R5 ;
        /*0120*/              @!P0 NANOSLEEP.SYNCS 0x989680 ;
        /*0130*/              @!P0 BRA `(.L_x_10) ;
        /*0140*/                   BRA `(.L_x_3) ;
        .weak           $__internal_0
"""


def test_role_loops_on_a_listing() -> None:
    loops = {lp.role: lp for lp in role_loops(_LISTING)}
    assert set(loops) == {"softmax", "mma"}
    soft = loops["softmax"]
    assert (soft.maxnreg, soft.head_addr) == (0xC0, 0x30)
    # The in-line try (2) and the body (5) count; the retry stub (MOV, its loop, BRA) does not.
    assert soft.instructions == 7
    assert soft.columns["MUFU.EX2"] == 2 and soft.columns["SYNCS"] == 1
    mma = loops["mma"]
    assert (mma.maxnreg, mma.instructions, mma.columns["UTCHMMA"]) == (0x30, 3, 1)


# The softmax's numerics fields of Sm100FwdTuning: the default (FA4's values), every exponential
# on MUFU, and the polynomial on every other pair with a rescale on every new max.
NUMERICS = [
    pytest.param({}, id="default"),
    pytest.param({"exp2_poly": 0}, id="poly0"),
    pytest.param({"exp2_poly": 2, "rescale_threshold": 0}, id="poly2-thr0",
                 marks=pytest.mark.exhaustive),
]  # fmt: skip


@pytest.mark.compile
@pytest.mark.parametrize("fields", NUMERICS)
def test_role_table_sm100_fwd_d128(fields: dict) -> None:
    from cute_fa.tools.sass import compile_cubin, inspect_cubin

    config = fwd_config(128, 128)
    config = dataclasses.replace(config, tuning=dataclasses.replace(config.tuning, **fields))
    info = inspect_cubin(compile_cubin(config))
    rows = {r["role"]: r for r in role_table(info["sass_text"], config.head_dim_v)}
    assert set(rows) == {"softmax unmasked", "softmax masked", "correction", "mma"}
    softmax_regs, correction_regs, other_regs = fwd_regs(config)
    tile_n, d, dv, q_tiles = config.tile_n, config.head_dim, config.head_dim_v, 2
    # Softmax, per block of one Q tile: tile_n exponentials a row, every exp2_poly-th pair of
    # an unmasked block by the polynomial, plus the row's rescale factor; S in by tcgen05.ld of
    # 32 columns, P (16-bit, tile_n / 2 columns) out by tcgen05.st of 32.
    every = config.tuning.exp2_poly
    poly = 2 * (tile_n // 2 // every) if every else 0
    unmasked, masked = rows["softmax unmasked"], rows["softmax masked"]
    assert unmasked["MUFU.EX2"] == tile_n - poly + 1
    assert masked["MUFU.EX2"] == tile_n + 1
    for r in (unmasked, masked):
        assert (r["maxnreg"], r["rows"]) == (softmax_regs, 128)
        assert (r["LDTM"], r["STTM"], r["UTCHMMA"]) == (tile_n // 32, tile_n // 2 // 32, 0)
    assert masked["instr"] > unmasked["instr"] > tile_n
    # Correction, per block of both Q tiles: O_i *= factor in chunks of 32 columns (FMUL2: two
    # columns); two waits (factor, O) a tile.
    corr = rows["correction"]
    assert (corr["maxnreg"], corr["rows"]) == (correction_regs, q_tiles * 128)
    assert corr["FMUL2"] == q_tiles * dv // 2
    assert corr["LDTM"] == corr["STTM"] == q_tiles * dv // 32
    assert corr["MUFU.EX2"] == 0 and corr["instr"] < corr["FMUL2"] + 64
    # MMA, per block: O_i += P_i V (tile_n / 16 K phases) and S_i = Q_i K^T (d / 16) a tile.
    mma = rows["mma"]
    assert (mma["maxnreg"], mma["rows"]) == (other_regs, q_tiles * 128)
    assert mma["UTCHMMA"] == q_tiles * (d // 16 + tile_n // 16)
    assert info["stack"] == 0
