"""Compile cache: an in-memory dict, then an on-disk store shared by processes, then a compile.

Generic: keys are any frozen, hashable values (for cute_fa's kernels, compile keys such as
``FwdConfig``, holding everything that changes the generated code and nothing else, so a new
sequence length or batch finds the same entry); what a miss compiles, and how an entry is
exported to bytes and loaded back, are functions the owner passes in (``cute_fa.compile``
passes the TVM-FFI export and load below).

On disk (default on; ``CUTE_FA_CACHE=0`` turns it off) entries live in
``$CUTE_FA_CACHE_DIR/<fingerprint>/`` (default base ``$XDG_CACHE_HOME/cute-fa``, else
``~/.cache/cute-fa``). The fingerprint covers the CuTe DSL and TVM-FFI versions, the DSL's CUDA
major version, the host machine type and the source of every module that shapes generated code
(``config``, ``cache``, ``planning``, ``compile``, ``dsl/`` and the arch packages), so a change
to any of them starts a fresh directory instead of loading a stale kernel.

One entry is one file: an 8-byte magic, the SHA-256 of the payload, the payload length, then
the payload (the compiled function exported as an object file, and the shared library linked
from it: Note [loading without the DSL]). A miss takes a per-entry file lock, looks again
(another process may have just written it), compiles, and writes the entry to a temporary file
in the same directory that ``os.replace`` moves into place, so a reader sees a complete entry or
none. An entry whose digest or length does not match (truncated, corrupt) or that fails to load
is compiled again and overwritten, never trusted. An unwritable directory turns the disk cache
off for the process with one warning.

Compiled forward kernels take torch tensors directly through TVM-FFI (``--enable-tvm-ffi``): no
per-call DLPack conversion in Python, argument checks compiled into the host stub, and the
launch goes to torch's current CUDA stream (the TVM-FFI environment stream).

Note [loading without the DSL]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A disk hit should cost milliseconds, and importing the CuTe DSL (its MLIR bindings) costs about
a second. The exported object file needs only two libraries at run time: the DSL's runtime
(``libcute_dsl_runtime.so``: CUDA library loading and launch) and TVM-FFI's. So when an entry is
written, the object file is also linked with the system linker (``ld -shared -z defs -z now``,
those two libraries as dependencies, named by soname, no paths) into a shared library, and the
payload holds both. A load preloads the runtime library (found beside the installed DSL, or
through ``CUTE_DSL_LIBS`` as the DSL itself looks), writes the shared library to a temporary
file, and opens it with ``tvm_ffi.load_module``: the DSL is not imported. The object file stays
in the payload for hosts where that fails (no linker when it was written, a ``noexec``
temporary directory): it is loaded through the DSL's JIT linker, as before. The fingerprint is
read from package metadata and the runtime library's folder (``cu12``/``cu13``) for the same
reason, with an import of the DSL only when those are not there. ``CUTE_FA_LINKER`` names the
linker (``0`` writes object files only).

Note [no garbage collection during a compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Tracing a kernel allocates hundreds of thousands of short-lived Python objects, so the cyclic
garbage collector runs hundreds of times during one compile, and a few of those runs are full
passes over every object of the process: with torch imported that is a few hundred thousand
long-lived objects that the compile never touches. On the development machine (sm80 forward,
bf16 d128, torch imported) that was 0.37 s of CPU in 244 passes, two full passes making 0.28 s
of it. ``gc_paused()`` turns the collector off while a compile and its export run
(``CompileCache._compile``, ``_serialize_timed``) and back on after, if it was on; the first
young pass after that frees the compile's garbage (0.09 s there, so about 0.28 s saved). It
changes no generated code.

Step timings
~~~~~~~~~~~~
``step_seconds()`` sums, per process, the seconds of each step behind first calls: importing
the DSL and the kernel's modules, ``cute.compile``, the export to an object file, the link,
the fingerprint, importing TVM-FFI, and loading an entry. ``python -m cute_fa bench
--compile-time`` prints them beside a first call's total.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from . import settings

ENV_CACHE = settings.CACHE
ENV_CACHE_DIR = settings.CACHE_DIR
ENV_LINKER = settings.LINKER
SLOW_COMPILE_S = 1.0

_MAGIC = b"CUTEFA01"
_HEADER = struct.Struct("<8s32sQ")  # magic, sha256(payload), len(payload)

# Modules whose source shapes generated code (relative to the cute_fa package) and the arch
# packages mapped into it. Edits elsewhere (interface, bench, CLI) keep the cache valid.
_KEY_SOURCES = ("config.py", "cache.py", "planning.py", "compile.py", "dsl")
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


_steps: dict[str, float] = {}
_open_steps = threading.local()  # per thread: seconds of finished inner steps, per open step


@contextlib.contextmanager
def step(name: str):
    """Adds the seconds of the ``with`` body to ``step_seconds()[name]``, less those of steps
    inside it (each step counts its own time only)."""
    stack = _open_steps.__dict__.setdefault("stack", [])
    stack.append(0.0)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - t0
        inner = stack.pop()
        if stack:
            stack[-1] += elapsed
        with _count_lock:
            _steps[name] = _steps.get(name, 0.0) + elapsed - inner


def step_seconds() -> dict[str, float]:
    """Seconds per step of this process's compiles and loads (module docstring, Step timings)."""
    with _count_lock:
        return dict(_steps)


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off for the ``with`` body, then as it was (Note [no
    garbage collection during a compile]). Nests, and threads may overlap: the collector
    comes back when the last one leaves."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


