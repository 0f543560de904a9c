"""Use a kernel class directly: build its compile key (with a tuning override), compile it once
for a target, and (on a GPU) launch it on your own tensors and stream.

    python examples/kernel_direct.py        # GPU: compile, launch, check against the reference
    python examples/kernel_direct.py --cpu  # any machine: cross-compile for sm_90a, read the cubin

docs/usage.md ("Using a kernel directly") walks through it.
"""

from __future__ import annotations

import argparse
import tempfile

import cute_fa
from cute_fa.config import FwdConfig, Sm90FwdTuning
from cute_fa.planning import FwdRequest, fwd_plan


def sm90_config(tile_n: int = 112) -> FwdConfig:
    """The compile key planning would pick for a causal bf16 d128 call on an sm_90a device,
    with an override of one tuning field."""
    request = FwdRequest(dtype="bf16", head_dim=128, head_dim_v=128, causal=True)
    with cute_fa.tuning(sm90_fwd={"tile_n": tile_n}):
        kernel_spec, config = fwd_plan((9, 0), request, seqlen_q=16384)
    assert kernel_spec.name == "FlashAttentionForwardSm90" and config.tile_n == tile_n
    # The same key written out by hand; the kernel class says whether it can run it:
    by_hand = FwdConfig(arch=90, target="sm_90a", dtype="bf16", head_dim=128, head_dim_v=128,
                        tuning=Sm90FwdTuning(tile_n=tile_n), causal=True)  # fmt: skip
    assert by_hand == config and kernel_spec.can_implement(config) == (True, "")
    return config


def compile_for_target(config: FwdConfig) -> dict:
    """Cross-compile the kernel class for ``config.target`` with the DSL's own call (fake
    tensors: every extent dynamic) and report its registers, stack and MMA count."""
    import cutlass.cute as cute
    from cute_fa.hopper import FlashAttentionForwardSm90

    from cute_fa.dsl.fake import fwd_fake_args
    from cute_fa.tools.sass import inspect_cubin

    kernel = FlashAttentionForwardSm90(config)
    with tempfile.TemporaryDirectory() as dump:
        compiled = cute.compile(
            kernel,
            *fwd_fake_args(config),
            options=f"--gpu-arch {config.target} --keep-cubin --dump-dir {dump}",
        )
    info = inspect_cubin(compiled.__cubin__)
    return {"regs": info["regs"], "stack": info["stack"], "HGMMA": info["sass_counts"]["HGMMA"]}


def launch_and_check(config: FwdConfig) -> float:
    """Compile ``config`` into a function that takes torch tensors (TVM-FFI, launched on torch's
    current stream), run it on a stream of our own, and compare with the fp32 reference."""
    import torch

    from cute_fa.compile import fwd_cache
    from cute_fa.reference import attention_ref, check_close

    kernel = fwd_cache().get(config)  # compiled once, kept in memory and on disk
    b, s, h, d = 2, 1000, 8, config.head_dim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # The forward protocol (cute_fa/dsl/fake.py): q, k, v, out, lse, softmax_scale,
        # softcap, window_left, window_right, max_seqlen_q, cu_seqlens_q, cu_seqlens_k,
        # seqused_q, seqused_k, page_table.
        kernel(q, k, v, out, lse, d**-0.5, 0.0, 0, 0, s, None, None, None, None, None)
    stream.synchronize()
    out_ref, _ = attention_ref(q, k, v, causal=config.causal)
    out_pt, _ = attention_ref(q, k, v, causal=config.causal, upcast=False)
    check_close(out, out_ref, out_pt)
    return float((out.float() - out_ref.float()).abs().max())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="cross-compile only, even on a GPU")
    args = parser.parse_args(argv)
    config = sm90_config()
    print(config.name)
    import torch

    on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    if args.cpu or not on_hopper:
        print("compiled for", config.target, compile_for_target(config))
    else:
        print("max |out - ref| =", launch_and_check(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
