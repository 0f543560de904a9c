"""Train a tiny GPT twice from the same seed, once with cute_fa attention and once with torch
SDPA, and check that the two loss curves agree within bf16 noise.

    python examples/train_tiny_gpt.py --steps 300

Data: generated on the fly, no downloads. Each sequence is a walk of a fixed random Markov chain
(every token has a few likely successors: irreducible entropy) whose first half is then
repeated, so the second half is predictable only by attending back to the first (an induction
task: the loss falls well below the chain's entropy only if attention and its gradients work).
Both runs see the same batches in the same order.

Model: token and position embeddings, pre-norm blocks of causal GQA attention (flash_attn_func,
or F.scaled_dot_product_attention) and a GELU MLP, fp32 weights under bf16 autocast, AdamW with
warmup and gradient clipping.

Pass criterion (the runs differ only by rounding, which grows chaotically but stays noise):
  * no NaN / inf loss in either run;
  * both runs learned: the final mean loss is below 60 % of the first step's loss;
  * final mean losses (mean of the last min(100, steps // 3) steps) agree:
    |cute - sdpa| <= max(tol * sdpa, 0.01) with tol = 2 % (``--tol``);
  * the first step's losses agree to 1 % (same weights and batch: only kernel rounding differs).
Exit status 0 on pass, 1 on failure. Without CUDA it says so and exits 1, or 0 with
``--allow-cpu-skip``.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

# Steps left out of the reported step time: the first ones compile the attention kernels.
TIMING_SKIP = 10


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, backend: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.backend = backend
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        if self.backend == "cute_fa":
            from cute_fa import flash_attn_func

            out, _ = flash_attn_func(q, k, v, causal=True)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, enable_gqa=True,
            ).transpose(1, 2)  # fmt: skip
        return self.o(out.reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, backend: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, backend)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seqlen: int, dim: int, layers: int, heads: int, kv_heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seqlen, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, "sdpa") for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def set_attention(self, backend: str) -> None:
        for block in self.blocks:
            block.attn.backend = backend

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class MarkovCopyData:
    """Batches of Markov-chain walks whose first half is repeated (see the module docstring),
    all generated up front so that both runs see the same tokens."""

    def __init__(self, vocab: int, seqlen: int, batch: int, steps: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        # Each token's successors: 4 likely ones (random) on top of a small uniform floor.
        logits = torch.full((vocab, vocab), -4.0)
        logits.scatter_(1, torch.randint(0, vocab, (vocab, 4), generator=g), 2.0)
        probs = logits.softmax(-1)
        self.entropy = float(-(probs * probs.log()).sum(-1).mean())  # nats a token, about
        cdf = probs.cumsum(-1)
        cdf[:, -1] = 1.0
        half = (seqlen + 2) // 2
        walks = torch.empty(steps * batch, half, dtype=torch.long)
        walks[:, 0] = torch.randint(0, vocab, (steps * batch,), generator=g)
        uniform = torch.rand(steps * batch, half, generator=g)
        for t in range(1, half):  # inverse-CDF sampling of every walk's next token at once
            u = uniform[:, t : t + 1].contiguous()
            nxt = torch.searchsorted(cdf[walks[:, t - 1]], u)[:, 0]
            walks[:, t] = nxt.clamp_(max=vocab - 1)
        seqs = torch.cat([walks, walks], dim=1)[:, : seqlen + 1]
        self.batches = seqs.view(steps, batch, seqlen + 1)

    def batch_at(self, step: int, device: torch.device) -> torch.Tensor:
        return self.batches[step].to(device, non_blocking=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model: TinyGPT, data: MarkovCopyData, steps: int, lr: float) -> tuple[list, float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:  # linear warmup, then cosine decay to 0
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    device = next(model.parameters()).device
    losses = []
    skip = min(TIMING_SKIP, steps - 1)  # steps left out of the step time (first calls compile)
    _sync(device)
    t0 = t_skip = time.perf_counter()
    for step in range(steps):
        if step == skip:
            _sync(device)
            t_skip = time.perf_counter()
        seq = data.batch_at(step, device)
        inputs, targets = seq[:, :-1], seq[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())
    _sync(device)
    end = time.perf_counter()
    step_ms = (end - t_skip) / max(1, steps - skip) * 1e3
    return [float(x) for x in torch.stack(losses).cpu()], end - t0, step_ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--tol", type=float, default=0.02, help="relative tolerance of final losses")
    p.add_argument("--print-every", type=int, default=20)
    p.add_argument(
        "--allow-cpu-skip", action="store_true", help="exit 0 (not 1) when no CUDA GPU is found"
    )
    args = p.parse_args(argv)

    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        print(
            f"train_tiny_gpt: needs a CUDA GPU (device {args.device!r}, torch.cuda.is_available()"
            f" = {torch.cuda.is_available()}); cute_fa runs on NVIDIA GPUs from sm80 up"
        )
        return 0 if args.allow_cpu_skip else 1
    device = torch.device(args.device)
    if device.index is not None:
        torch.cuda.set_device(device)
    if args.steps < 3:
        p.error("--steps must be at least 3")

    torch.manual_seed(args.seed)
    base = TinyGPT(args.vocab, args.seqlen, args.dim, args.layers, args.heads, args.kv_heads)
    base = base.to(device)
    data = MarkovCopyData(args.vocab, args.seqlen, args.batch, args.steps, args.seed)

    curves = {}
    for backend in ("cute_fa", "sdpa"):
        model = copy.deepcopy(base)
        model.set_attention(backend)
        torch.manual_seed(args.seed + 1)
        curves[backend], elapsed, step_ms = train(model, data, args.steps, args.lr)
        print(
            f"{backend}: {args.steps} steps in {elapsed:.1f} s; {step_ms:.2f} ms a step after "
            f"the first {min(TIMING_SKIP, args.steps - 1)}"
        )

    cute, sdpa = curves["cute_fa"], curves["sdpa"]
    print(f"\n{'step':>6} {'cute_fa':>10} {'sdpa':>10} {'diff':>10}")
    for step in range(args.steps):
        if step % args.print_every == 0 or step == args.steps - 1:
            diff = cute[step] - sdpa[step]
            print(f"{step:>6} {cute[step]:>10.4f} {sdpa[step]:>10.4f} {diff:>+10.4f}")

    window = min(100, args.steps // 3)
    mean_cute = sum(cute[-window:]) / window
    mean_sdpa = sum(sdpa[-window:]) / window
    allowed = max(args.tol * mean_sdpa, 0.01)
    failures = []
    if not all(math.isfinite(x) for x in cute + sdpa):
        failures.append("a loss is NaN or inf")
    for name, curve, mean in (("cute_fa", cute, mean_cute), ("sdpa", sdpa, mean_sdpa)):
        if not mean < 0.6 * curve[0]:
            failures.append(f"{name} did not learn: final mean {mean:.4f} vs first {curve[0]:.4f}")
    if not abs(cute[0] - sdpa[0]) <= 0.01 * sdpa[0]:
        failures.append(f"first-step losses differ: {cute[0]:.5f} vs {sdpa[0]:.5f}")
    if not abs(mean_cute - mean_sdpa) <= allowed:
        failures.append(
            f"final mean losses differ by {abs(mean_cute - mean_sdpa):.4f} > {allowed:.4f}"
        )
    print(
        f"\nmean loss over the last {window} steps: cute_fa {mean_cute:.4f}, sdpa {mean_sdpa:.4f}"
        f" (|diff| {abs(mean_cute - mean_sdpa):.4f}, allowed {allowed:.4f})"
    )
    print(
        f"(the Markov chain's entropy is about {data.entropy:.3f} nats a token; a model that "
        f"copies the repeated half gets to about half of that)"
    )
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("PASS: the cute_fa and SDPA loss curves agree within bf16 noise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
