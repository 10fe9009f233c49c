"""The CPU kernels' C++ extension (``kernels/csrc/adamw8bit_cpu.cpp``), one build per ISA level.

Built lazily on first use with ``torch.utils.cpp_extension.load`` (through ``kernels/_jit.py``)
and cached in ``TORCH_EXTENSIONS_DIR``: ``-O3 -ffp-contract=off`` plus the flags of the CPU's ISA
level (:func:`cpu_isa`: AVX512_VBMI, AVX512, AVX2 or DEFAULT). Each level has its own cache entry,
so a cache copied to an older CPU is never loaded there; ``OUTCORE_CPU_ISA`` picks a lower level,
``OUTCORE_NO_CPP_EXT=1`` disables the extension (the references serve). The 8-bit AdamW update,
FRUGAL's step, stochastic rounding and NF4 quantization live in it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

_EXT: dict[str, object] = {}  # ISA level -> module, or None where its build failed

# Build levels, lowest first, with their compiler flags. AVX512 needs F/BW/VL/DQ (torch's
# "AVX512" capability); AVX512_VBMI adds the byte permutes of the fast dequantizer. The vector
# levels use F16C (the FP8 format's fp16 conversions), which every AVX2 CPU has (Intel since
# Ivy Bridge, AMD since Piledriver); supported_isa_levels checks it where /proc/cpuinfo says.
ISA_LEVELS = ("DEFAULT", "AVX2", "AVX512", "AVX512_VBMI")
_ISA_FLAGS = {
    "DEFAULT": [],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX512_VBMI": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi",
                    "-mavx2", "-mfma", "-mf16c"],
}


_EXT_LOCKS = {isa: threading.Lock() for isa in ISA_LEVELS}


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:  # Linux; elsewhere the VBMI level is simply not used
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isa_levels() -> tuple[str, ...]:
    """The levels of :data:`ISA_LEVELS` this CPU can run, lowest first (``OUTCORE_CPU_ISA``
    aside): torch's CPU capability (which checks the OS saves the vector registers), plus
    F16C and VBMI from ``/proc/cpuinfo``."""
    cap = torch.backends.cpu.get_cpu_capability()
    best = cap if cap in ("AVX2", "AVX512") else "DEFAULT"
    if _cpu_flags() and "f16c" not in _cpu_flags():
        best = "DEFAULT"
    if best == "AVX512" and "avx512vbmi" in _cpu_flags():
        best = "AVX512_VBMI"
    return ISA_LEVELS[: ISA_LEVELS.index(best) + 1]


def cpu_isa() -> str:
    """The ISA level the CPU extension is built for on this machine.

    The highest level of :data:`ISA_LEVELS` the CPU supports, or the lower one named by
    ``OUTCORE_CPU_ISA`` (to test or rule out a path).

    Raises:
        ValueError: ``OUTCORE_CPU_ISA`` is unknown or above what this CPU supports.
    """
    best = supported_isa_levels()[-1]
    want = os.environ.get("OUTCORE_CPU_ISA", "").upper() or best
    if want not in ISA_LEVELS:
        raise ValueError(f"OUTCORE_CPU_ISA={want!r} is not one of {ISA_LEVELS}")
    if ISA_LEVELS.index(want) > ISA_LEVELS.index(best):
        raise ValueError(f"OUTCORE_CPU_ISA={want!r} is above this CPU's level {best!r}; "
                         f"use one of {ISA_LEVELS[:ISA_LEVELS.index(best) + 1]}")
    return want


def cpu_extension(isa: str | None = None):
    """The compiled CPU extension, or None where it cannot be built or is disabled.

    The first call compiles ``kernels/csrc/adamw8bit_cpu.cpp`` for the ISA level (about
    30-60 s on a 2-core machine, then cached in ``TORCH_EXTENSIONS_DIR`` under a name per
    level, so a cache copied to an older CPU is never loaded there; later processes load it
    in < 1 s). A failed build warns once and returns None: callers fall back to the reference.

    Args:
        isa: one of :data:`ISA_LEVELS` (default :func:`cpu_isa`); must not exceed the CPU's.
    """
    if os.environ.get("OUTCORE_NO_CPP_EXT", "0") == "1":
        return None
    isa = cpu_isa() if isa is None else isa
    if isa not in ISA_LEVELS:
        raise ValueError(f"isa={isa!r} is not one of {ISA_LEVELS}")
    # one build per process and level (levels build side by side in threads: separate
    # compilers); load_extension locks across processes
    with _EXT_LOCKS[isa]:
        if isa not in _EXT:
            _EXT[isa] = _build_extension(isa)
        return _EXT[isa]


def _build_extension(isa: str):
    from ._jit import load_extension

    csrc = Path(__file__).with_name("csrc")
    src = csrc / "adamw8bit_cpu.cpp"
    # -fopenmp: at::parallel_for's OpenMP region is compiled into the extension (it binds to
    # the libgomp torch already loaded). No -ffast-math and no FMA contraction: the update is
    # bit-exact (the quantizer's one FMA is an explicit intrinsic). The digest of every
    # file in csrc/ is a flag because cpp_extension's cache key hashes the sources and flags
    # only, not the headers they include.
    digest = hashlib.sha1(b"".join(f.read_bytes() for f in sorted(csrc.iterdir()) if f.is_file()))
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", *_ISA_FLAGS[isa],
             f"-DOUTCORE_CSRC_DIGEST={digest.hexdigest()[:16]}"]
    try:
        return load_extension(f"outcore_adamw8bit_cpu_{isa.lower()}", sources=[str(src)],
                              extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers, a failed load...: the reference still works
        warnings.warn(f"outcore: could not build the CPU 8-bit AdamW extension ({exc!r}); "
                      "using the slower pure-PyTorch reference", RuntimeWarning, stacklevel=3)
        return None
