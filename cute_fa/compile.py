"""Kernel compilation: compile keys -> compiled, launchable kernels, through the caches.

``compile_fwd`` / ``compile_bwd`` / ``compile_bwd_pre`` / ``compile_bwd_post`` trace a kernel
class (``cute_fa.planning`` names it) on fake arguments (``cute_fa.dsl.fake``: shapes and
strides dynamic) and ``cute.compile`` it with TVM-FFI for the config's target; ``fwd_cache()``
and the backward caches keep the results (``cute_fa.cache``: memory, disk, compile). Compiled
kernels take torch tensors directly through TVM-FFI and launch on torch's current CUDA stream
(the TVM-FFI environment stream). ``precompile_task`` fills the disk cache for
``python -m cute_fa precompile``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

from .cache import CompileCache, export_tvm_ffi, load_tvm_ffi, step
from .config import BwdConfig
from .planning import bwd_kernel_classes, fwd_kernel_class


def compile_tvm_ffi(kernel: Any, args: tuple, target: str) -> Any:
    """``cute.compile`` of ``kernel`` with TVM-FFI for ``target``, for ``export_tvm_ffi``.

    The trailing stream argument becomes TVM-FFI's environment stream (torch's current stream
    at call time), so the compiled function takes no stream argument. No JIT engine is built:
    the result is exported and loaded from its object file (on a GPU host the DSL would
    otherwise also generate and link host code for an in-process engine nobody calls).
    """
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    args = (*args[:-1], make_fake_stream(use_tvm_ffi_env_stream=True))
    # Tracing allocates millions of short-lived objects, few in cycles: with the collector on,
    # its generation-2 passes over the DSL's and torch's objects cost 50-100 ms a compile.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with step("cute.compile"):
            return cute.compile(
                kernel, *args, options=f"--gpu-arch {target} --enable-tvm-ffi", no_jit_engine=True
            )
    finally:
        if collecting:
            gc.enable()


def compile_fwd(config) -> Any:
    """``cute.compile`` of the forward kernel for ``config`` (TVM-FFI, environment stream)."""
    with step("import DSL"):  # the first time: the CuTe DSL and the kernel's modules
        kernel_class = fwd_kernel_class(config.arch)
        from .dsl.fake import fwd_fake_args

    kernel = kernel_class(config)
    return compile_tvm_ffi(kernel, fwd_fake_args(config), config.target)


def compile_bwd(config: BwdConfig):
    """Compiled main backward kernel of ``config`` (arguments: the backward protocol)."""
    with step("import DSL"):
        from .dsl.fake import bwd_fake_args

    _, main_cls, _ = bwd_kernel_classes(config.arch)
    return compile_tvm_ffi(main_cls(config), bwd_fake_args(config), config.target)


def compile_bwd_pre(config):
    """Compiled preprocess kernel of a ``BwdPreConfig``."""
    pre_cls, _, _ = bwd_kernel_classes(config.arch)
    return compile_tvm_ffi(pre_cls(config), pre_cls.fake_args(config), config.target)


def compile_bwd_post(config):
    """Compiled postprocess kernel of a ``BwdPostConfig``."""
    _, _, post_cls = bwd_kernel_classes(config.arch)
    return compile_tvm_ffi(post_cls(config), post_cls.fake_args(config), config.target)


_caches: dict[str, CompileCache] = {}


def _cache(name: str, compile_fn) -> CompileCache:
    cache = _caches.get(name)
    if cache is None:
        cache = _caches.setdefault(name, CompileCache(compile_fn, export_tvm_ffi, load_tvm_ffi))
    return cache


def compile_combine(config):
    """Compiled split-KV combine kernel of a ``CombineConfig`` (``ampere/flash_combine.py``)."""
    with step("import DSL"):
        from .ampere.flash_combine import FlashAttentionCombine

    kernel = FlashAttentionCombine(config)
    return compile_tvm_ffi(kernel, FlashAttentionCombine.fake_args(config), config.target)


def combine_cache() -> CompileCache:
    """The process-wide cache of split-KV combine kernels."""
    return _cache("combine", compile_combine)


def bwd_cache() -> CompileCache:
    """The process-wide cache of main backward kernels."""
    return _cache("main", compile_bwd)


def bwd_pre_cache() -> CompileCache:
    """The process-wide cache of backward preprocess kernels."""
    return _cache("pre", compile_bwd_pre)


def bwd_post_cache() -> CompileCache:
    """The process-wide cache of backward postprocess kernels."""
    return _cache("post", compile_bwd_post)


# --------------------------------------------------------------------------------------------
# The forward kernels' cache and precompile tasks


_fwd_cache: CompileCache | None = None


def fwd_cache() -> CompileCache:
    """The process-wide cache of forward kernels."""
    global _fwd_cache
    if _fwd_cache is None:
        _fwd_cache = CompileCache(compile_fwd, export_tvm_ffi, load_tvm_ffi)
    return _fwd_cache


@dataclass(frozen=True)
class PrecompileTask:
    """One kernel for ``python -m cute_fa precompile``: which cache (``kind``: "fwd", or "bwd",
    "bwd-pre", "bwd-post" for the backward's main, preprocess and postprocess kernels,
    "combine" for the split-KV combine) and its
    compile key. Picklable, so that worker processes can receive it."""

    kind: str
    config: Any

    @property
    def name(self) -> str:
        return getattr(self.config, "name", repr(self.config))


def _task_cache(kind: str) -> CompileCache:
    caches = {
        "fwd": fwd_cache,
        "bwd": bwd_cache,
        "bwd-pre": bwd_pre_cache,
        "bwd-post": bwd_post_cache,
        "combine": combine_cache,
    }
    if kind not in caches:
        raise ValueError(f"unknown precompile task kind {kind!r}")
    return caches[kind]()


def precompile_task(task: PrecompileTask) -> tuple[str, float]:
    """Make sure the kernel of ``task`` is on disk: ("hit" or "compiled", seconds).

    A module-level function, so that ``python -m cute_fa precompile --jobs N`` can send it to
    worker processes (functions of ``__main__`` cannot be pickled into spawned workers when
    the program runs as ``python -m``).
    """
    t0 = time.perf_counter()
    status = _task_cache(task.kind).ensure_on_disk(task.config)
    return status, time.perf_counter() - t0
