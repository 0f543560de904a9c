"""The compile cache: memory and disk hits, corrupt entries, concurrent processes, the real
TVM-FFI export/load path (with a tiny kernel of its own), and compile keys that ignore shapes.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import pytest
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from cute_fa import cache
from cute_fa.cache import CompileCache, atomic_write, pack_entry, unpack_entry


@dataclass(frozen=True)
class Key:
    name: str
    flag: bool = False


class FakeBackend:
    """compile -> bytes, serialize = identity, load -> a callable returning the bytes."""

    def __init__(self, delay: float = 0.0, marker_dir: Path | None = None):
        self.delay = delay
        self.marker_dir = marker_dir
        self.compiled: list = []
        self.loaded: list = []

    def compile(self, key):
        time.sleep(self.delay)
        self.compiled.append(key)
        if self.marker_dir is not None:  # visible across processes
            (self.marker_dir / f"compile-{os.getpid()}-{len(self.compiled)}").touch()
        return f"kernel for {key!r}".encode() * 100

    @staticmethod
    def serialize(compiled, symbol):
        return compiled

    def load(self, payload, symbol):
        self.loaded.append(symbol)
        return lambda: payload

    def cache(self, directory, **kw) -> CompileCache:
        return CompileCache(
            self.compile,
            self.serialize,
            self.load,
            directory=directory,
            **kw,
        )


def entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.bin"))


def test_memory_then_disk_then_compile(tmp_path):
    backend = FakeBackend()
    c = backend.cache(tmp_path, disk=True)
    before = cache.compile_count()
    fn = c.get(Key("a"))
    assert fn() == backend.compile(Key("a")) and c.compiles == 1
    assert c.get(Key("a")) is fn and c.compiles == 1  # memory hit
    assert cache.compile_count() == before + 1
    assert [p.name for p in entries(tmp_path)] == [cache.entry_name(Key("a"))]

    other = FakeBackend()
    c2 = other.cache(tmp_path, disk=True)  # as a new process would
    assert c2.get(Key("a"))() == fn() and c2.compiles == 0 and c2.disk_hits == 1
    c2.get(Key("a", flag=True))
    assert c2.compiles == 1 and len(entries(tmp_path)) == 2


def test_disk_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE, "0")
    backend = FakeBackend()
    c = backend.cache(tmp_path)
    assert not c.disk_enabled
    c.get(Key("a"))
    assert c.compiles == 1 and entries(tmp_path) == []
    monkeypatch.setenv(cache.ENV_CACHE, "1")
    assert backend.cache(tmp_path).disk_enabled


def test_default_directory_has_a_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    fp = cache.fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert cache.default_cache_dir() == tmp_path / fp
    sources = {rel for rel, _ in cache._source_files()}
    assert "cute_fa.ampere/flash_fwd.py" in sources and "cute_fa/dsl/fake.py" in sources
    assert "cute_fa/config.py" in sources and "cute_fa/interface.py" not in sources


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_damaged_entry_is_recompiled(tmp_path, damage):
    backend = FakeBackend()
    backend.cache(tmp_path, disk=True).get(Key("a"))
    (path,) = entries(tmp_path)
    blob = path.read_bytes()
    damaged = {
        "truncate": blob[: len(blob) // 2],
        "flip": blob[:-1] + bytes([blob[-1] ^ 1]),
        "empty": b"",
        "garbage": b"\x7fELF" + os.urandom(200),
    }[damage]
    path.write_bytes(damaged)
    c = backend.cache(tmp_path, disk=True)
    fn = c.get(Key("a"))
    assert fn() == backend.compile(Key("a"))
    # found damaged twice: before the entry lock and again under it (another process may
    # have rewritten it meanwhile), then recompiled
    assert c.compiles == 1 and c.disk_hits == 0 and c.rejected == 2
    assert path.read_bytes() == blob  # rewritten whole


def test_entry_the_loader_rejects_is_recompiled(tmp_path):
    """An intact entry the loader cannot use (say, from another toolchain) is replaced."""
    backend = FakeBackend()
    tmp_path.joinpath(cache.entry_name(Key("a"))).write_bytes(pack_entry(b"incompatible"))

    def picky_load(payload, symbol):
        if payload == b"incompatible":
            raise RuntimeError("symbol not found")
        return lambda: payload

    c = CompileCache(backend.compile, backend.serialize, picky_load, directory=tmp_path, disk=True)
    with pytest.warns(UserWarning, match="did not load"):
        fn = c.get(Key("a"))
    assert c.compiles == 1 and fn() == backend.compile(Key("a"))
    assert unpack_entry(tmp_path.joinpath(cache.entry_name(Key("a"))).read_bytes()) == fn()


def test_unwritable_directory_falls_back_to_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    backend = FakeBackend()
    c = backend.cache(blocker / "cache", disk=True)
    with pytest.warns(UserWarning, match="compile cache on disk turned off"):
        fn = c.get(Key("a"))
    assert fn() and c.compiles == 1 and not c.disk_enabled


def test_slow_compile_prints_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cache, "SLOW_COMPILE_S", 0.0)
    FakeBackend().cache(tmp_path, disk=False).get(Key("fwd_demo"))
    err = capsys.readouterr().err
    assert err.startswith("cute_fa: compiling fwd_demo (first call) ... ") and err.endswith(" s\n")
    assert err.count("\n") == 1


def test_no_garbage_collection_during_a_compile(tmp_path):
    """Note [no garbage collection during a compile]: off while compiling and serializing,
    back as it was after, also when the compile raises; nested pauses restore it once."""
    import gc

    seen = []

    def compile_fn(key):
        seen.append(("compile", gc.isenabled()))
        if key.flag:
            raise RuntimeError("compile failed")
        return b"kernel"

    def serialize(compiled, symbol):
        seen.append(("serialize", gc.isenabled()))
        return compiled

    def load(payload, symbol):
        seen.append(("load", gc.isenabled()))
        return lambda: payload

    c = CompileCache(compile_fn, serialize, load, directory=tmp_path, disk=True)
    assert gc.isenabled()
    c.get(Key("a"))
    assert seen == [("compile", False), ("serialize", False), ("load", True)]
    with pytest.raises(RuntimeError, match="compile failed"):
        c.get(Key("b", flag=True))
    assert gc.isenabled()

    with cache.gc_paused():
        with cache.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:  # a collector the program turned off stays off
        with cache.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_step_seconds_count_each_step_once(monkeypatch):
    monkeypatch.setattr(cache, "_steps", {})
    with cache.step("outer"):
        time.sleep(0.02)
        with cache.step("inner"):
            time.sleep(0.03)
    with cache.step("inner"):
        time.sleep(0.01)
    steps = cache.step_seconds()
    assert 0.02 <= steps["outer"] < 0.03 + 0.02  # its own time, not the inner step's
    assert steps["inner"] >= 0.04


def test_keys_in_order(tmp_path):
    c = FakeBackend().cache(tmp_path, disk=False)
    for name in "bab":
        c.get(Key(name))
    assert c.keys() == [Key("b"), Key("a")]


def test_ensure_on_disk(tmp_path):
    backend = FakeBackend()
    c = backend.cache(tmp_path, disk=True)
    assert c.ensure_on_disk(Key("a")) == "compiled"
    assert c.ensure_on_disk(Key("a")) == "hit"
    assert backend.loaded == [] and Key("a") not in c  # stored, not loaded


def test_entry_format():
    payload = b"\x00\x01payload" * 10
    blob = pack_entry(payload)
    assert unpack_entry(blob) == payload
    assert unpack_entry(blob[:-1]) is None
    assert unpack_entry(blob + b"x") is None
    assert unpack_entry(b"CUTEFA00" + blob[8:]) is None
    assert unpack_entry(b"") is None


def test_atomic_write_leaves_no_temporaries(tmp_path):
    path = tmp_path / "entry.bin"
    atomic_write(path, b"one")
    atomic_write(path, b"two")
    assert path.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["entry.bin"]


def test_no_recompile_for_new_shapes(tmp_path):
    """Calls that differ only in batch, sequence lengths or head counts share one compile."""
    import torch

    from cute_fa import checks, planning

    backend = FakeBackend()
    c = backend.cache(tmp_path, disk=True)
    for b, sq, sk, h, hk in [(1, 1, 1, 2, 1), (4, 1000, 77, 8, 2), (2, 4096, 8192, 16, 16)]:
        q = torch.empty(b, sq, h, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(b, sk, hk, 128, dtype=torch.bfloat16, device="meta")
        s = checks.check_metadata(q, k, k, None, None, None, None, causal=True)
        request = planning.FwdRequest("bf16", s.head_dim, s.head_dim_v, causal=True)
        c.get(planning.fwd_plan((8, 0), request)[1])
    assert c.compiles == 1 and len(entries(tmp_path)) == 1


# --------------------------------------------------------------------------------------------
# Several processes


def _get_in_process(directory, marker_dir, barrier, results):
    backend = FakeBackend(delay=0.3, marker_dir=Path(marker_dir))
    c = backend.cache(Path(directory), disk=True, verbose=False)
    barrier.wait()
    results.put(c.get(Key("shared"))())


def test_concurrent_processes_compile_once(tmp_path):
    """Processes missing the same key at once: one compiles, the others wait and load it."""
    ctx = multiprocessing.get_context("fork")
    markers = tmp_path / "markers"
    markers.mkdir()
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_get_in_process, args=(tmp_path / "c", markers, barrier, results))
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(set(got)) == 1 and got[0] == FakeBackend().compile(Key("shared"))
    assert len(list(markers.iterdir())) == 1  # compiled exactly once
    assert len(entries(tmp_path / "c")) == 1
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.endswith(".tmp")]


def _write_many(path, tag, rounds):
    for i in range(rounds):
        atomic_write(Path(path), pack_entry(bytes([tag, i % 256]) * (50_000 + 997 * tag)))


def _read_many(path, rounds, bad):
    seen = 0
    for _ in range(rounds):
        try:
            blob = Path(path).read_bytes()
        except FileNotFoundError:
            continue
        seen += 1
        if unpack_entry(blob) is None:
            bad.value += 1
    assert seen > 0


def test_concurrent_writers_never_expose_a_partial_entry(tmp_path):
    ctx = multiprocessing.get_context("fork")
    path = tmp_path / "entry.bin"
    atomic_write(path, pack_entry(b"initial"))
    bad = ctx.Value("i", 0)
    writers = [ctx.Process(target=_write_many, args=(path, t, 40)) for t in range(3)]
    reader = ctx.Process(target=_read_many, args=(path, 400, bad))
    for p in [*writers, reader]:
        p.start()
    for p in [*writers, reader]:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert bad.value == 0
    assert unpack_entry(path.read_bytes()) is not None
    assert [p.name for p in tmp_path.iterdir()] == ["entry.bin"]


# --------------------------------------------------------------------------------------------
# The real path: a tiny CuTe kernel through TVM-FFI compile, object-file export and load


@dataclass(frozen=True)
class ScaleKey:
    """Compile key of the test kernel: y = alpha * x (+ bias)."""

    with_bias: bool
    target: str = "sm_80"

    @property
    def name(self) -> str:
        return f"test_scale_{self.target}" + ("_bias" if self.with_bias else "")


def _compile_scale(key: ScaleKey):
    n = cute.sym_int()
    x = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    y = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    bias = (
        make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16) if key.with_bias else None
    )
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        ScaleKernel(), x, y, cutlass.Float32(1.0), bias, stream,
        options=f"--gpu-arch {key.target} --enable-tvm-ffi",
    )  # fmt: skip


class ScaleKernel:
    """y = alpha * x (+ bias): an optional tensor, a scalar and the environment stream, like the
    forward protocol."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mY: cute.Tensor,
        alpha: cutlass.Float32,
        mBias: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        grid = (cute.ceil_div(mX.shape[0], 128), 1, 1)
        self.kernel(mX, mY, alpha, mBias).launch(grid=grid, block=(128, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self, mX: cute.Tensor, mY: cute.Tensor, alpha: cutlass.Float32, mBias: cute.Tensor | None
    ):
        bidx, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        i = bidx * 128 + tidx
        if i < mX.shape[0]:
            value = mX[i] * alpha
            if cutlass.const_expr(mBias is not None):
                value = value + mBias[i]
            mY[i] = value


def real_cache(directory) -> CompileCache:
    return CompileCache(
        _compile_scale,
        cache.export_tvm_ffi,
        cache.load_tvm_ffi,
        directory=directory,
        disk=True,
    )


@pytest.mark.compile
def test_tvm_ffi_export_and_load(tmp_path):
    import torch
    import tvm_ffi

    c = real_cache(tmp_path)
    key = ScaleKey(with_bias=False)
    fresh = c.get(key)
    assert isinstance(fresh, tvm_ffi.Function) and c.compiles == 1
    (path,) = entries(tmp_path)

    loaded_cache = real_cache(tmp_path)
    loaded = loaded_cache.get(key)
    assert isinstance(loaded, tvm_ffi.Function)
    assert loaded_cache.compiles == 0 and loaded_cache.disk_hits == 1

    # The loaded function checks its arguments in compiled code: CPU tensors are refused by
    # device type, which shows the signature (tensors, a float, None for the absent bias).
    x = torch.zeros(256)
    for fn in (fresh, loaded):
        with pytest.raises(ValueError, match="expected device_type=cuda"):
            fn(x, x, 2.0, None)
        with pytest.raises(TypeError, match="Expects 4 parameters"):
            fn(x, x, 2.0)

    path.write_bytes(path.read_bytes()[:1000])  # truncated: recompiled, not crashed on
    again = real_cache(tmp_path)
    assert isinstance(again.get(key), tvm_ffi.Function)
    assert again.compiles == 1 and unpack_entry(path.read_bytes()) is not None


_LOAD_IN_A_NEW_PROCESS = """
import sys
import torch
from cute_fa import cache
path, symbol = sys.argv[1:]
fn = cache.load_tvm_ffi(cache.unpack_entry(open(path, "rb").read()), symbol)
cache.fingerprint()
print("DSL imported:", sorted(m for m in sys.modules if m.split(".")[0] == "cutlass"))
x = torch.zeros(256)
try:
    fn(x, x, 2.0, None)
except ValueError as e:
    print("checked:", "expected device_type=cuda" in str(e))
"""


@pytest.mark.compile
def test_disk_hit_loads_without_the_dsl(tmp_path):
    """Note [loading without the DSL]: a new process loads an entry through TVM-FFI alone."""
    if cache._linker() is None:
        pytest.skip("no linker (ld) on this machine")
    key = ScaleKey(with_bias=False)
    real_cache(tmp_path).get(key)
    (path,) = entries(tmp_path)
    shared, obj = cache.unpack_tvm_ffi_payload(unpack_entry(path.read_bytes()))
    assert shared[:4] == obj[:4] == b"\x7fELF" and shared[16] == 3 and obj[16] == 1  # .so, .o
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_NEW_PROCESS, str(path), cache.symbol_for(key)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "DSL imported: []" in proc.stdout and "checked: True" in proc.stdout, proc.stderr


@pytest.mark.compile
def test_object_file_entries_load_through_the_dsl(tmp_path, monkeypatch):
    """Without a linker an entry is the object file alone; a shared library that does not load
    falls back to the object file beside it."""
    import torch

    key = ScaleKey(with_bias=True)
    monkeypatch.setenv(cache.ENV_LINKER, "0")
    c = real_cache(tmp_path)
    fn = c.get(key)
    (path,) = entries(tmp_path)
    payload = unpack_entry(path.read_bytes())
    assert cache.unpack_tvm_ffi_payload(payload) == (None, payload) and payload[:4] == b"\x7fELF"

    broken = cache.pack_tvm_ffi_payload(b"not a shared library", payload)
    monkeypatch.setattr(cache, "_warned", set())
    with pytest.warns(UserWarning, match="did not load as a shared library"):
        loaded = cache.load_tvm_ffi(broken, cache.symbol_for(key))
    x = torch.zeros(256)
    for f in (fn, loaded):
        with pytest.raises(ValueError, match="expected device_type=cuda"):
            f(x, x, 2.0, x)


def test_payload_format():
    assert cache.unpack_tvm_ffi_payload(b"\x7fELF object") == (None, b"\x7fELF object")
    packed = cache.pack_tvm_ffi_payload(b"shared", b"object")
    assert cache.unpack_tvm_ffi_payload(packed) == (b"shared", b"object")
    with pytest.raises(ValueError, match="truncated"):
        cache.unpack_tvm_ffi_payload(packed[:20])


def test_fingerprint_needs_no_dsl_import():
    """The toolchain lines read from package metadata equal what the DSL itself reports."""
    from cutlass.base_dsl.version_info import CUDA_VERSION

    lines = cache._toolchain_versions()
    assert lines[:2] == [f"cutlass-dsl {cutlass.__version__}", f"dsl-cuda {CUDA_VERSION.major}"]
    runtime = cache.dsl_runtime_library()
    assert runtime is not None and os.path.basename(runtime) == cache.RUNTIME_LIBRARY
    assert runtime in cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False)


