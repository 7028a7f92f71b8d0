"""The ABI host's error mapping for failures a CPU worker cannot produce naturally
(compile, launch and device failures, host bugs), with a fault-injecting backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.contract.messages import Run
from app.gpu.abi import AbiHost
from app.gpu.backend import BackendError, DeviceInfo, DeviceLimits
from app.gpu.cpu import CpuBackend
from app.gpu.signatures import Code
from app.runtime.artifacts import ArtifactCache
from app.runtime.engine import make_engine
from app.runtime.memory import GuestMemory
from app.runtime.runner import GuestRunner
from tests.gpu.runner import Buf, abi_code, rec_buf, rec_i32, request
from tests.helpers import compile_artifact


class FaultyGpu(CpuBackend):
    """A pretend GPU whose compiler and device fail on request."""

    def __init__(self) -> None:
        super().__init__()
        self.info = DeviceInfo("cuda", "fake", "90", 1 << 34, DeviceLimits())
        self.repeats = 0  # launches of `fails_when_repeated` so far

    def load_module(self, source: bytes, fmt: int) -> Any:
        if b"syntax error" in source:
            raise BackendError(Code.COMPILE_FAILED, "module_load: kernel.cu(1): error: expected a ';'")
        return {"source": source}

    def get_function(self, module: Any, name: str) -> Any:
        return name

    def prepare(self, fn: Any, grid: Any, block: Any, shared: int, args: list[Any]) -> Any:
        return lambda: self.launch(fn)

    def launch(self, fn: Any) -> None:
        if fn == "too_many_resources":
            raise BackendError(Code.LAUNCH_FAILED, "launch: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")
        if fn == "wild_pointer":
            raise BackendError(Code.DEVICE_ERROR, "launch: CUDA_ERROR_ILLEGAL_ADDRESS")
        if fn == "host_bug":
            raise ZeroDivisionError("oops")
        if fn == "fails_when_repeated":
            self.repeats += 1
            if self.repeats > 1:
                raise BackendError(Code.LAUNCH_FAILED, "launch: CUDA_ERROR_LAUNCH_TIMEOUT")


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory, c_guest) -> tuple[GuestRunner, AbiHost, str]:
    cache = tmp_path_factory.mktemp("artifacts")
    sha = compile_artifact(ArtifactCache(cache), c_guest("kernel_runner.c"))
    host = AbiHost(FaultyGpu())
    host.bind(1 << 20)
    return GuestRunner(make_engine(), ArtifactCache(cache), host, 5), host, sha


def _run(runner: tuple[GuestRunner, AbiHost, str], body: bytes) -> Any:
    r, _, sha = runner
    return r.run(Run("inv", "runner", sha, {}, 5000, 1 << 26, 1 << 20, 1 << 16), body)


def _kernel(name: str, source: bytes = b'extern "C" __global__ void k() {}') -> bytes:
    return request(name, [Buf(16)], [rec_buf(0), rec_i32(1)], [0], module=source, kind=1)


def test_compile_failed(runner) -> None:
    res = _run(runner, _kernel("k", b"syntax error"))
    assert res.status == "exit" and abi_code(res.exit_code) == Code.COMPILE_FAILED
    assert b"expected a ';'" in res.stderr


def test_launch_failed(runner) -> None:
    res = _run(runner, _kernel("too_many_resources"))
    assert abi_code(res.exit_code) == Code.LAUNCH_FAILED and b"OUT_OF_RESOURCES" in res.stderr


def test_host_bug_is_internal_not_a_trap(runner) -> None:
    res = _run(runner, _kernel("host_bug"))
    assert res.status == "exit" and abi_code(res.exit_code) == Code.INTERNAL
    assert b"internal error (ZeroDivisionError)" in res.stderr


def test_a_good_kernel_runs(runner) -> None:
    res = _run(runner, _kernel("fine"))
    assert res.status == "ok" and res.stdout == bytes(16)


def test_device_error_is_sticky_and_reported(tmp_path: Path, c_guest) -> None:
    sha = compile_artifact(ArtifactCache(tmp_path), c_guest("kernel_runner.c"))
    host = AbiHost(FaultyGpu())
    host.bind(1 << 20)
    r = GuestRunner(make_engine(), ArtifactCache(tmp_path), host, 5)
    res = r.run(Run("inv", "runner", sha, {}, 5000, 1 << 26, 1 << 20, 1 << 16), _kernel("wild_pointer"))
    assert res.status == "device_error" and "ILLEGAL_ADDRESS" in (res.error or "")
    assert res.host["device_error"] is True
    # the context is poisoned: every later GPU call of this worker answers DEVICE_ERROR
    res = r.run(Run("inv2", "runner", sha, {}, 5000, 1 << 26, 1 << 20, 1 << 16), _kernel("fine"))
    assert res.status == "device_error"


def test_a_guest_that_exports_no_memory_gets_invalid_pointer(tmp_path: Path) -> None:
    """Its memory is read through wasmtime's C API: no `memory` export is a code, not a trap."""
    import wasmtime

    wat = f"""(module
      (import "tensorwasm" "module_get" (func $get (param i32 i32) (result i32)))
      (memory 1)
      (data (i32.const 0) "std")
      (func (export "_start")
        (if (i32.ne (call $get (i32.const 0) (i32.const 3)) (i32.const {int(Code.INVALID_POINTER)})) (then unreachable))))"""
    cache = ArtifactCache(tmp_path)
    sha = compile_artifact(cache, wasmtime.wat2wasm(wat))
    host = AbiHost(CpuBackend())
    host.bind(1 << 20)
    res = GuestRunner(make_engine(), cache, host, 5).run(Run("inv", "f", sha, {}, 5000, 1 << 26, 1 << 20, 1 << 16), b"")
    assert res.status.value == "ok", res.error


