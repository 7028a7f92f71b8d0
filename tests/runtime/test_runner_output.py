"""WASI `fd_write` as the runner serves it (a raw host function): stdout and stderr with their
caps, a bad descriptor or pointer answered as WASI errno, never a crash of the worker. A write
past a cap is read from guest memory only as far as it is kept."""

from __future__ import annotations

import tracemalloc
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

MiB = 1 << 20
_WRITE_SIZE = 64 * MiB

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
    yield GuestRunner(make_engine(memory), cache, None, 5, memory), sha


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


# One fd_write of one 64 MiB iovec (from offset 1024, "BEGIN" at its start, "END!" at its end)
# to the descriptor on stdin's first byte; a second byte 'n' passes 1025 iovecs instead.
_HUGE = f"""
(module
  (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") {(_WRITE_SIZE + 65536) // 65536})
  (data (i32.const 1024) "BEGIN")
  (data (i32.const {1024 + _WRITE_SIZE - 4}) "END!")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 200)) (i32.store (i32.const 4) (i32.const 8))
    (drop (call $read (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 8)))
    (i32.store (i32.const 16) (i32.const 1024)) (i32.store (i32.const 20) (i32.const {_WRITE_SIZE}))
    (call $exit (call $write
      (i32.sub (i32.load8_u (i32.const 200)) (i32.const 48))
      (i32.const 16)
      (select (i32.const 1025) (i32.const 1) (i32.eq (i32.load8_u (i32.const 201)) (i32.const 110)))
      (i32.const 8)))))
"""


@pytest.fixture(scope="module")
def huge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GuestRunner, str]]:
    cache = ArtifactCache(Path(tmp_path_factory.mktemp("huge")))
    memory = GuestMemory()
    sha = compile_artifact(cache, bytes(wasmtime.wat2wasm(_HUGE)))
    yield GuestRunner(make_engine(memory), cache, None, 5, memory), sha
    del memory  # lives as long as the engine that uses it


def _huge_run(huge: tuple[GuestRunner, str], stdin: bytes, stdout_limit: int = MiB, stderr_limit: int = 1 << 16, stream: bool = False) -> RunResult:
    r, sha = huge
    req = Run("inv", "f", sha, {}, 10_000, _WRITE_SIZE + (1 << 20), stdout_limit, stderr_limit)
    req.stream = stream
    return r.run(req, stdin)


def test_a_write_past_the_cap_is_cut_there_and_only_the_kept_part_is_read(huge: tuple[GuestRunner, str]) -> None:
    tracemalloc.start()
    try:
        res = _huge_run(huge, b"1")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.status == "output_limit" and res.error == f"stdout exceeded the limit of {MiB} bytes"
    assert len(res.stdout) == MiB and res.stdout.startswith(b"BEGIN")
    # the 64 MiB iovec was never copied whole: the run allocated about the cap
    assert peak < 2 * MiB, peak


def test_a_streamed_write_past_the_cap_sends_only_the_cap(huge: tuple[GuestRunner, str]) -> None:
    r, _ = huge
    sent: list[bytes] = []
    r.on_stdout = sent.append
    try:
        res = _huge_run(huge, b"1", stream=True)
    finally:
        r.on_stdout = None
    assert res.status == "output_limit" and bytes(res.stdout) == b""
    assert sum(map(len, sent)) == MiB and sent[0].startswith(b"BEGIN")


def test_stderr_keeps_the_tail_of_a_huge_write_without_copying_it(huge: tuple[GuestRunner, str]) -> None:
    tracemalloc.start()
    try:
        res = _huge_run(huge, b"2", stderr_limit=1 << 16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (res.status, res.exit_code) == ("ok", 0)
    assert len(res.stderr) == 1 << 16 and res.stderr.endswith(b"END!")
    assert peak < MiB, peak


def test_an_iovec_table_longer_than_iov_max_is_refused_unread(huge: tuple[GuestRunner, str]) -> None:
    res = _huge_run(huge, b"1n")
    assert (res.status, res.exit_code, bytes(res.stdout)) == ("exit", 28, b"")  # EINVAL


# fd_write with a pointer argument whose i32 is "negative": stdin's first byte picks which
_POINTERS = """
(module
  (import "wasi_snapshot_preview1" "fd_read" (func $read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "hi\\n")
  (func (export "_start") (local $which i32)
    (i32.store (i32.const 0) (i32.const 200)) (i32.store (i32.const 4) (i32.const 1))
    (drop (call $read (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 8)))
    (local.set $which (i32.load8_u (i32.const 200)))
    (i32.store (i32.const 32) (i32.const 100)) (i32.store (i32.const 36) (i32.const 3))
    (if (i32.eq (local.get $which) (i32.const 49))  ;; '1': nwritten just below the memory
      (then (call $exit (call $write (i32.const 2) (i32.const 32) (i32.const 1) (i32.const -4)))))
    (if (i32.eq (local.get $which) (i32.const 50))  ;; '2': the iovec table below it
      (then (call $exit (call $write (i32.const 2) (i32.const -8) (i32.const 1) (i32.const 40)))))
    (if (i32.eq (local.get $which) (i32.const 51))  ;; '3': nwritten 160 MiB below it
      (then (call $exit (call $write (i32.const 2) (i32.const 32) (i32.const 1) (i32.const -167772160)))))
    (call $exit (call $write (i32.const 2) (i32.const 32) (i32.const -1) (i32.const 40)))))  ;; a "negative" count
"""


@pytest.mark.parametrize("memory", ["wasmtime's memory", "the worker's memory"])
def test_pointers_are_unsigned_and_none_reaches_below_the_guests_memory(memory: str, tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path)
    # held here: the engine holds only the callbacks of its memory creator, which must outlive it
    creator = GuestMemory() if memory == "the worker's memory" else None
    runner = GuestRunner(make_engine(creator), cache, None, 5, creator)
    sha = compile_artifact(cache, bytes(wasmtime.wat2wasm(_POINTERS)))
    for which, errno in ((b"1", 21), (b"2", 21), (b"3", 21), (b"4", 28)):  # EFAULT, or EINVAL for the count
        res = runner.run(Run("inv", "f", sha, {}, 10_000, 1 << 20, 1 << 20, 1 << 16), which)
        assert (res.status, res.exit_code, res.stderr) == ("exit", errno, b""), which
    ok = runner.run(Run("inv", "f", sha, {}, 10_000, 1 << 20, 1 << 20, 1 << 16), b"1")
    assert ok.exit_code == 21  # and the runner goes on serving
