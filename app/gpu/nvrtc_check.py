"""Compile-check CUDA source at upload time with NVRTC, without creating a CUDA context.

Runs inside a compile process (`app.sandbox.child`), never in a serving process: NVRTC is a
pure compiler library, and a tenant's source can make it take any amount of time and memory.
"""

from __future__ import annotations

import functools
from typing import Any

# nvrtcResult NVRTC_ERROR_OUT_OF_MEMORY: reported, not raised, when an allocation fails
NVRTC_ERROR_OUT_OF_MEMORY = 1


@functools.lru_cache(maxsize=1)
def _nvrtc() -> Any:  # cupy_backends' nvrtc module (untyped), or None
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return nvrtc
    except Exception:
        return None


def compiler_available() -> bool:
    return _nvrtc() is not None


def check_cuda_source(source: str, arch: str | None = None) -> str | None:
    """None if the source compiles (or no compiler is present here), else the compiler log.

    Raises MemoryError when NVRTC ran out of memory (the compile process's limit).
    """
    nvrtc = _nvrtc()
    if nvrtc is None:
        return None
    options = ["-std=c++17"] + ([f"--gpu-architecture=compute_{arch}"] if arch else [])
    prog = nvrtc.createProgram(source, "kernel.cu", [], [])
    try:
        nvrtc.compileProgram(prog, options)
        return None
    except nvrtc.NVRTCError as exc:
        if getattr(exc, "status", None) == NVRTC_ERROR_OUT_OF_MEMORY:
            raise MemoryError("NVRTC ran out of memory") from None
        log = nvrtc.getProgramLog(prog)
        return (log.decode() if isinstance(log, bytes) else str(log)).strip()[:4000] or "compilation failed"
    finally:
        nvrtc.destroyProgram(prog)
