"""tokenwire's CPU kernels (quant_cpu.cpp and the headers it includes), compiled once per
machine and cached.

The extension is built with torch's own C++ extension machinery (ninja, the system compiler)
into `<cache>/kernels/<key>`: cache = `$TOKENWIRE_CACHE_DIR` or `~/.cache/tokenwire` (kernels
belong to the machine, not to a model, so a model's `--cache-dir` does not rebuild them); key =
hash of the sources, the torch version and the compiler flags. A later start only loads the
shared library (~0.1 s), whatever the sources' mtimes; a changed source or torch rebuilds. The
first build takes ~40 s on 2 cores and is logged with its duration. The ops register as
`torch.ops.tokenwire.*`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tokenwire.model.cache_dir import default_cache_dir

log = logging.getLogger("tokenwire.kernels")

_SOURCE = Path(__file__).with_name("quant_cpu.cpp")
_NAME = "tokenwire_quant_cpu"  # the extension; its library is <kernel_dir>/<_NAME>.so
_lock = threading.Lock()
_loaded = False


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# TOKENWIRE_KERNELS_ISA=avx2 builds the AVX2 path on an AVX-512 machine (what an EPYC whose
# AVX-512 the hypervisor hides runs: CI may land on either), =portable the plain C++ one; unset
# or "native": whatever this CPU has. Each choice is its own build in the kernel cache.
ISA_ENV = "TOKENWIRE_KERNELS_ISA"
_HIDDEN = {
    "native": set(),
    "avx2": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
    "portable": {"avx2", "fma", "f16c"},
}


def isa_choice() -> str:
    choice = os.environ.get(ISA_ENV, "native") or "native"
    if choice not in _HIDDEN:
        raise ValueError(f"{ISA_ENV}={choice!r}: one of {sorted(_HIDDEN)}")
    return choice


def compiler_flags() -> list[str]:
    """-O3 without fp contraction (scalar code rounds where it is written); AVX2/FMA/F16C when
    this CPU has them (the kernels fall back to portable C++ otherwise). -fopenmp: at::parallel_for
    is an inline template whose `#pragma omp parallel` is ignored without it, and every kernel
    then ran on one thread (the loader maps torch's own libgomp for the extension)."""
    flags = ["-O3", "-ffp-contract=off", "-std=c++17", "-fopenmp"]
    cpu = _cpu_flags() - _HIDDEN[isa_choice()]
    if {"avx2", "fma", "f16c"} <= cpu:
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if "avx_vnni" in cpu:  # vpdpwssd: the integer dots' multiply and add in one (blocks.h)
            flags.append("-mavxvnni")
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu:  # tiles.h: vpdpbusd
            flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
    return flags


def kernel_path() -> str:
    """Which instruction set the kernels are built for, in words (bench engine prints it)."""
    flags = compiler_flags()
    if "-mavx512vnni" in flags:
        return "AVX-512 VNNI (tiled int8: vpdpbusd)"
    if "-mavx2" in flags:
        return "AVX2 (tiled int8: vpmaddubsw + vpmaddwd)"
    return "portable C++ (fp32 activations)"


def kernel_dir() -> Path:
    flags = compiler_flags()
    sources = b"".join(p.read_bytes() for p in sorted(_SOURCE.parent.glob("*.[ch]*")))
    key = hashlib.sha256(sources + torch.__version__.encode() + " ".join(flags).encode())
    return default_cache_dir() / "kernels" / key.hexdigest()[:16]


def load_kernels() -> None:
    """Build (first time) and load the extension; afterwards torch.ops.tokenwire.* exist."""
    global _loaded
    with _lock:
        if _loaded:
            return
        # local: cpp_extension imports setuptools and the compiler tooling; loading a built one needs it too
        from torch.utils import cpp_extension

        build = kernel_dir()
        build.mkdir(parents=True, exist_ok=True)
        library = build / f"{_NAME}.so"
        started = time.monotonic()
        # The directory is named by the sources' hash, so a finished library there was built from
        # these very sources: it is loaded as it is. Through cpp_extension.load, ninja compared
        # mtimes and rebuilt it whenever a source was newer (after a git checkout, or in a fresh
        # clone on a machine that had built it): 45-57 s on 2 cores, logged as "loaded". While
        # another process builds (cpp_extension's `lock` file), load() below waits for it.
        if library.exists() and not (build / "lock").exists():
            torch.ops.load_library(str(library))
            log.info("tokenwire CPU kernels loaded in %.1fs", time.monotonic() - started)
            _loaded = True
            return
        log.info("compiling tokenwire CPU kernels into %s (once per machine, ~30-60 s)", build)
        os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
        # the `ninja` wheel installs beside this interpreter, which need not be on PATH
        bindir = os.path.dirname(sys.executable)
        if shutil.which("ninja") is None and bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        cpp_extension.load(
            name=_NAME,
            sources=[str(_SOURCE)],
            extra_cflags=compiler_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            is_python_module=False,
            verbose=False,
        )
        log.info("tokenwire CPU kernels compiled in %.1fs", time.monotonic() - started)
        _loaded = True


def loaded() -> bool:
    """Whether the kernels are built and loaded (a quantised model loads them; fp32 may not)."""
    return _loaded


def ops() -> Any:
    """torch.ops.tokenwire, loading the kernels on first use (afterwards no lock is taken:
    every quantised matmul and fused stack goes through here)."""
    if not _loaded:
        load_kernels()
    return torch.ops.tokenwire