def import_tvm_ffi():
    """The ``tvm_ffi`` module; the first import in the process counts as a step."""
    module = sys.modules.get("tvm_ffi")
    if module is None:
        with step("import tvm_ffi"):
            import tvm_ffi as module
    return module


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


disk_cache_enabled = settings.disk_cache_enabled
cache_base_dir = settings.cache_base_dir


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


RUNTIME_LIBRARY = "libcute_dsl_runtime.so"


def _distribution_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def driver_cuda_version() -> int | None:
    """The CUDA driver's version (``cuDriverGetVersion`` through ctypes, e.g. 13000), None
    without a driver."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except (OSError, AttributeError):
        pass
    return None


def driver_cuda_major() -> int | None:
    """The CUDA driver's major version, None without a driver."""
    version = driver_cuda_version()
    return None if version is None else version // 1000


def dsl_version() -> str | None:
    """The installed nvidia-cutlass-dsl version (package metadata; no DSL import)."""
    return _distribution_version("nvidia-cutlass-dsl")


def package_version() -> str:
    """cute_fa's own installed version ("0.0.0" when not installed)."""
    return _distribution_version("cute-fa") or "0.0.0"


def pick_toolkit_flavor(flavors, driver_major: int | None) -> int | None:
    """The CUDA toolkit flavor (major version) of the installed CuTe DSL builds that the DSL
    loads: the newest the driver supports (major >= flavor), the newest of all without a
    driver; None when the driver supports none. (``nvidia-cutlass-dsl[cu13]`` installs the cu12
    and the cu13 build side by side; the DSL chooses this way in
    ``cutlass/_mlir/_mlir_libs/__init__.py``.)"""
    usable = [f for f in flavors if driver_major is None or driver_major >= f]
    return max(usable) if usable else None


@functools.lru_cache(maxsize=1)
def dsl_runtime_library() -> str | None:
    """Path of the CuTe DSL's runtime library, found as the DSL finds it (``CUTE_DSL_LIBS``,
    else ``cu<major>/lib`` in the installed package, the flavor the DSL loads:
    ``pick_toolkit_flavor``) but without importing the DSL; None when missing or ambiguous."""
    import importlib.util

    listed = settings.dsl_library_dirs()
    if listed:
        found = [p for p in listed if os.path.basename(p) == RUNTIME_LIBRARY]
        return found[0] if found and os.path.isfile(found[0]) else None
    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        return None
    roots = list(spec.submodule_search_locations or []) if spec else []
    pattern = f"cu*/lib/{RUNTIME_LIBRARY}"
    candidates = [p for root in roots for p in sorted(Path(root).glob(pattern))]
    by_flavor = {_runtime_cuda_major(str(p)): str(p) for p in candidates}
    if not candidates or None in by_flavor or len(by_flavor) != len(candidates):
        return None
    if len(by_flavor) == 1:
        return next(iter(by_flavor.values()))
    flavor = pick_toolkit_flavor(by_flavor, driver_cuda_major())
    return by_flavor[flavor] if flavor is not None else None


