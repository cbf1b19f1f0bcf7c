"""isa: run a benchmark on onnxruntime's AVX2 code path of an AVX-512/VNNI/AMX machine.

onnxruntime's MLAS picks its kernels once per process from the CPUID instruction (``MLAS_PLATFORM``
in ``onnxruntime/core/mlas/lib/platform.cpp``): AVX2/FMA3 kernels when leaf 7 EBX bit 5 (and leaf 1
ECX bit 12) are set, AVX-VNNI (VEX) u8s8 kernels when leaf 7 subleaf 1 EAX bit 4 is set, AVX-512
kernels when leaf 7 EBX bit 16 is set *and* XCR0 has the AVX-512 state, AVX-512 core with bits 17,
30, 31, AVX-512 VNNI with ECX bit 11, AMX with EDX bits 24 and 25 and the tile state in XCR0. So a
process whose CPUID reports those bits clear runs the AVX2 kernels, on the same silicon.

`cpuid_mask.c` does that with Linux CPUID faulting (``arch_prctl(ARCH_SET_CPUID, 0)``; the CPU needs
the ``cpuid_fault`` flag): loaded with ``LD_PRELOAD``, it traps each CPUID instruction and clears the
AVX-512, VNNI and AMX bits (see its header for the list, the sources of the bit positions, and what it
cannot mask). `build_shim` compiles it with the system C compiler into the work directory;
`masked_env` is the environment of a child process on that path; `report` says, from inside a
process, whether the mask is on and what CPUID and numpy's runtime dispatch see there.

Masks (`MASKS`): ``avx2`` (an AVX2 CPU without any VNNI: Haswell to Coffee Lake, Zen 1-3) and
``avx2-vnni`` (AVX2 plus AVX-VNNI, whose VEX ``vpdpbusd`` kernels MLAS has for u8s8: Alder Lake class).
"""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Optional

SOURCE = Path(__file__).with_name("cpuid_mask.c")
LIBRARY = "libonnx_qat_cpuid_mask.so"
#: The environment variable the library reads (``avx2``, ``avx2-vnni``, ``off``).
MASK_VARIABLE = "ONNX_QAT_CPUID_MASK"
MASKS = {"avx2": "AVX2 without VNNI (AVX-512, AVX-VNNI and AMX masked)",
         "avx2-vnni": "AVX2 with AVX-VNNI (AVX-512 and AMX masked)"}
#: ``name: (leaf, subleaf, register index EAX=0 .. EDX=3, bit)`` of the CPUID bits MLAS reads, and the
#: ``/proc/cpuinfo`` flag of each. Intel SDM vol. 2A, CPUID leaf 07H; Linux cpufeatures.h.
BITS = {"avx2": (7, 0, 1, 5), "avx512f": (7, 0, 1, 16), "avx512dq": (7, 0, 1, 17),
        "avx512bw": (7, 0, 1, 30), "avx512vl": (7, 0, 1, 31), "avx512_vnni": (7, 0, 2, 11),
        "avx512_fp16": (7, 0, 3, 23), "amx_bf16": (7, 0, 3, 22), "amx_tile": (7, 0, 3, 24),
        "amx_int8": (7, 0, 3, 25), "avx_vnni": (7, 1, 0, 4), "avx512_bf16": (7, 1, 0, 5)}
#: The bits each mask clears (all of `BITS` but AVX2, and AVX-VNNI too for ``avx2``).
CLEARED = {"avx2": tuple(b for b in BITS if b != "avx2"),
           "avx2-vnni": tuple(b for b in BITS if b not in ("avx2", "avx_vnni"))}


class Unavailable(RuntimeError):
    """The AVX2 path cannot be set up here (not Linux x86-64, no ``cpuid_fault``, no C compiler)."""


def cpu_flags() -> set:
    """The flags of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") and ":" in line
            for f in line.split(":", 1)[1].split()}


def why_unavailable() -> Optional[str]:
    """Why this machine cannot run the mask, or None when it can (a compiler is checked by
    `build_shim`)."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"CPUID faulting is a Linux x86-64 feature; this is {platform.system()} {platform.machine()}"
    if "cpuid_fault" not in cpu_flags():
        return ("this CPU (or its hypervisor) has no cpuid_fault flag in /proc/cpuinfo: CPUID cannot be "
                "trapped, so onnxruntime's AVX2 kernels cannot be selected on it")
    return None