def _worker_like(tmp_path: Path, c_guest) -> tuple[GuestRunner, AbiHost, str, list[int]]:
    """A runner with the worker's reused guest memory (the repeated-launch path needs its
    region), and a count of the launches that took the general path."""
    sha = compile_artifact(ArtifactCache(tmp_path), c_guest("kernel_runner.c"))
    memory = GuestMemory()
    host = AbiHost(FaultyGpu(), guest_memory=memory)
    host.bind(1 << 20)
    general, launch = [0], host._launch

    def counted(*args: Any) -> int:
        general[0] += 1
        return launch(*args)

    host._launch = counted  # type: ignore[method-assign]
    return GuestRunner(make_engine(memory), ArtifactCache(tmp_path), host, 5, memory), host, sha, general


def test_a_repeated_launch_runs_its_prepared_form_without_the_general_path(tmp_path: Path, c_guest) -> None:
    r, host, sha, general = _worker_like(tmp_path, c_guest)
    body = request("fine", [Buf(16)], [rec_buf(0), rec_i32(1)], [0], module=b'extern "C" __global__ void k() {}', kind=1, repeat=5)
    res = r.run(Run("inv", "runner", sha, {}, 5000, 1 << 26, 1 << 20, 1 << 16), body)
    assert res.status == "ok" and res.host["launches"] == 5
    assert general == [1]  # the first launch prepared it; the other four repeated it
    # traced, every launch goes the general way, which times it for the run's spans
    res = r.run(Run("inv2", "runner", sha, {}, 5000, 1 << 26, 1 << 20, 1 << 16, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"), body)
    assert res.status == "ok" and general == [6]
    launches = [s for s in res.spans or [] if s["name"] == "abi.launch"]
    assert launches and launches[0]["attributes"]["tensorwasm.abi.calls"] == 5


def test_a_repeated_launch_that_fails_answers_its_code(tmp_path: Path, c_guest) -> None:
    r, host, sha, general = _worker_like(tmp_path, c_guest)
    body = request("fails_when_repeated", [Buf(16)], [rec_buf(0), rec_i32(1)], [0], module=b'extern "C" __global__ void k() {}', kind=1, repeat=3)
    res = r.run(Run("inv", "runner", sha, {}, 5000, 1 << 26, 1 << 20, 1 << 16), body)
    assert res.status == "exit" and abi_code(res.exit_code) == Code.LAUNCH_FAILED
    assert b"LAUNCH_TIMEOUT" in res.stderr and general == [1] and host.poisoned is None


class CountingGpu(CpuBackend):
    def __init__(self) -> None:
        super().__init__()
        self.ends = 0

    def end_invocation(self) -> None:
        self.ends += 1


def test_only_an_invocation_that_made_handles_waits_for_the_device() -> None:
    """A guest that never used the device (an echo) has nothing on the stream: no synchronize."""
    backend = CountingGpu()
    host = AbiHost(backend)
    host.begin("inv-1", None)
    assert host.end()["launches"] == 0 and backend.ends == 0
    host.begin("inv-2", None)
    assert host.inst is not None
    host.inst.add(object())  # any handle: a buffer, a module
    host.end()
    assert backend.ends == 1
