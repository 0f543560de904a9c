"""What every attention kernel class does with its compile key before any tracing."""

from __future__ import annotations

from .fake import DTYPE


class AttentionKernel:
    """Base of the attention kernel classes (forward and backward, every arch).

    ``__init__`` validates the compile key with the class's ``can_implement`` (NotImplementedError
    naming the class and the reason) and keeps the static values the device code reads: dtype,
    tile shape, head dims, threads and the mask/softcap flags. Subclasses add their own.
    """

    arch: int

    def __init__(self, config) -> None:
        ok, reason = self.can_implement(config)
        if not ok:
            raise NotImplementedError(f"{type(self).__name__}: {reason}")
        self.config = config
        self.dtype = DTYPE[config.dtype]
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.tile_hdim = config.head_dim
        self.tile_hdimv = config.head_dim_v
        self.num_warps = config.num_warps
        self.num_threads = config.num_warps * 32
        self.causal = config.causal
        self.local = config.local
        self.has_softcap = config.has_softcap

    @staticmethod
    def can_implement(config) -> tuple[bool, str]:
        raise NotImplementedError
