"""The implementations under test (cute_fa, SDPA FLASH / CUDNN, FlexAttention, FA4), for the grid
(``forward_fn``, ``backward_fn``) and for decode (``decode_fn``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from .common import split_impl, variant_context

# --------------------------------------------------------------------------------------------
# Implementations


class ImplUnavailable(Exception):
    """The implementation cannot run this case (e.g. cute_fa has no backward yet): 'n/a'."""


def fa4_decode_splits(major: int) -> int:
    """The ``num_splits`` FA4 gets in decode on a GPU of this compute capability major: 0 (its
    split-KV heuristic) where its forward splits (sm100 / sm110), 1 elsewhere (its sm80, sm90
    and sm120 forwards assert that num_splits resolves to 1)."""
    return 0 if major in (10, 11) else 1


@dataclass
class Impl:
    """One implementation under test: how it wants its inputs and how to call it."""

    name: str
    layout: str = "bshd"  # "bshd": (b, s, h, d) tensors; "bhsd": contiguous (b, h, s, d)
    state: dict = field(default_factory=dict)

    @property
    def base(self) -> str:
        """The implementation without a variant's settings."""
        return split_impl(self.name)[0]

    @contextlib.contextmanager
    def context(self):
        """Entered once around all timed calls of this implementation. A variant's tuning
        overrides (``cute_fa.tuning``) hold for the duration; launch plans are kept per tuning
        state, so neither its plans nor the plain implementation's leak across."""
        settings = split_impl(self.name)[1]
        if settings:
            with variant_context(settings):
                yield
        elif self.name in ("flash", "cudnn"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = (
                SDPBackend.FLASH_ATTENTION if self.name == "flash" else SDPBackend.CUDNN_ATTENTION
            )
            with sdpa_kernel(backend):
                yield
        else:
            yield

    def forward_fn(
        self, q, k, v, causal: bool, softcap: float = 0.0, window: tuple[int, int] | None = None
    ) -> Callable[[], object]:
        """Zero-argument forward on these tensors (layout ``self.layout``); returns out.
        ``softcap`` > 0: scores become softcap * tanh(scores / softcap); ``window``: a sliding
        window (left, right) (SDPA has neither: ImplUnavailable)."""
        if self.base in ("cute_fa", "cute_fa_det"):
            import cute_fa

            det = self.base == "cute_fa_det"
            window_size = window if window is not None else (None, None)

            def run():
                return cute_fa.flash_attn_func(
                    q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                    deterministic=det,
                )[0]  # fmt: skip

            return run
        if self.name in ("flash", "cudnn"):
            import torch.nn.functional as F

            if softcap:
                raise ImplUnavailable(f"{self.name}: SDPA has no softcap")
            if window is not None:
                raise ImplUnavailable(f"{self.name}: SDPA has no sliding window")
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        if self.name == "flex":
            import torch

            flex, block_mask = self._flex(
                q.shape[0], q.shape[2], k.shape[2], causal, q.device, window
            )
            if not softcap:
                return lambda: flex(q, k, v, block_mask=block_mask)

            def capped(score, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)

            return lambda: flex(q, k, v, block_mask=block_mask, score_mod=capped)
        if self.name == "fa4":
            try:
                from flash_attn.cute import flash_attn_func as fa4_func
            except ImportError as e:  # not installed (pip install flash-attn-4): 'n/a'
                raise ImplUnavailable(f"fa4: flash_attn.cute is not importable ({e})") from e
            window_size = window if window is not None else (None, None)

            def run():
                result = fa4_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap)
                return result[0] if isinstance(result, tuple) else result

            return run
        raise ValueError(f"unknown implementation {self.name!r}")

    def decode_fn(
        self, q, k, v, seqused_k, page_table=None, max_seqlen_k: int | None = None
    ) -> Callable[[], object]:
        """Zero-argument decode forward; returns out. q (batch, seqlen_q, heads, d); k, v
        (batch, cache_len, heads_kv, d) with ``page_table`` None, or pages (num_pages,
        page_size, heads_kv, d) with ``page_table`` int32 (batch, pages_per_seq) (FA4's paged
        layout); ``seqused_k`` int32 (batch,) the keys each sequence uses. Causal, bottom-right
        aligned: each query row sees the keys up to its own position at the end of the cache.
        cute_fa and FA4 take flash_attn.cute's ``flash_attn_varlen_func`` arguments; SDPA takes
        the contiguous layout only, with ``enable_gqa`` and every key of the cache used (it has
        no seqused_k: decode points use the whole cache)."""
        if self.base in ("cute_fa", "cute_fa_det"):
            import cute_fa

            det = self.base == "cute_fa_det"

            def run():
                return cute_fa.flash_attn_varlen_func(
                    q, k, v, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                    page_table=page_table, causal=True, num_splits=0, pack_gqa=None,
                    deterministic=det,
                )[0]  # fmt: skip

            return run
        if self.name == "fa4":
            import torch

            try:
                from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
            except ImportError as e:  # not installed (pip install flash-attn-4): 'n/a'
                raise ImplUnavailable(f"fa4: flash_attn.cute is not importable ({e})") from e
            num_splits = fa4_decode_splits(torch.cuda.get_device_capability(q.device)[0])

            def run():
                result = fa4_varlen(
                    q, k, v, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                    page_table=page_table, causal=True, num_splits=num_splits, pack_gqa=None,
                )  # fmt: skip
                return result[0] if isinstance(result, tuple) else result

            return run
        if self.name in ("flash", "cudnn"):
            return self._sdpa_decode(q, k, v, page_table)
        raise ImplUnavailable(f"{self.name}: not timed in decode mode")

    def _sdpa_decode(self, q, k, v, page_table) -> Callable[[], object]:
        """SDPA on the contiguous cache. One query row sees every key (no mask); more rows need
        a bottom-right causal mask, which SDPA's ``is_causal`` (top-left) is not: FLASH gets
        torch's ``causal_lower_right`` bias (run by FA2's own causal kernel, checked to be
        FLASH's before timing), CUDNN an explicit boolean mask."""
        import torch
        import torch.nn.functional as F

        if page_table is not None:
            raise ImplUnavailable(f"{self.name}: SDPA has no paged K/V")
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        if seqlen_q == 1:
            return lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        if self.name == "flash":
            from torch.backends.cuda import SDPAParams, can_use_flash_attention
            from torch.nn.attention.bias import causal_lower_right

            # Without the flash kernel, the bias would run another backend under FLASH's name.
            if not can_use_flash_attention(SDPAParams(qt, kt, vt, None, 0.0, False, True)):
                raise ImplUnavailable("flash: SDPA's flash kernel does not take this shape")
            bias = causal_lower_right(seqlen_q, seqlen_k)
            return lambda: F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=bias, enable_gqa=True
            )
        mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(
            seqlen_k - seqlen_q
        )
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)

    def _flex(self, batch: int, seqlen_q: int, seqlen_k: int, causal: bool, device, window=None):
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if "compiled" not in self.state:
            dynamo_config = torch._dynamo.config
            for limit in ("recompile_limit", "cache_size_limit"):
                if hasattr(dynamo_config, limit):
                    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 256))
            self.state["compiled"] = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        offset = seqlen_k - seqlen_q  # bottom-right aligned, as cute_fa
        mask = None
        if window is not None:
            left, right = window

            def mask(b, h, q_idx, kv_idx):
                return (kv_idx >= q_idx + offset - left) & (kv_idx <= q_idx + offset + right)

        elif causal:

            def mask(b, h, q_idx, kv_idx):
                return q_idx + offset >= kv_idx

        if mask is not None:
            block_mask = create_block_mask(
                mask, B=None, H=None, Q_LEN=seqlen_q, KV_LEN=seqlen_k, device=device
            )
        return self.state["compiled"], block_mask

    def backward_fn(
        self, q, k, v, causal: bool, softcap: float = 0.0, window: tuple[int, int] | None = None
    ) -> Callable[[], object]:
        """Zero-argument backward (dQ, dK, dV) of one forward done here; q/k/v are leaves."""
        import torch

        forward = self.forward_fn(q, k, v, causal, softcap, window)
        try:
            out = forward()
        except NotImplementedError as e:
            raise ImplUnavailable(str(e)) from e
        if not out.requires_grad:
            raise ImplUnavailable(f"{self.name}: output does not require grad")
        dout = torch.randn_like(out)

        def run():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        try:
            run()
        except NotImplementedError as e:
            raise ImplUnavailable(str(e)) from e
        return run
