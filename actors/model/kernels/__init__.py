"""CPU kernels of our own (C++ beside this file), compiled once per machine and loaded as torch ops.

The compiler is the machine's `c++` (g++ or clang), with torch's headers and libraries: no build
step at install, no Python headers, no ninja. The library is built for this CPU's instruction set
(`-march=native`), so its folder under the cache is named by the source, torch's version and the
CPU's flags; `make setup` builds it, and a process that finds it missing builds it under a lock.
Where no compiler works, `available()` is False and callers take torch's own ops (with what that
costs them: docs/lossless.md).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from actors.model.cache_folder import cache_root

log = logging.getLogger(__name__)
SOURCES = ("paged_attention.cpp", "fused_ops.cpp", "linear.cpp")
HEADERS = ("vector_math.h", "dtype_io.h")
HERE = Path(__file__).resolve().parent


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    """Where this machine's build lives (named by what it was built from and for)."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((HERE / name).read_bytes())
    digest.update(f"{torch.__version__} {_cpu_flags()}".encode())
    return cache_root() / "kernels" / digest.hexdigest()[:16] / "specserve_kernels.so"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(target: Path) -> None:
    """Compile SOURCES into `target` (raises with the compiler's message when it fails)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    # -fno-trapping-math lets loops with comparisons vectorize; it changes no result
    command = [compiler, "-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp",
               "-std=c++17", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
               *[f"-I{path}" for path in cpp_extension.include_paths()],
               *[str(HERE / name) for name in SOURCES],
               f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}", "-o", str(partial)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {', '.join(SOURCES)} failed:\n{result.stderr[-2000:]}")
    partial.replace(target)


@cache
def available() -> bool:
    """Whether torch.ops.specserve's kernels are loaded (built first where this machine lacks them)."""
    target = library_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds; the others wait and load its build
            if not target.exists():
                log.info("building specserve's CPU kernels into %s", target.parent)
                build(target)
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as error:
        log.warning("specserve's CPU kernels are unavailable, torch's attention is used instead: %s", error)
        return False
    return True