def compiler() -> Optional[str]:
    """The C compiler to build the library with (``$CC``, ``cc``, ``gcc``, ``clang``), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_shim(workdir: Path) -> Path:
    """Compile `cpuid_mask.c` into ``workdir`` (again when the source is newer) and return the library.

    Raises:
        Unavailable: `why_unavailable`, no C compiler, or the compiler failed (its message).
    """
    why = why_unavailable()
    if why:
        raise Unavailable(why)
    cc = compiler()
    if cc is None:
        raise Unavailable("no C compiler (cc, gcc, clang or $CC) to build the CPUID mask library")
    out = Path(workdir) / LIBRARY
    if out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise Unavailable(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-300:]}")
    os.replace(tmp, out)
    return out


def masked_env(library: Path, mask: str = "avx2") -> Dict[str, str]:
    """Environment entries for a child process on the ``mask`` path (`MASKS`). ``PYTHONFAULTHANDLER``
    is emptied: Python's faulthandler would take SIGSEGV from the library's handler at startup, and
    the next CPUID instruction would then end the process."""
    if mask not in MASKS and mask != "off":
        raise ValueError(f"unknown mask {mask!r}; one of {', '.join(MASKS)}")
    preload = " ".join(p for p in (str(library), os.environ.get("LD_PRELOAD", "")) if p)
    return {"LD_PRELOAD": preload, MASK_VARIABLE: mask, "PYTHONFAULTHANDLER": ""}


def _loaded_library():
    """The mask library if this process has it loaded (by ``LD_PRELOAD``), else None: never loads it
    (loading it turns the mask on)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        if line.endswith(LIBRARY):
            return ctypes.CDLL(line.split(None, 5)[-1])
    return None


def cpuid(library, leaf: int, subleaf: int):
    """EAX..EDX of the CPUID instruction run in this process (through the loaded ``library``)."""
    out = (ctypes.c_uint32 * 4)()
    library.onnx_qat_cpuid(ctypes.c_uint32(leaf), ctypes.c_uint32(subleaf), out)
    return tuple(int(v) for v in out)


def features(library) -> Dict[str, bool]:
    """`BITS` as this process's CPUID reports them."""
    regs = {(7, 0): cpuid(library, 7, 0), (7, 1): cpuid(library, 7, 1)}
    return {name: bool(regs[(leaf, sub)][reg] >> bit & 1) for name, (leaf, sub, reg, bit) in BITS.items()}


def numpy_features() -> Dict[str, bool]:
    """numpy's runtime CPU dispatch (its own CPUID and XCR0 reading at import) for AVX2, AVX512F,
    AVX512BW and AVX512VNNI."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as found
    except ImportError:  # numpy < 2
        from numpy.core._multiarray_umath import __cpu_features__ as found
    return {k: bool(found.get(k)) for k in ("AVX2", "AVX512F", "AVX512BW", "AVX512VNNI")}


def report() -> Dict[str, object]:
    """This process: ``mask`` (None when the library is not loaded), ``state`` (1: CPUID faulting on,
    negative: the library could not turn it on), ``traps`` (CPUID instructions answered so far),
    ``cpuid`` (`features`), ``numpy`` (`numpy_features`)."""
    library = _loaded_library()
    if library is None:
        return {"mask": None, "state": 0, "traps": 0, "cpuid": {}, "numpy": numpy_features()}
    return {"mask": os.environ.get(MASK_VARIABLE, "avx2"), "state": int(library.onnx_qat_cpuid_mask_state()),
            "traps": int(library.onnx_qat_cpuid_traps()), "cpuid": features(library),
            "numpy": numpy_features()}


def check_masked(mask: str) -> Dict[str, object]:
    """`report`, after checking that this process runs on the ``mask`` path: the library is loaded and
    on, every bit of `CLEARED` reads 0, AVX2 reads 1, numpy's dispatch sees no AVX-512.

    Raises:
        Unavailable: any of these does not hold (the message says which).
    """
    seen = report()
    if seen["mask"] is None or seen["state"] != 1:
        raise Unavailable(f"CPUID mask not active in this process (library loaded: "
                          f"{seen['mask'] is not None}, state {seen['state']})")
    left = [b for b in CLEARED[mask] if seen["cpuid"].get(b)]
    if left or not seen["cpuid"].get("avx2") or seen["numpy"]["AVX512F"]:
        raise Unavailable(f"CPUID mask {mask!r} incomplete: still set {left}, avx2 "
                          f"{seen['cpuid'].get('avx2')}, numpy AVX512F {seen['numpy']['AVX512F']}")
    return seen


def describe(seen: Dict[str, object]) -> str:
    """One line for a row's detail: the mask, what CPUID and numpy report inside the process."""
    if seen.get("mask") is None:
        return "native CPUID"
    cpu = seen["cpuid"]
    on = ",".join(k for k, v in cpu.items() if v) or "none"
    off = ",".join(k for k, v in cpu.items() if not v) or "none"
    return (f"CPUID mask {seen['mask']} ({seen['traps']} CPUID instructions trapped): set {on}; clear {off}; "
            f"numpy dispatch AVX512F {seen['numpy']['AVX512F']}, AVX2 {seen['numpy']['AVX2']}")