def test_runtime_library_of_the_flavor_the_dsl_loads(tmp_path, monkeypatch):
    """With the cu12 and cu13 builds of the DSL side by side (``nvidia-cutlass-dsl[cu13]``),
    the runtime library is the one of the flavor the DSL loads: the newest the driver supports,
    the newest of all without a driver."""
    assert cache.pick_toolkit_flavor([12, 13], None) == 13
    assert cache.pick_toolkit_flavor([12, 13], 13) == 13
    assert cache.pick_toolkit_flavor([12, 13], 12) == 12
    assert cache.pick_toolkit_flavor([13], 12) is None
    root = tmp_path / "nvidia_cutlass_dsl"
    for flavor in ("cu12", "cu13"):
        (root / flavor / "lib").mkdir(parents=True)
        (root / flavor / "lib" / cache.RUNTIME_LIBRARY).write_bytes(b"")
    spec = types.SimpleNamespace(submodule_search_locations=[str(root)])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: spec)
    monkeypatch.delenv("CUTE_DSL_LIBS", raising=False)
    for driver, flavor in ((None, "cu13"), (13, "cu13"), (12, "cu12"), (11, None)):
        monkeypatch.setattr(cache, "driver_cuda_major", lambda driver=driver: driver)
        cache.dsl_runtime_library.cache_clear()
        found = cache.dsl_runtime_library()
        assert found == (str(root / flavor / "lib" / cache.RUNTIME_LIBRARY) if flavor else None)
        assert cache._runtime_cuda_major(found) == (int(flavor[2:]) if flavor else None)
    cache.dsl_runtime_library.cache_clear()


@pytest.mark.gpu
def test_tvm_ffi_kernel_runs_fresh_and_from_disk(tmp_path):
    import torch

    x = torch.randn(1000, device="cuda")
    bias = torch.randn(1000, device="cuda")
    for with_bias in (False, True):
        key = ScaleKey(with_bias=with_bias, target=cache_target())
        for c in (real_cache(tmp_path), real_cache(tmp_path)):  # compiled, then loaded
            y = torch.empty_like(x)
            c.get(key)(x, y, 3.0, bias if with_bias else None)
            torch.testing.assert_close(y, 3.0 * x + (bias if with_bias else 0))


def cache_target() -> str:
    import torch

    from cute_fa.config import target_for_capability

    return target_for_capability(*torch.cuda.get_device_capability())
