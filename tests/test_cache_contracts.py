"""Contracts of ``cute_fa/cache.py`` checked without a compiled kernel: the linker step and the
export / load dispatch with fakes for the linker, the exported module and the two loaders
(the real path: the compile tests of tests/test_cache.py), the counters and messages of
``CompileCache``, the payload header's edges and the version probes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from cute_fa import cache, settings
from cute_fa.cache import CompileCache


@dataclass(frozen=True)
class Key:
    name: str


def _fake_cache(directory, load=None, **kw) -> CompileCache:
    return CompileCache(
        lambda key: f"kernel {getattr(key, 'name', key)}".encode(),
        lambda compiled, symbol: compiled + b" as " + symbol.encode(),
        load or (lambda payload, symbol: lambda: payload),
        directory=directory,
        **kw,
    )


# --------------------------------------------------------------------------------------------
# linking, export and load (fakes)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(cache, "_warned", set())


@pytest.fixture
def linker_env(monkeypatch, tmp_path, fresh_warnings):
    """A linker and a runtime library that exist (as names), and subprocess.run recorded."""
    monkeypatch.delenv(settings.LINKER, raising=False)
    runtime = str(tmp_path / cache.RUNTIME_LIBRARY)
    monkeypatch.setattr(cache, "dsl_runtime_library", lambda: runtime)
    monkeypatch.setattr(cache.shutil, "which", lambda name: f"/usr/bin/{name}")
    import tvm_ffi.libinfo

    monkeypatch.setattr(tvm_ffi.libinfo, "find_libtvm_ffi", lambda: "/x/libtvm_ffi.so")
    calls = []

    def run(cmd, **kw):
        calls.append((cmd, kw))
        lib = cmd[cmd.index("-o") + 1]
        obj = cmd[cmd.index(lib) + 1]
        Path(lib).write_bytes(b"shared from " + Path(obj).read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cache.subprocess, "run", run)
    return runtime, calls


def test_linker_setting(monkeypatch):
    monkeypatch.setattr(cache.shutil, "which", lambda name: f"/bin/{name}")
    monkeypatch.delenv(settings.LINKER, raising=False)
    assert (cache._linker_off(), cache._linker()) == (False, "/bin/ld")
    monkeypatch.setenv(settings.LINKER, "ld.gold")
    assert cache._linker() == "/bin/ld.gold"
    monkeypatch.setenv(settings.LINKER, "0")
    assert (cache._linker_off(), cache._linker()) == (True, None)


def test_link_runs_the_linker_on_the_object_file(linker_env):
    runtime, calls = linker_env
    assert cache.link_shared_library(b"OBJ") == b"shared from OBJ"
    ((cmd, kw),) = calls
    assert cmd[:8] == ["/usr/bin/ld", "-shared", "-z", "defs", "-z", "now", "-o", cmd[7]]
    assert cmd[7].endswith("module.so") and cmd[8].endswith("module.o")
    assert cmd[9:] == [runtime, "/x/libtvm_ffi.so"]
    assert kw == {"capture_output": True, "text": True, "timeout": 120, "check": False}
    assert not Path(cmd[7]).parent.exists()  # the temporary folder is gone
    assert cache.step_seconds()["link"] >= 0


def test_link_is_off_without_a_word(linker_env, monkeypatch):
    _, calls = linker_env
    monkeypatch.setenv(settings.LINKER, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.link_shared_library(b"OBJ") is None
    assert calls == []


def test_link_without_a_linker_or_runtime_warns_once(linker_env, monkeypatch):
    _, calls = linker_env
    monkeypatch.setattr(cache.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning) as record:
        assert cache.link_shared_library(b"OBJ") is None
        assert cache.link_shared_library(b"OBJ") is None
    assert [str(r.message) for r in record] == [
        "cute_fa: a linker (ld; or set CUTE_FA_LINKER) not found: cache entries hold object "
        "files only, and loading them imports the CuTe DSL (about a second per process)"
    ]
    assert calls == []
    monkeypatch.setattr(cache, "_warned", set())
    monkeypatch.setattr(cache.shutil, "which", lambda name: "/usr/bin/ld")
    monkeypatch.setattr(cache, "dsl_runtime_library", lambda: None)
    with pytest.warns(UserWarning, match=f"cute_fa: {cache.RUNTIME_LIBRARY} not found: cache"):
        assert cache.link_shared_library(b"OBJ") is None


@pytest.mark.parametrize(
    "result, why",
    [
        (subprocess.CompletedProcess([], 1, "", "  undefined symbol: x \n"), "undefined symbol: x"),
        (subprocess.CompletedProcess([], 7, "", ""), "exit 7"),
        (subprocess.TimeoutExpired("ld", 120), "Command 'ld' timed out after 120 seconds"),
        (OSError("no exec"), "no exec"),
    ],
)
def test_a_failed_link_warns_with_the_reason(linker_env, monkeypatch, result, why):
    def run(cmd, **kw):
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(cache.subprocess, "run", run)
    with pytest.warns(UserWarning) as record:
        assert cache.link_shared_library(b"OBJ") is None
    assert [str(r.message) for r in record] == [
        f"cute_fa: linking a kernel into a shared library failed ({why}); cache entries hold "
        f"object files only, and loading them imports the CuTe DSL"
    ]


def test_a_failed_link_reason_is_cut_to_300_characters(linker_env, monkeypatch):
    result = subprocess.CompletedProcess([], 1, "", "e" * 400)
    monkeypatch.setattr(cache.subprocess, "run", lambda cmd, **kw: result)
    with pytest.warns(UserWarning, match=r"failed \(e{300}\); cache"):
        cache.link_shared_library(b"OBJ")


def test_link_works_in_its_own_temporary_folder_and_is_a_step(linker_env, monkeypatch):
    _, calls = linker_env
    monkeypatch.setattr(cache, "_steps", {})
    cache.link_shared_library(b"OBJ")
    ((cmd, _),) = calls
    folder = Path(cmd[7]).parent
    assert folder.name.startswith("cute-fa-link-") and Path(cmd[8]).parent == folder
    assert set(cache.step_seconds()) == {"link"}


def test_one_link_warning_a_process(linker_env, monkeypatch):
    # a missing linker and a failed link are one kind: after either, the other is quiet
    monkeypatch.setattr(cache.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="not found"):
        cache.link_shared_library(b"OBJ")
    monkeypatch.setattr(cache.shutil, "which", lambda name: f"/usr/bin/{name}")
    result = subprocess.CompletedProcess([], 1, "", "undefined symbol")
    monkeypatch.setattr(cache.subprocess, "run", lambda cmd, **kw: result)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.link_shared_library(b"OBJ") is None
    monkeypatch.setattr(cache, "_warned", set())
    with pytest.warns(UserWarning, match="failed"):
        cache.link_shared_library(b"OBJ")
    monkeypatch.setattr(cache.shutil, "which", lambda name: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.link_shared_library(b"OBJ") is None


class FakeCompiled:
    def __init__(self):
        self.calls = []
        self.paths = []

    def export_to_c(self, path, function_name):
        self.calls.append(function_name)
        self.paths.append(Path(path))
        Path(path).write_bytes(b"OBJ of " + function_name.encode())


def test_export_works_in_its_own_temporary_folder_and_is_a_step(linker_env, monkeypatch):
    monkeypatch.setattr(cache, "_steps", {})
    compiled = FakeCompiled()
    cache.export_tvm_ffi(compiled, "sym")
    (path,) = compiled.paths
    assert path.name == "module.o" and path.parent.name.startswith("cute-fa-export-")
    assert not path.parent.exists()
    assert set(cache.step_seconds()) == {"export", "link"}


def test_export_packs_the_object_file_and_its_shared_library(linker_env, monkeypatch):
    compiled = FakeCompiled()
    payload = cache.export_tvm_ffi(compiled, "sym")
    assert compiled.calls == ["sym"]
    assert cache.unpack_tvm_ffi_payload(payload) == (b"shared from OBJ of sym", b"OBJ of sym")
    assert cache.step_seconds()["export"] >= 0
    monkeypatch.setenv(settings.LINKER, "0")
    assert cache.export_tvm_ffi(compiled, "other") == b"OBJ of other"


@pytest.fixture
def loaders(monkeypatch, fresh_warnings):
    calls = []

    def shared(lib, symbol):
        calls.append(("shared", lib, symbol))
        if lib == b"broken":
            raise OSError("noexec")
        return "from shared"

    def obj(o, symbol):
        calls.append(("object", o, symbol))
        return "from object"

    monkeypatch.setattr(cache, "_load_shared_library", shared)
    monkeypatch.setattr(cache, "_load_object_file", obj)
    return calls


def test_load_takes_the_shared_library_first(loaders):
    assert cache.load_tvm_ffi(cache.pack_tvm_ffi_payload(b"lib", b"obj"), "sym") == "from shared"
    assert loaders == [("shared", b"lib", "sym")]


def test_load_of_an_object_file_alone(loaders):
    assert cache.load_tvm_ffi(b"obj", "sym") == "from object"
    assert loaders == [("object", b"obj", "sym")]


def test_load_falls_back_to_the_object_file_and_warns_once(loaders):
    payload = cache.pack_tvm_ffi_payload(b"broken", b"obj")
    with pytest.warns(UserWarning) as record:
        assert cache.load_tvm_ffi(payload, "sym") == "from object"
        assert cache.load_tvm_ffi(payload, "sym") == "from object"
    assert [str(r.message) for r in record] == [
        "cute_fa: a cached kernel did not load as a shared library (noexec); loading object "
        "files through the CuTe DSL instead"
    ]
    assert loaders[:2] == [("shared", b"broken", "sym"), ("object", b"obj", "sym")]


def test_warn_once_per_kind_points_at_the_caller_of_the_caller(fresh_warnings):
    def caller():
        cache._warn_once("a kind", "first")

    with pytest.warns(UserWarning) as record:
        caller()
        caller()
        cache._warn_once("another kind", "second")
    assert [str(r.message) for r in record] == ["first", "second"]
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add frames
        assert record[0].filename == __file__


def test_warn_once_is_given_two_frames_up(fresh_warnings, monkeypatch):
    # _warn_once, then the function that warns, then its caller: stacklevel 3 (checked on the
    # call, so that it holds under mutmut's trampolines too; the test above checks the file)
    calls = _record_warn_calls(monkeypatch)
    cache._warn_once("a kind", "first")
    assert calls == [(("first",), {"stacklevel": 3})]


def test_the_first_tvm_ffi_import_is_a_step(monkeypatch):
    import builtins

    import tvm_ffi

    real_import = builtins.__import__
    imported = []

    def fake_import(name, *args, **kw):  # the module again, without running its import twice
        if name == "tvm_ffi":
            imported.append(name)
            return tvm_ffi
        return real_import(name, *args, **kw)

    monkeypatch.delitem(sys.modules, "tvm_ffi")
    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(cache, "_steps", {})
    assert cache.import_tvm_ffi() is tvm_ffi
    assert imported == ["tvm_ffi"]
    assert set(cache.step_seconds()) == {"import tvm_ffi"}


def _record_warn_calls(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(cache.warnings, "warn", lambda *a, **kw: calls.append((a, kw)))
    return calls


# --------------------------------------------------------------------------------------------
# CompileCache


def test_an_entry_that_does_not_load_warns_at_the_caller_of_get(tmp_path):
    _fake_cache(tmp_path, disk=True).get(Key("a"))

    def load(payload, symbol):
        if b"kernel a" in payload and not load.failed:
            load.failed = True
            raise ValueError("bad")
        return lambda: payload

    load.failed = False
    with pytest.warns(UserWarning, match="did not load") as record:
        _fake_cache(tmp_path, load=load, disk=True).get(Key("a"))
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add frames
        assert record[0].filename == __file__


def test_cache_warnings_stacklevels(tmp_path, monkeypatch):
    # checked on the calls (mutmut's trampolines add frames; the test below checks the lines)
    calls = _record_warn_calls(monkeypatch)

    def load(payload, symbol):
        raise ValueError("bad")

    _fake_cache(tmp_path, disk=True).get(Key("a"))
    with pytest.raises(ValueError):
        _fake_cache(tmp_path, load=load, disk=True).get(Key("a"))
    _fake_cache(tmp_path, disk=True)._disable_disk("a reason", 2)
    # _try_load, _get_uncached, get, its caller; _disable_disk, then 2 above it
    assert [kw for _, kw in calls] == [{"stacklevel": 4}, {"stacklevel": 4}, {"stacklevel": 3}]


def _disk_off_cases(tmp_path, monkeypatch):
    """(name, cache, call) for each way a lookup turns the disk off: a folder that cannot be
    made, a lock that cannot be taken, an entry that cannot be written; through get and
    ensure_on_disk."""
    import filelock

    blocker = tmp_path / "file"
    blocker.write_bytes(b"")

    class NoLock:
        def __init__(self, path):
            pass

        def acquire(self):
            raise OSError("read-only")

    def no_lock(path):
        return NoLock(path) if "nolock" in path else file_lock(path)

    def cannot_write(path, data):
        if "nowrite" in str(path):
            raise OSError("disk full")
        return atomic_write(path, data)

    file_lock, atomic_write = filelock.FileLock, cache.atomic_write
    monkeypatch.setattr(filelock, "FileLock", no_lock)
    monkeypatch.setattr(cache, "atomic_write", cannot_write)
    return [
        ("create get", _fake_cache(blocker / "a", disk=True), "get"),
        ("create ensure", _fake_cache(blocker / "b", disk=True), "ensure_on_disk"),
        ("lock get", _fake_cache(tmp_path / "nolock", disk=True), "get"),
        ("write get", _fake_cache(tmp_path / "nowrite", disk=True), "get"),
        ("write ensure", _fake_cache(tmp_path / "nowrite2", disk=True), "ensure_on_disk"),
    ]


def test_a_disk_turned_off_warns_at_the_caller_of_get_or_ensure_on_disk(tmp_path, monkeypatch):
    # the stacklevel of each path (on the call: mutmut's trampolines add frames): get's caller
    # is 4 frames above _disable_disk through the lock, 5 through _prepare_dir_and_path, 6
    # through _compile_to_callable and _store; ensure_on_disk's caller 4 through either helper
    cases = _disk_off_cases(tmp_path, monkeypatch)
    calls = _record_warn_calls(monkeypatch)
    levels = {}
    for name, c, method in cases:
        del calls[:]
        with contextlib.suppress(RuntimeError):  # ensure_on_disk: the folder is not writable
            getattr(c, method)(Key("a"))
        assert not c.disk_enabled, name
        levels[name] = [kw for _, kw in calls]
    assert levels == {
        "create get": [{"stacklevel": 5}],
        "create ensure": [{"stacklevel": 4}],
        "lock get": [{"stacklevel": 4}],
        "write get": [{"stacklevel": 6}],
        "write ensure": [{"stacklevel": 4}],
    }


@pytest.mark.skipif("MUTANT_UNDER_TEST" in os.environ, reason="mutmut's trampolines add frames")
def test_a_disk_turned_off_names_the_line_that_asked(tmp_path, monkeypatch):
    import inspect

    for name, c, method in _disk_off_cases(tmp_path, monkeypatch):
        with pytest.warns(UserWarning, match="compile cache on disk turned off") as record:
            line = inspect.currentframe().f_lineno + 2
            with contextlib.suppress(RuntimeError):
                getattr(c, method)(Key("a"))
        assert (record[0].filename, record[0].lineno) == (__file__, line), name


def test_a_cache_folder_that_cannot_be_made_warns_at_the_lookup(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.warns(UserWarning, match="cannot create") as record:
        _fake_cache(blocker / "sub", disk=True).get(Key("a"))
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampolines add frames
        assert record[0].filename == __file__


def test_ensure_on_disk_messages(tmp_path):
    with pytest.raises(RuntimeError) as info:
        _fake_cache(tmp_path, disk=False).ensure_on_disk(Key("a"))
    assert str(info.value) == "the disk cache is off (CUTE_FA_CACHE=0)"
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    c = _fake_cache(blocker / "sub", disk=True)
    with pytest.warns(UserWarning, match="compile cache on disk turned off: cannot create"):
        with pytest.raises(RuntimeError) as info:
            c.ensure_on_disk(Key("a"))
    assert str(info.value) == f"cache directory {blocker / 'sub'} is not writable"


def test_ensure_on_disk_stores_the_serialized_entry_under_its_lock(tmp_path):
    c = _fake_cache(tmp_path, disk=True)
    key = Key("a")
    assert c.ensure_on_disk(key) == "compiled"
    path = c.path_for(key)
    payload = cache.unpack_entry(path.read_bytes())
    assert payload == b"kernel a as " + cache.symbol_for(key).encode()
    assert Path(str(path) + ".lock").exists()
    assert c.ensure_on_disk(key) == "hit"


def test_an_entry_the_loader_rejects_counts_once_each_time(tmp_path):
    _fake_cache(tmp_path, disk=True).get(Key("a"))
    symbols = []

    def load(payload, symbol):
        symbols.append(symbol)
        raise ValueError("bad")

    c = _fake_cache(tmp_path, load=load, disk=True)
    with pytest.warns(UserWarning) as record, pytest.raises(ValueError):
        c.get(Key("a"))
    assert c.rejected == 2  # before the lock and after it; then the compile's own load fails
    assert symbols == [cache.symbol_for(Key("a"))] * 3
    name = cache.entry_name(Key("a"))
    assert str(record[0].message) == f"cute_fa: cache entry {name} did not load (bad); recompiling"


def test_disk_hits_count_each_load(tmp_path):
    _fake_cache(tmp_path, disk=True).get(Key("a"))
    _fake_cache(tmp_path, disk=True).get(Key("b"))
    c = _fake_cache(tmp_path, disk=True)
    c.get(Key("a"))
    c.get(Key("b"))
    assert (c.disk_hits, c.compiles, c.rejected) == (2, 0, 0)


@pytest.mark.parametrize("given", ["serialize", "load"])
def test_a_cache_with_only_one_of_serialize_and_load_hands_out_the_compiled_object(given):
    def unused(*args):
        raise AssertionError("called")

    fns = {"serialize": None, "load": None, given: unused}
    c = CompileCache(lambda key: f"compiled {key}", fns["serialize"], fns["load"], disk=True)
    assert c.get("a") == "compiled a"
    assert (c.disk_enabled, c.compiles, c.seconds["serialize"], c.seconds["load"]) == (
        False, 1, 0.0, 0.0
    )  # fmt: skip


def test_a_disabled_disk_is_off_and_says_why(tmp_path):
    c = _fake_cache(tmp_path, disk=True)
    with pytest.warns(UserWarning) as record:
        c._disable_disk("a reason", 1)
    assert c.disk_enabled is False
    assert str(record[0].message) == "cute_fa: compile cache on disk turned off: a reason"


# --------------------------------------------------------------------------------------------
# payload header, versions


def test_payload_header_edges():
    header = cache._SHARED_HEADER.size
    # the magic alone, shorter than a header: an object file that happens to start so
    assert cache.unpack_tvm_ffi_payload(cache._SHARED_MAGIC) == (None, cache._SHARED_MAGIC)
    empty = cache.pack_tvm_ffi_payload(b"", b"")
    assert len(empty) == header and cache.unpack_tvm_ffi_payload(empty) == (b"", b"")
    assert cache.unpack_tvm_ffi_payload(cache.pack_tvm_ffi_payload(b"lib", b"")) == (b"lib", b"")
    with pytest.raises(ValueError) as info:  # a header whose library runs past the end
        cache.unpack_tvm_ffi_payload(cache.pack_tvm_ffi_payload(b"lib", b"")[:-1])
    assert str(info.value) == "truncated shared library in a cache payload"


def test_version_probes(monkeypatch):
    monkeypatch.setattr(cache, "driver_cuda_version", lambda: 13000)
    assert cache.driver_cuda_major() == 13
    monkeypatch.setattr(cache, "driver_cuda_version", lambda: 12080)  # CUDA 12.8: an int 12
    assert repr(cache.driver_cuda_major()) == "12"
    monkeypatch.setattr(cache, "driver_cuda_version", lambda: None)
    assert cache.driver_cuda_major() is None
    from importlib import metadata

    assert cache.dsl_version() == metadata.version("nvidia-cutlass-dsl")


def test_toolchain_lines_without_package_metadata(monkeypatch):
    expected = cache._toolchain_versions()
    monkeypatch.setattr(cache, "_distribution_version", lambda name: None)
    assert cache._toolchain_versions() == expected


def test_runtime_cuda_major_reads_the_cu_folder():
    assert cache._runtime_cuda_major(f"/p/cu13/lib/{cache.RUNTIME_LIBRARY}") == 13
    assert cache._runtime_cuda_major(f"/p/cu13/lib64/{cache.RUNTIME_LIBRARY}") is None
    assert cache._runtime_cuda_major(f"/p/cuda/lib/{cache.RUNTIME_LIBRARY}") is None
    assert cache._runtime_cuda_major(None) is None


def test_importing_tvm_ffi_again_is_no_step():
    cache.import_tvm_ffi()
    before = cache.step_seconds().get("import tvm_ffi")
    assert cache.import_tvm_ffi() is sys.modules["tvm_ffi"]
    assert cache.step_seconds().get("import tvm_ffi") == before


def test_entry_names_and_symbols():
    key = Key("Fwd sm90/d128:causal")
    digest = cache.key_digest(key)
    assert len(digest) == 20 and digest == cache.key_digest(Key("Fwd sm90/d128:causal"))
    assert cache.entry_name(key) == f"Fwd_sm90_d128_causal-{digest}.bin"
    assert (
        cache.entry_name(Key("x" * 200)) == "x" * 150 + f"-{cache.key_digest(Key('x' * 200))}.bin"
    )
    assert cache.entry_name(("a", 1)) == f"entry-{cache.key_digest(('a', 1))}.bin"
    assert cache.symbol_for(key) == f"cute_fa_{digest}"


def test_seconds_add_up_per_cache(tmp_path, monkeypatch):
    clock = iter(range(0, 1000, 5))  # each perf_counter call 5 s after the last
    monkeypatch.setattr(cache.time, "perf_counter", lambda: next(clock))
    c = _fake_cache(tmp_path, disk=True, verbose=False)
    assert c.seconds == {"compile": 0.0, "serialize": 0.0, "load": 0.0}
    c.get(Key("a"))
    c.get(Key("b"))
    # a load reads the clock twice more inside it (its step): 15 s a load
    assert c.seconds == {"compile": 10, "serialize": 10, "load": 30}
    assert c.compiles == 2 and c.rejected == 0


def test_a_slow_compile_names_its_key(tmp_path, monkeypatch, capsys):
    clock = iter(range(0, 1000, 2))
    monkeypatch.setattr(cache.time, "perf_counter", lambda: next(clock))
    _fake_cache(tmp_path, disk=False).get(Key("slow one"))
    _fake_cache(tmp_path, disk=False).get(("no", "name"))
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "cute_fa: compiling slow one (first call) ... 2.0 s",
        "cute_fa: compiling ('no', 'name') (first call) ... 2.0 s",
    ]
    _fake_cache(tmp_path, disk=False, verbose=False).get(Key("quiet"))
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(cache, "SLOW_COMPILE_S", 2.0)
    _fake_cache(tmp_path, disk=False).get(Key("two seconds"))
    assert capsys.readouterr().err == ""


def test_the_cache_folder_is_made_with_its_parents(tmp_path):
    c = _fake_cache(tmp_path / "a" / "b", disk=True)
    c.get(Key("a"))
    assert c.disk_enabled and (tmp_path / "a" / "b" / cache.entry_name(Key("a"))).exists()


def test_atomic_write_temporaries_sit_beside_the_file(tmp_path, monkeypatch):
    made = []
    real = cache.tempfile.mkstemp

    def mkstemp(**kw):
        made.append(kw)
        return real(**kw)

    monkeypatch.setattr(cache.tempfile, "mkstemp", mkstemp)
    cache.atomic_write(tmp_path / "entry.bin", b"data")
    assert made == [{"dir": tmp_path, "prefix": ".entry.bin.", "suffix": ".tmp"}]
    monkeypatch.setattr(cache.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):
        cache.atomic_write(tmp_path / "entry.bin", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.bin"]


def test_an_empty_payload_is_a_valid_entry():
    assert cache.unpack_entry(cache.pack_entry(b"")) == b""


def test_the_default_directory_is_named_by_the_fingerprint(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.CACHE_DIR, str(tmp_path))
    assert _fake_cache(None).directory == tmp_path / cache.fingerprint()


def test_the_fingerprint_is_a_timed_step(monkeypatch):
    monkeypatch.setattr(cache, "_fingerprint", None)
    monkeypatch.setattr(cache, "_steps", {})
    first = cache.fingerprint()
    assert "fingerprint" in cache.step_seconds()
    monkeypatch.setattr(cache, "_fingerprint", None)
    assert cache.fingerprint() == first  # the same toolchain and sources: the same name


def test_a_load_is_a_timed_step(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "_steps", {})
    _fake_cache(tmp_path, disk=False).get(Key("a"))
    assert set(cache.step_seconds()) == {"load"}


def test_a_miss_takes_the_entry_lock(tmp_path):
    c = _fake_cache(tmp_path, disk=True)
    c.get(Key("a"))
    assert Path(str(c.path_for(Key("a"))) + ".lock").exists()


def test_an_entry_written_while_waiting_for_the_lock_is_loaded(tmp_path, monkeypatch):
    import filelock

    real = filelock.FileLock
    entry = tmp_path / cache.entry_name(Key("a"))

    class LateLock:  # another process stores the entry while this one waits for the lock
        def __init__(self, path):
            self.lock = real(path)

        def acquire(self):
            cache.atomic_write(entry, cache.pack_entry(b"from the other process"))
            self.lock.acquire()

        def release(self):
            self.lock.release()

    monkeypatch.setattr(filelock, "FileLock", LateLock)
    c = _fake_cache(tmp_path, disk=True)
    assert c.get(Key("a"))() == b"from the other process"
    assert (c.compiles, c.disk_hits) == (0, 1)


def test_a_lock_that_cannot_be_taken_turns_the_disk_off(tmp_path, monkeypatch):
    import filelock

    class NoLock:
        def __init__(self, path):
            pass

        def acquire(self):
            raise OSError("read-only")

    monkeypatch.setattr(filelock, "FileLock", NoLock)
    c = _fake_cache(tmp_path, disk=True)
    with pytest.warns(UserWarning) as record:
        assert c.get(Key("a"))() == b"kernel a as " + cache.symbol_for(Key("a")).encode()
    path = c.path_for(Key("a"))
    assert str(record[0].message) == (
        f"cute_fa: compile cache on disk turned off: cannot lock {path}: read-only"
    )
    assert not c.disk_enabled and c.compiles == 1


def test_an_entry_that_cannot_be_written_turns_the_disk_off(tmp_path, monkeypatch):
    def fail(path, data):
        raise OSError("disk full")

    monkeypatch.setattr(cache, "atomic_write", fail)
    c = _fake_cache(tmp_path, disk=True)
    with pytest.warns(UserWarning) as record:
        c.get(Key("a"))
    assert str(record[0].message) == (
        f"cute_fa: compile cache on disk turned off: cannot write {c.path_for(Key('a'))}: disk full"
    )
