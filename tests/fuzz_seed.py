"""The fuzz sweep's settings (tests/test_fuzz_gpu.py), read the same way by every xdist worker
and by the report header (tests/conftest.py)."""

from __future__ import annotations

import datetime
import os


def fuzz_settings() -> tuple[int, int, int]:
    """(seed, cases, families): ``CUTE_FA_FUZZ_SEED`` (default today's date as YYYYMMDD),
    ``CUTE_FA_FUZZ_CASES`` (2000), ``CUTE_FA_FUZZ_FAMILIES`` (48)."""
    seed = int(os.environ.get("CUTE_FA_FUZZ_SEED") or datetime.date.today().strftime("%Y%m%d"))
    cases = int(os.environ.get("CUTE_FA_FUZZ_CASES") or 2000)
    families = int(os.environ.get("CUTE_FA_FUZZ_FAMILIES") or 48)
    return seed, cases, families
