"""A compile process: `python -m app.sandbox.child --parent PID`.

Started ahead of need by the api process (`app.sandbox.pool`), it imports the compiler, says
`ready`, then takes exactly one job from stdin, runs it under the memory limit the job names,
answers with one JSON line on stdout and exits. One job per process: no tenant's compile ever
shares a process, a heap or a crash with another's.

Protocol. In: one JSON line `{"kind": "wasm"|"cuda", "size": N, "memory_bytes": M, ...}`, then N
bytes of payload (the module, or the UTF-8 CUDA source). Out: `ready\n` at start, then one JSON
line `{"outcome": "ok"|"invalid"|"memory", ..., "max_rss": bytes}`. A limit the process cannot
report itself (an allocation failure aborts the Rust compiler) the parent reads from the way it
died; the time limit is the parent's: it kills the process.
"""

from __future__ import annotations

import signal

# Ctrl-C reaches the whole process group; the process that started this one stops it. Ignored
# before the compiler's import (most of a start): there a KeyboardInterrupt printed a traceback.
signal.signal(signal.SIGINT, signal.SIG_IGN)

import argparse  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from typing import Any, BinaryIO  # noqa: E402

from app.runtime.engine import make_engine  # noqa: E402
from app.runtime.validation import InvalidModule, check_module, compile_module, has_start_function  # noqa: E402
from app.sandbox.errors import looks_like_oom  # noqa: E402

PR_SET_PDEATHSIG = 1
# (module (func (export "f") (param i32) (result i32) local.get 0 i32.const 1 i32.add)
#   (func (export "g") (result i32) i32.const 2))
WARMUP_MODULE = bytes.fromhex(
    "0061736d01000000010a0260017f017f6000017f03030200010709020166000001670001"
    "0a0e020700200041016a0b040041020b"
)


def die_with_parent(parent: int) -> None:
    """Be killed the moment the api process goes, even if it is killed with SIGKILL.

    The signal is tied to the thread that started us: the api process starts compile processes
    from its event-loop thread, which lives as long as the process.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def limit_memory(memory_bytes: int) -> None:
    """Cap this process's address space (everything it maps, the interpreter included)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def compile_wasm(engine: Any, job: dict[str, Any], payload: bytes) -> dict[str, Any]:
    try:
        module = compile_module(engine, payload)
        info = check_module(module)
    except InvalidModule as exc:
        if looks_like_oom(str(exc)):
            return {"outcome": "memory"}
        return {"outcome": "invalid", "message": str(exc)}
    data = module.serialize()
    # the parent created this file (0600, in the artifact cache) and adopts it after our answer
    with open(job["artifact"], "wb") as f:
        f.write(data)
    return {
        "outcome": "ok",
        "imports": info.imports,
        "uses_gpu": info.uses_gpu,
        "start_function": has_start_function(payload),
        "artifact_bytes": len(data),
    }


def check_cuda(job: dict[str, Any], payload: bytes) -> dict[str, Any]:
    from app.gpu.nvrtc_check import check_cuda_source, compiler_available

    if not compiler_available():
        return {"outcome": "ok", "checked": False}
    log = check_cuda_source(payload.decode("utf-8"), job.get("arch"))
    if log is None:
        return {"outcome": "ok", "checked": True}
    if looks_like_oom(log):  # NVRTC reports a failed allocation as a compile error
        return {"outcome": "memory"}
    return {"outcome": "invalid", "message": log}


def prepare(kind: str) -> None:
    """Load what the job needs before the limit: libraries are the platform's cost, not the code's."""
    if kind == "cuda":
        from app.gpu.nvrtc_check import compiler_available

        compiler_available()  # loads NVRTC (on a GPU node: over 1 GiB of address space at once)


def serve_one(engine: Any, inp: BinaryIO, out: BinaryIO) -> int:
    out.write(b"ready\n")
    out.flush()
    line = inp.readline()
    if not line:  # the pool was closed before handing us a job
        return 0
    job = json.loads(line)
    payload = inp.read(int(job["size"]))
    prepare(job["kind"])
    limit_memory(int(job["memory_bytes"]))
    try:
        if job["kind"] == "wasm":
            result = compile_wasm(engine, job, payload)
        elif job["kind"] == "cuda":
            result = check_cuda(job, payload)
        else:
            result = {"outcome": "invalid", "message": f"unknown job kind {job['kind']!r}"}
    except MemoryError:
        result = {"outcome": "memory"}
    result["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write(json.dumps(result).encode() + b"\n")
    out.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="app.sandbox.child")
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the api process
    engine = make_engine()  # before the limit: the same for every job, and ready before it comes
    # the compiler's first-use costs (its thread pool, code memory) are paid here, not by the job
    compile_module(engine, WARMUP_MODULE).serialize()
    return serve_one(engine, sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    sys.exit(main())
