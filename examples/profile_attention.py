"""Run cute_fa's forward (and backward) of one shape a few times, for a profiler.

Under ``ncu`` (one kernel, after a warm-up launch), e.g. the sm90 backward main kernel:

    ncu --clock-control none -k regex:FlashAttentionBackwardSm90 --launch-skip 1 \\
        --launch-count 1 --section SpeedOfLight --section WarpStateStats \\
        python examples/profile_attention.py --mode bwd --d 128 --seqlen 4096

``--impl flash`` or ``--impl cudnn`` runs torch SDPA with that backend on the same shape
instead (its kernels under ncu, e.g. ``-k regex:flash_bwd_dq_dk_dv`` for FA2's backward), so
that two kernels can be compared metric by metric; ``--deterministic`` passes
``deterministic=True`` to cute_fa.

Or with ``--torch-profiler``, which prints torch.profiler's table of GPU and CPU time per op
for a few calls (after warm-up calls that compile or load the kernels):

    python examples/profile_attention.py --mode bwd --d 64 --seqlen 256 --batch 32 --heads 4 \\
        --kv-heads 2 --causal --torch-profiler

Default shape: the standard grid's (16k tokens: batch = 16384 / seqlen; heads = 2048 / d).
"""

from __future__ import annotations

import argparse

import torch

import cute_fa


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("fwd", "bwd"), default="fwd")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--batch", type=int, default=None, help="default 16384 // seqlen")
    p.add_argument("--heads", type=int, default=None, help="default 2048 // d")
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--calls", type=int, default=2, help="calls after the warm-up (default 2)")
    p.add_argument("--impl", choices=("cute_fa", "flash", "cudnn"), default="cute_fa",
                   help="cute_fa, or torch SDPA with its FLASH or CUDNN backend")  # fmt: skip
    p.add_argument("--deterministic", action="store_true", help="cute_fa: deterministic=True")
    p.add_argument("--torch-profiler", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_attention: needs a CUDA GPU")
        return 1

    batch = args.batch or max(1, 16384 // args.seqlen)
    heads = args.heads or 2048 // args.d
    kv_heads = args.kv_heads or heads
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    grad = args.mode == "bwd"

    def tensor(h):
        return torch.randn(batch, args.seqlen, h, args.d, device="cuda", dtype=dtype,
                           requires_grad=grad)  # fmt: skip

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    if args.impl == "cute_fa":

        def attend():
            return cute_fa.flash_attn_func(
                q, k, v, causal=args.causal, deterministic=args.deterministic
            )[0]

    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seqlen, d) views

        def attend():
            with sdpa_kernel([backend[args.impl]]):  # the backward keeps the forward's backend
                o = torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=args.causal, enable_gqa=kv_heads != heads
                )
            return o.transpose(1, 2)

    out = attend()
    dout = torch.randn_like(out)

    def call():
        if grad:
            out.backward(dout, retain_graph=True)
        else:
            attend()

    call()  # warm-up: compiles or loads the kernels
    torch.cuda.synchronize()
    if not args.torch_profiler:
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
        return 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
    print(f"{args.impl} {args.mode} x{args.calls}: batch {batch}, {args.seqlen} rows, heads "
          f"{heads} / {kv_heads}, d {args.d}, causal {args.causal}")  # fmt: skip
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
