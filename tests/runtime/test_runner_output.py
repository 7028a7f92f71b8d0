"""WASI `fd_write` as the runner serves it (a raw host function): stdout and stderr with their
caps, a bad descriptor or pointer answered as WASI errno, never a crash of the worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import wasmtime

from app.contract.messages import Run
from app.runtime.artifacts import ArtifactCache
from app.runtime.engine import make_engine
from app.runtime.memory import GuestMemory
from app.runtime.runner import GuestRunner, RunResult
from tests.helpers import compile_artifact

# Writes "hi\n" from offset 100 to the descriptor on stdin's first byte ('1', '2', '7') with one
# iovec at `iov`, then exits with fd_write's errno; 0 stdin bytes: write 1 KiB to stdout 64 times.
_WRITER = """
(module
  (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "hi\\n")
  (func (export "_start") (local $fd i32) (local $iov i32) (local $i i32)
    (i32.store (i32.const 0) (i32.const 200)) (i32.store (i32.const 4) (i32.const 8))
    (drop (call $read (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 8)))
    (if (i32.eqz (i32.load (i32.const 8)))
      (then
        (i32.store (i32.const 16) (i32.const 1024)) (i32.store (i32.const 20) (i32.const 1024))
        (loop $l
          (drop (call $write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 24)))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $l (i32.lt_u (local.get $i) (i32.const 64))))
        (return)))
    (local.set $fd (i32.sub (i32.load8_u (i32.const 200)) (i32.const 48)))
    ;; the iovec's place: stdin's second byte 'o' puts it past the end of memory
    (local.set $iov (select (i32.const 65530) (i32.const 32) (i32.eq (i32.load8_u (i32.const 201)) (i32.const 111))))
    (i32.store (i32.const 32) (i32.const 100)) (i32.store (i32.const 36) (i32.const 3))
    (call $exit (call $write (local.get $fd) (local.get $iov) (i32.const 1) (i32.const 40)))))
"""


@pytest.fixture(scope="module", params=["wasmtime's memory", "the worker's memory"])
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GuestRunner, str]]:
    cache = ArtifactCache(Path(tmp_path_factory.mktemp("runner")))
    memory = GuestMemory() if request.param == "the worker's memory" else None
    sha = compile_artifact(cache, bytes(wasmtime.wat2wasm(_WRITER)))
    yield GuestRunner(make_engine(memory), cache, None, 5), sha


def _run(runner: tuple[GuestRunner, str], stdin: bytes, stdout_limit: int = 1 << 20, stderr_limit: int = 1 << 16) -> RunResult:
    r, sha = runner
    return r.run(Run("inv", "f", sha, {}, 10_000, 1 << 20, stdout_limit, stderr_limit), stdin)


def test_stdout_and_stderr_reach_their_sinks(runner: tuple[GuestRunner, str]) -> None:
    out = _run(runner, b"1")
    assert (out.status, out.exit_code, bytes(out.stdout), out.stderr) == ("ok", 0, b"hi\n", b"")
    err = _run(runner, b"2")
    assert (err.status, bytes(err.stdout), err.stderr) == ("ok", b"", b"hi\n")


def test_a_bad_descriptor_or_pointer_is_an_errno_for_the_guest(runner: tuple[GuestRunner, str]) -> None:
    bad_fd = _run(runner, b"7")
    assert (bad_fd.status, bad_fd.exit_code) == ("exit", 8)  # EBADF
    bad_ptr = _run(runner, b"1o")
    assert (bad_ptr.status, bad_ptr.exit_code, bytes(bad_ptr.stdout)) == ("exit", 21, b"")  # EFAULT


def test_stdout_past_its_cap_stops_the_guest_and_the_next_run_is_clean(runner: tuple[GuestRunner, str]) -> None:
    over = _run(runner, b"", stdout_limit=10_000)
    assert over.status == "output_limit"
    assert over.error is not None and "10000 bytes" in over.error
    within = _run(runner, b"", stdout_limit=64 * 1024)
    assert (within.status, len(within.stdout)) == ("ok", 64 * 1024)
    assert bytes(_run(runner, b"1").stdout) == b"hi\n"
