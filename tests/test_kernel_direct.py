"""examples/kernel_direct.py (docs/usage.md, "Using a kernel directly") runs as documented."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kernel_direct.py"


def load_example():
    spec = importlib.util.spec_from_file_location("kernel_direct", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.compile
def test_kernel_direct_cross_compiles():
    example = load_example()
    config = example.sm90_config(tile_n=112)
    assert config.tile_n == 112 and config.causal and config.target == "sm_90a"
    info = example.compile_for_target(config)
    assert info["stack"] == 0 and info["HGMMA"] > 0 and info["regs"] <= 240


@pytest.mark.gpu
def test_kernel_direct_launches_on_hopper():
    import torch

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the example's launch path runs the sm90 kernel")
    assert load_example().launch_and_check(load_example().sm90_config()) >= 0.0
