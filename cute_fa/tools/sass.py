"""Cross-compile a kernel on any machine and read its cubin: registers, spills, SASS mix.

``compile_and_inspect(config)`` compiles the forward kernel of a ``FwdConfig`` for
``config.target`` (no GPU needed), keeps the cubin (``--keep-cubin`` into a temporary
``--dump-dir``), and reads it with ``cuobjdump --dump-resource-usage`` (REG / STACK / SHARED /
LOCAL per kernel) and ``nvdisasm -c`` (the SASS text). The tools come from the PyPI packages
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` (``nvidia/*/bin``) or from ``PATH``.

SHARED is the static shared memory in the cubin; the kernels size theirs at launch (dynamic), so
``smem_tiles`` gives the Q/K/V tile bytes of the config, which is what the launch asks for.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

# Opcodes worth a look in an attention kernel (base names: the part before the first dot).
INTERESTING = (
    "HMMA",  # sm80+ mma.sync
    "HGMMA",  # sm90 warpgroup MMA
    "UTCHMMA",  # sm100 tcgen05 MMA
    "LDSM",  # ldmatrix
    "LDGSTS",  # cp.async
    "UTMALDG",  # TMA load
    "MUFU",  # exp2 / rcp / tanh
    "FFMA",
    "FMNMX",
    "SHFL",
    "BAR",
    "LDS",
    "STS",
    "LDG",
    "STG",
    "LDL",  # local loads: spills (or stack arrays)
    "STL",  # local stores
)

_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_RESOURCE = re.compile(
    r"Function\s+(\S+):\s*\n\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)"
)


def find_tool(name: str) -> str | None:
    """Path of a CUDA binary tool (``nvdisasm``, ``cuobjdump``): PATH, then nvidia/*/bin."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for candidate in sorted(Path(base).glob(f"*/bin/{name}")):
            if candidate.is_file():
                return str(candidate)
    return None


def _run_tool(name: str, *args: str) -> str:
    tool = find_tool(name)
    if tool is None:
        raise FileNotFoundError(
            f"{name} not found on PATH or in nvidia/*/bin (pip install nvidia-cuda-{name})"
        )
    proc = subprocess.run([tool, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def resource_usage(cubin_path: str | Path) -> dict[str, dict[str, int]]:
    """{kernel name: {"regs", "stack", "shared", "local"}} from cuobjdump."""
    text = _run_tool("cuobjdump", "--dump-resource-usage", str(cubin_path))
    return {
        m.group(1): {
            "regs": int(m.group(2)),
            "stack": int(m.group(3)),
            "shared": int(m.group(4)),
            "local": int(m.group(5)),
        }
        for m in _RESOURCE.finditer(text)
    }


def disassemble(cubin_path: str | Path) -> str:
    return _run_tool("nvdisasm", "-c", str(cubin_path))


def count_opcodes(sass_text: str) -> Counter:
    """Counter of base opcodes (``HMMA.16816.F32.BF16`` counts as ``HMMA``)."""
    return Counter(m.group(1) for m in _OPCODE.finditer(sass_text))


def smem_tiles(config) -> int:
    """Bytes of the Q, K and V tiles of a forward config (16-bit elements; for a backward
    config the same count: its K, V tiles and one Q tile)."""
    return (
        config.tile_m * config.head_dim + config.tile_n * (config.head_dim + config.head_dim_v)
    ) * 2


def compile_cubin(config, kernel=None) -> bytes:
    """Cubin of the forward kernel of a ``FwdConfig`` (or the backward's main kernel of a
    ``BwdConfig``), cross-compiled for ``config.target``; ``kernel``: that kernel's instance
    for ``config`` (whose trace-time records a caller reads), else a new one."""
    import cutlass.cute as cute

    from cute_fa.config import BwdConfig
    from cute_fa.dsl.fake import bwd_fake_args, fwd_fake_args
    from cute_fa.planning import bwd_kernel_classes, fwd_kernel_class

    if isinstance(config, BwdConfig):
        kernel, args = kernel or bwd_kernel_classes(config.arch)[1](config), bwd_fake_args(config)
    else:
        kernel, args = kernel or fwd_kernel_class(config.arch)(config), fwd_fake_args(config)
    with tempfile.TemporaryDirectory(prefix="cute-fa-cubin-") as d:
        compiled = cute.compile(
            kernel,
            *args,
            options=f"--gpu-arch {config.target} --keep-cubin --dump-dir {d}",
        )
        cubin = compiled.__cubin__
    if not cubin:
        raise RuntimeError(f"the DSL kept no cubin for {config.name}")
    return cubin if isinstance(cubin, bytes) else cubin.encode("latin-1")


def inspect_cubin(cubin: bytes) -> dict:
    """Resource usage (of the largest kernel in the cubin) and SASS opcode counts."""
    with tempfile.TemporaryDirectory(prefix="cute-fa-cubin-") as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = resource_usage(path)
        sass = disassemble(path)
    if not usage:
        raise RuntimeError("cuobjdump reported no kernel in the cubin")
    name, res = max(usage.items(), key=lambda item: item[1]["regs"])
    return dict(
        kernel=name,
        regs=res["regs"],
        stack=res["stack"],
        smem=res["shared"],
        local=res["local"],
        sass_counts=count_opcodes(sass),
        sass_text=sass,
    )


def compile_and_inspect(config) -> dict:
    """Compile ``config`` for its target and report ``regs``, ``smem`` (static), ``smem_tiles``,
    ``stack``, ``local``, ``spills`` (LDL + STL count), ``sass_counts`` (Counter) and
    ``sass_text``."""
    info = inspect_cubin(compile_cubin(config))
    info["smem_tiles"] = smem_tiles(config)
    counts = info["sass_counts"]
    info["spills"] = counts["LDL"] + counts["STL"]
    return info