def _runtime_cuda_major(path: str | None) -> int | None:
    """CUDA major version of the DSL build the runtime library belongs to (its ``cuNN`` folder)."""
    if path is None:
        return None
    lib = Path(path).parent
    match = re.fullmatch(r"cu(\d+)", lib.parent.name) if lib.name == "lib" else None
    return int(match.group(1)) if match else None


def _toolchain_versions() -> list[str]:
    tvm_ffi = import_tvm_ffi()
    version = _distribution_version("nvidia-cutlass-dsl")
    cuda_major = _runtime_cuda_major(dsl_runtime_library())
    if version is None or cuda_major is None:  # no package metadata: ask the DSL itself
        import cutlass
        from cutlass.base_dsl.version_info import CUDA_VERSION

        version, cuda_major = cutlass.__version__, CUDA_VERSION.major
    return [
        f"cutlass-dsl {version}",
        f"dsl-cuda {cuda_major}",
        f"tvm-ffi {tvm_ffi.__version__}",
        f"machine {platform.machine()} {sys.platform}",
    ]


_fingerprint: str | None = None


def fingerprint() -> str:
    """16 hex digits naming this toolchain + source combination (see the module docstring)."""
    global _fingerprint
    if _fingerprint is None:
        versions = _toolchain_versions()
        with step("fingerprint"):
            h = hashlib.sha256()
            for line in versions:
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
        # Seconds spent, all keys together: compiling, serializing, loading (disk hits and the
        # load that follows a compile).
        self.seconds = {"compile": 0.0, "serialize": 0.0, "load": 0.0}

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

    def keys(self) -> list[Hashable]:
        """The keys held in memory, in the order they were first asked for."""
        return list(self._memory)

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
        from filelock import FileLock

        path = self._prepare_dir_and_path(key, stacklevel=2)
        if path is None:
            raise RuntimeError(f"cache directory {self.directory} is not writable")
        with FileLock(str(path) + ".lock"):
            if self._read_payload(path) is not None:
                return "hit"
            payload = self._serialize_timed(self._compile(key), symbol_for(key))
            self._store(path, payload, stacklevel=2)
        return "compiled"

    # ----------------------------------------------------------------------------------------

    def _compile(self, key: Hashable) -> Any:
        t0 = time.perf_counter()
        with gc_paused():
            compiled = self._compile_fn(key)
        elapsed = time.perf_counter() - t0
        self.seconds["compile"] += elapsed
        self.compiles += 1
        _count_compile()
        if self._verbose and elapsed > SLOW_COMPILE_S:
            name = getattr(key, "name", repr(key))
            print(f"cute_fa: compiling {name} (first call) ... {elapsed:.1f} s", file=sys.stderr)
        return compiled

    # The methods that may turn the disk off take the ``stacklevel`` of its warning, counted as
    # ``warnings.warn`` counts it: 1 is the method's caller. Each caller adds its own frame, so
    # the warning names the frame that called ``get`` or ``ensure_on_disk``.

    def _prepare_dir_and_path(self, key: Hashable, stacklevel: int) -> Path | None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._disable_disk(f"cannot create {self.directory}: {e}", stacklevel + 1)
            return None
        return self.path_for(key)

    def _disable_disk(self, why: str, stacklevel: int) -> None:
        self._disk = False
        warnings.warn(
            f"cute_fa: compile cache on disk turned off: {why}", stacklevel=stacklevel + 1
        )

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
            fn = self._load_timed(payload, symbol_for(key))
        except Exception as e:  # an intact file the loader rejects: recompile, don't crash
            self.rejected += 1
            warnings.warn(
                f"cute_fa: cache entry {path.name} did not load ({e}); recompiling", stacklevel=4
            )
            return None
        self.disk_hits += 1
        return fn

    def _store(self, path: Path, payload: bytes, stacklevel: int) -> None:
        try:
            atomic_write(path, pack_entry(payload))
        except OSError as e:
            self._disable_disk(f"cannot write {path}: {e}", stacklevel + 1)

    def _serialize_timed(self, compiled: Any, symbol: str) -> bytes:
        t0 = time.perf_counter()
        with gc_paused():
            payload = self._serialize(compiled, symbol)
        self.seconds["serialize"] += time.perf_counter() - t0
        return payload

    def _load_timed(self, payload: bytes, symbol: str) -> Callable:
        t0 = time.perf_counter()
        with step("load"):
            fn = self._load(payload, symbol)
        self.seconds["load"] += time.perf_counter() - t0
        return fn

    def _compile_to_callable(self, key: Hashable, path: Path | None) -> Callable:
        compiled = self._compile(key)
        if self._serialize is None or self._load is None:
            return compiled
        symbol = symbol_for(key)
        payload = self._serialize_timed(compiled, symbol)
        if path is not None:
            # stacklevel 4: this method (1), _get_uncached, its one caller (2), get (3), the
            # frame that called get (4)
            self._store(path, payload, stacklevel=4)
        return self._load_timed(payload, symbol)

    def _get_uncached(self, key: Hashable) -> Callable:
        # stacklevel 3: this method (1), get (2), the frame that called get (3)
        path = self._prepare_dir_and_path(key, stacklevel=3) if self._disk else None
        if path is None:
            return self._compile_to_callable(key, None)
        fn = self._try_load(path, key)
        if fn is not None:
            return fn
        from filelock import FileLock  # only a miss takes the lock

        try:
            lock = FileLock(str(path) + ".lock")
            lock.acquire()
        except OSError as e:
            self._disable_disk(f"cannot lock {path}: {e}", stacklevel=3)
            return self._compile_to_callable(key, None)
        try:
            fn = self._try_load(path, key)  # written by another process while we waited?
            if fn is not None:
                return fn
            return self._compile_to_callable(key, path)
        finally:
            lock.release()


