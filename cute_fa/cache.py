"""Compile cache: an in-memory dict, then an on-disk store shared by processes, then a compile.

Keys are compile keys (``FwdConfig``): frozen, hashable, holding everything that changes the
generated code and nothing else, so a new sequence length or batch finds the same entry.

On disk (default on; ``CUTE_FA_CACHE=0`` turns it off) entries live in
``$CUTE_FA_CACHE_DIR/<fingerprint>/`` (default base ``$XDG_CACHE_HOME/cute-fa``, else
``~/.cache/cute-fa``). The fingerprint covers the CuTe DSL and TVM-FFI versions, the DSL's CUDA
major version, the host machine type and the source of every module that shapes generated code
(``config``, ``cache``, ``dispatch``, ``dsl/`` and the arch packages), so a change to any of them
starts a fresh directory instead of loading a stale kernel.

One entry is one file: an 8-byte magic, the SHA-256 of the payload, the payload length, then
the payload (the compiled function exported as an object file). A miss takes a per-entry file
lock, looks again (another process may have just written it), compiles, and writes the entry to
a temporary file in the same directory that ``os.replace`` moves into place, so a reader sees a
complete entry or none. An entry whose digest or length does not match (truncated, corrupt) or
that fails to load is compiled again and overwritten, never trusted. An unwritable directory
turns the disk cache off for the process with one warning.

Compiled forward kernels take torch tensors directly through TVM-FFI (``--enable-tvm-ffi``): no
per-call DLPack conversion in Python, argument checks compiled into the host stub, and the
launch goes to torch's current CUDA stream (the TVM-FFI environment stream).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from filelock import FileLock

ENV_CACHE = "CUTE_FA_CACHE"
ENV_CACHE_DIR = "CUTE_FA_CACHE_DIR"
SLOW_COMPILE_S = 1.0

_MAGIC = b"CUTEFA01"
_HEADER = struct.Struct("<8s32sQ")  # magic, sha256(payload), len(payload)

# Modules whose source shapes generated code (relative to the cute_fa package) and the arch
# packages mapped into it. Edits elsewhere (interface, bench, CLI) keep the cache valid.
_KEY_SOURCES = ("config.py", "cache.py", "dispatch.py", "dsl")
_ARCH_PACKAGES = ("cute_fa.ampere", "cute_fa.hopper", "cute_fa.blackwell")

_compile_count = 0
_count_lock = threading.Lock()


def compile_count() -> int:
    """Number of kernel compiles this process has run (all caches together)."""
    return _compile_count


def _count_compile() -> None:
    global _compile_count
    with _count_lock:
        _compile_count += 1


# --------------------------------------------------------------------------------------------
# Entry format and atomic writes


def pack_entry(payload: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, hashlib.sha256(payload).digest(), len(payload)) + payload


def unpack_entry(blob: bytes) -> bytes | None:
    """The payload of a complete, intact entry; None for anything else."""
    if len(blob) < _HEADER.size:
        return None
    magic, digest, length = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size :]
    if magic != _MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# --------------------------------------------------------------------------------------------
# Cache directory


def disk_cache_enabled() -> bool:
    return os.environ.get(ENV_CACHE, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_base_dir() -> Path:
    base = os.environ.get(ENV_CACHE_DIR)
    if base:
        return Path(base).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cute-fa"


def _source_files() -> list[tuple[str, Path]]:
    import importlib.util

    files = []
    here = Path(__file__).resolve().parent
    for rel in _KEY_SOURCES:
        p = here / rel
        if p.is_dir():
            files += [(f"cute_fa/{q.relative_to(here)}", q) for q in sorted(p.rglob("*.py"))]
        elif p.exists():
            files.append((f"cute_fa/{rel}", p))
    for name in _ARCH_PACKAGES:
        spec = importlib.util.find_spec(name)
        for loc in (spec.submodule_search_locations or []) if spec else []:
            root = Path(loc)
            files += [(f"{name}/{q.relative_to(root)}", q) for q in sorted(root.rglob("*.py"))]
    return files


def _toolchain_versions() -> list[str]:
    import cutlass
    import tvm_ffi
    from cutlass.base_dsl.version_info import CUDA_VERSION

    return [
        f"cutlass-dsl {cutlass.__version__}",
        f"dsl-cuda {CUDA_VERSION.major}",
        f"tvm-ffi {tvm_ffi.__version__}",
        f"machine {platform.machine()} {sys.platform}",
    ]


_fingerprint: str | None = None


def fingerprint() -> str:
    """16 hex digits naming this toolchain + source combination (see the module docstring)."""
    global _fingerprint
    if _fingerprint is None:
        h = hashlib.sha256()
        for line in _toolchain_versions():
            h.update(line.encode() + b"\n")
        for rel, path in _source_files():
            h.update(rel.encode() + b"\n")
            h.update(hashlib.sha256(path.read_bytes()).digest())
        _fingerprint = h.hexdigest()[:16]
    return _fingerprint


def default_cache_dir() -> Path:
    return cache_base_dir() / fingerprint()


# --------------------------------------------------------------------------------------------
# The cache


def key_digest(key: Hashable) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:20]


def entry_name(key: Hashable) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(getattr(key, "name", "entry")))[:150]
    return f"{name}-{key_digest(key)}.bin"


def symbol_for(key: Hashable) -> str:
    """C symbol prefix of an exported entry: unique per key, a valid identifier."""
    return f"cute_fa_{key_digest(key)}"


class CompileCache:
    """Compile-once cache of callables, keyed by compile key.

    ``compile_fn(key)`` builds a compiled object; ``serialize(compiled, symbol) -> bytes`` and
    ``load(bytes, symbol) -> callable`` turn it into the callable the cache hands out, also
    right after a compile (so a fresh compile and a disk hit give the same kind of callable,
    and cross-compiled objects, which cannot run in the compiling process, still can). Without
    ``serialize``/``load`` the compiled object itself is the callable and nothing goes to disk.
    ``directory``: None for the default (``default_cache_dir()``, created on first use), or a
    path; ``disk``: None to follow ``CUTE_FA_CACHE``, or a bool.
    """

    def __init__(
        self,
        compile_fn: Callable[[Hashable], Any],
        serialize: Callable[[Any, str], bytes] | None = None,
        load: Callable[[bytes, str], Callable] | None = None,
        *,
        directory: str | os.PathLike | None = None,
        disk: bool | None = None,
        verbose: bool = True,
    ):
        self._compile_fn = compile_fn
        self._serialize = serialize
        self._load = load
        self._directory = Path(directory) if directory is not None else None
        if disk is None:
            disk = disk_cache_enabled()
        self._disk = bool(disk) and serialize is not None and load is not None
        self._verbose = verbose
        self._memory: dict[Hashable, Callable] = {}
        self._lock = threading.RLock()
        self.compiles = 0  # compiles run by this cache
        self.disk_hits = 0  # entries loaded from disk
        self.rejected = 0  # disk entries found corrupt or unloadable (then recompiled)

    @property
    def disk_enabled(self) -> bool:
        return self._disk

    @property
    def directory(self) -> Path:
        if self._directory is None:
            self._directory = default_cache_dir()
        return self._directory

    def path_for(self, key: Hashable) -> Path:
        return self.directory / entry_name(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._memory

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()

    def get(self, key: Hashable) -> Callable:
        """The callable for ``key``: from memory, else from disk, else compiled (and stored)."""
        fn = self._memory.get(key)
        if fn is None:
            with self._lock:
                fn = self._memory.get(key)
                if fn is None:
                    fn = self._get_uncached(key)
                    self._memory[key] = fn
        return fn

    def ensure_on_disk(self, key: Hashable) -> str:
        """Make sure ``key`` has a valid disk entry, without loading it. Returns "hit" or
        "compiled" (what ``precompile`` uses: it works without a GPU)."""
        if not self._disk:
            raise RuntimeError("the disk cache is off (CUTE_FA_CACHE=0)")
        path = self._prepare_dir_and_path(key)
        if path is None:
            raise RuntimeError(f"cache directory {self.directory} is not writable")
        with FileLock(str(path) + ".lock"):
            if self._read_payload(path) is not None:
                return "hit"
            self._store(path, self._serialize(self._compile(key), symbol_for(key)))
        return "compiled"

    # ----------------------------------------------------------------------------------------

    def _compile(self, key: Hashable) -> Any:
        t0 = time.perf_counter()
        compiled = self._compile_fn(key)
        elapsed = time.perf_counter() - t0
        self.compiles += 1
        _count_compile()
        if self._verbose and elapsed > SLOW_COMPILE_S:
            name = getattr(key, "name", repr(key))
            print(f"cute_fa: compiling {name} (first call) ... {elapsed:.1f} s", file=sys.stderr)
        return compiled

    def _prepare_dir_and_path(self, key: Hashable) -> Path | None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._disable_disk(f"cannot create {self.directory}: {e}")
            return None
        return self.path_for(key)

    def _disable_disk(self, why: str) -> None:
        self._disk = False
        warnings.warn(f"cute_fa: compile cache on disk turned off: {why}", stacklevel=3)

    def _read_payload(self, path: Path) -> bytes | None:
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            return None
        payload = unpack_entry(blob)
        if payload is None:
            self.rejected += 1
        return payload

    def _try_load(self, path: Path, key: Hashable) -> Callable | None:
        payload = self._read_payload(path)
        if payload is None:
            return None
        try:
            fn = self._load(payload, symbol_for(key))
        except Exception as e:  # an intact file the loader rejects: recompile, don't crash
            self.rejected += 1
            warnings.warn(
                f"cute_fa: cache entry {path.name} did not load ({e}); recompiling", stacklevel=4
            )
            return None
        self.disk_hits += 1
        return fn

    def _store(self, path: Path, payload: bytes) -> None:
        try:
            atomic_write(path, pack_entry(payload))
        except OSError as e:
            self._disable_disk(f"cannot write {path}: {e}")

    def _compile_to_callable(self, key: Hashable, path: Path | None) -> Callable:
        compiled = self._compile(key)
        if self._serialize is None or self._load is None:
            return compiled
        symbol = symbol_for(key)
        payload = self._serialize(compiled, symbol)
        if path is not None:
            self._store(path, payload)
        return self._load(payload, symbol)

    def _get_uncached(self, key: Hashable) -> Callable:
        path = self._prepare_dir_and_path(key) if self._disk else None
        if path is None:
            return self._compile_to_callable(key, None)
        fn = self._try_load(path, key)
        if fn is not None:
            return fn
        try:
            lock = FileLock(str(path) + ".lock")
            lock.acquire()
        except OSError as e:
            self._disable_disk(f"cannot lock {path}: {e}")
            return self._compile_to_callable(key, None)
        try:
            fn = self._try_load(path, key)  # written by another process while we waited?
            if fn is not None:
                return fn
            return self._compile_to_callable(key, path)
        finally:
            lock.release()


# --------------------------------------------------------------------------------------------
# The forward kernels' cache: TVM-FFI compile, export to an object file, load


def compile_fwd(config) -> Any:
    """``cute.compile`` of the forward kernel for ``config`` (TVM-FFI, environment stream)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .dispatch import fwd_kernel_class
    from .dsl.fake import fwd_fake_args

    kernel = fwd_kernel_class(config.arch)(config)
    # The stream is TVM-FFI's environment stream: torch's current stream at call time, so the
    # compiled function takes no stream argument.
    args = (*fwd_fake_args(config)[:-1], make_fake_stream(use_tvm_ffi_env_stream=True))
    return cute.compile(kernel, *args, options=f"--gpu-arch {config.target} --enable-tvm-ffi")


def export_tvm_ffi(compiled: Any, symbol: str) -> bytes:
    """Object-file bytes of a TVM-FFI compiled function, exported under ``symbol``."""
    with tempfile.TemporaryDirectory(prefix="cute-fa-export-") as d:
        path = os.path.join(d, "module.o")
        compiled.export_to_c(path, function_name=symbol)
        with open(path, "rb") as f:
            return f.read()


def load_tvm_ffi(payload: bytes, symbol: str) -> Callable:
    """The ``tvm_ffi.Function`` named ``symbol`` in exported object-file bytes."""
    from cutlass.cute.runtime import load_module

    with tempfile.TemporaryDirectory(prefix="cute-fa-load-") as d:
        path = os.path.join(d, "module.o")
        with open(path, "wb") as f:
            f.write(payload)
        module = load_module(path, enable_tvm_ffi=True)  # reads the file; it may go after this
        return getattr(module, symbol)


_fwd_cache: CompileCache | None = None


def fwd_cache() -> CompileCache:
    """The process-wide cache of forward kernels."""
    global _fwd_cache
    if _fwd_cache is None:
        _fwd_cache = CompileCache(compile_fwd, export_tvm_ffi, load_tvm_ffi)
    return _fwd_cache