# --------------------------------------------------------------------------------------------
# TVM-FFI compile, export (object file + shared library), load (Note [loading without the DSL])


# Payload: either a bare object file (ELF, written where no linker was found), or this header,
# the shared library and then the object file.
_SHARED_MAGIC = b"CUTEFASO"
_SHARED_HEADER = struct.Struct("<8sQ")  # magic, len(shared library)


def pack_tvm_ffi_payload(shared: bytes | None, obj: bytes) -> bytes:
    if shared is None:
        return obj
    return _SHARED_HEADER.pack(_SHARED_MAGIC, len(shared)) + shared + obj


def unpack_tvm_ffi_payload(payload: bytes) -> tuple[bytes | None, bytes]:
    """(shared library or None, object file) of a payload."""
    if not payload.startswith(_SHARED_MAGIC) or len(payload) < _SHARED_HEADER.size:
        return None, payload
    _, n = _SHARED_HEADER.unpack_from(payload)
    start = _SHARED_HEADER.size
    if start + n > len(payload):
        raise ValueError("truncated shared library in a cache payload")
    return payload[start : start + n], payload[start + n :]


def _linker_off() -> bool:
    return settings.linker() is None


def _linker() -> str | None:
    name = settings.linker()
    return None if name is None else shutil.which(name)


_warned: set[str] = set()


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(message, stacklevel=3)


def link_shared_library(obj: bytes) -> bytes | None:
    """``obj`` linked into a shared library that depends on the DSL runtime and TVM-FFI (by
    soname), or None where there is no linker, no runtime library, or the link fails."""
    if _linker_off():
        return None
    linker, runtime = _linker(), dsl_runtime_library()
    if linker is None or runtime is None:
        missing = "a linker (ld; or set CUTE_FA_LINKER)" if linker is None else RUNTIME_LIBRARY
        _warn_once(
            "link",
            f"cute_fa: {missing} not found: cache entries hold object files only, and loading "
            f"them imports the CuTe DSL (about a second per process)",
        )
        return None
    from tvm_ffi.libinfo import find_libtvm_ffi

    with tempfile.TemporaryDirectory(prefix="cute-fa-link-") as d:
        obj_path, lib_path = os.path.join(d, "module.o"), os.path.join(d, "module.so")
        with open(obj_path, "wb") as f:
            f.write(obj)
        cmd = [linker, "-shared", "-z", "defs", "-z", "now", "-o", lib_path, obj_path]
        cmd += [runtime, find_libtvm_ffi()]
        try:
            with step("link"):
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            why = "" if proc.returncode == 0 else proc.stderr.strip() or f"exit {proc.returncode}"
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
        if why:
            _warn_once(
                "link",
                f"cute_fa: linking a kernel into a shared library failed ({why[:300]}); cache "
                f"entries hold object files only, and loading them imports the CuTe DSL",
            )
            return None
        with open(lib_path, "rb") as f:
            return f.read()


def export_tvm_ffi(compiled: Any, symbol: str) -> bytes:
    """Payload of a TVM-FFI compiled function exported under ``symbol``: its object file, and
    the shared library linked from it where a linker is available."""
    with tempfile.TemporaryDirectory(prefix="cute-fa-export-") as d:
        path = os.path.join(d, "module.o")
        with step("export"):
            compiled.export_to_c(path, function_name=symbol)
        with open(path, "rb") as f:
            obj = f.read()
    return pack_tvm_ffi_payload(link_shared_library(obj), obj)


_runtime_handle: Any = None


def _load_shared_library(shared: bytes, symbol: str) -> Callable:
    """The function ``symbol`` of a linked shared library, through TVM-FFI alone."""
    import ctypes

    tvm_ffi = import_tvm_ffi()
    global _runtime_handle
    if _runtime_handle is None:
        runtime = dsl_runtime_library()
        if runtime is None:
            raise RuntimeError(f"{RUNTIME_LIBRARY} of the CuTe DSL not found")
        # Loaded first, so that the kernel library's dependency on it (by soname) resolves.
        _runtime_handle = ctypes.CDLL(runtime)
    with tempfile.TemporaryDirectory(prefix="cute-fa-load-") as d:
        path = os.path.join(d, f"{symbol}.so")
        with open(path, "wb") as f:
            f.write(shared)
        # The function holds the module (and the library) alive; the file may go after this.
        module = tvm_ffi.load_module(path, keep_module_alive=False)
        return module.get_function(symbol)


def _load_object_file(obj: bytes, symbol: str) -> Callable:
    """The function ``symbol`` of an exported object file, through the DSL's JIT linker."""
    from cutlass.cute.runtime import load_module

    with tempfile.TemporaryDirectory(prefix="cute-fa-load-") as d:
        path = os.path.join(d, "module.o")
        with open(path, "wb") as f:
            f.write(obj)
        module = load_module(path, enable_tvm_ffi=True)  # reads the file; it may go after this
        return getattr(module, symbol)


def load_tvm_ffi(payload: bytes, symbol: str) -> Callable:
    """The ``tvm_ffi.Function`` named ``symbol`` in an ``export_tvm_ffi`` payload: from the
    shared library without importing the DSL, else from the object file through the DSL."""
    shared, obj = unpack_tvm_ffi_payload(payload)
    if shared is not None:
        try:
            return _load_shared_library(shared, symbol)
        except Exception as e:  # e.g. a noexec temporary directory: the object file still loads
            _warn_once(
                "load",
                f"cute_fa: a cached kernel did not load as a shared library ({e}); loading "
                f"object files through the CuTe DSL instead",
            )
    return _load_object_file(obj, symbol)
