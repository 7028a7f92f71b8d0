"""What a tenant reads when its call fails in the runner: where a trap happened only when
wasmtime knows, and never a path of the node's files."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import wasmtime

from app.contract.messages import Run
from app.runtime.artifacts import ArtifactCache
from app.runtime.engine import make_engine
from app.runtime.redact import without_host_paths
from app.runtime.runner import GuestRunner, RunResult
from tests.helpers import compile_artifact, wat

_RECURSE = """
(module (memory (export "memory") 1)
  (func $deeper (param i32) (result i32) (call $deeper (i32.add (local.get 0) (i32.const 1))))
  (func (export "_start") (drop (call $deeper (i32.const 0)))))
"""


@pytest.fixture()
def runner(tmp_path: Path) -> Iterator[tuple[GuestRunner, ArtifactCache]]:
    cache = ArtifactCache(tmp_path / "cache")
    yield GuestRunner(make_engine(), cache, None, 5), cache


def _run(r: GuestRunner, sha: str) -> RunResult:
    return r.run(Run("inv", "f", sha, {}, 10_000, 1 << 20, 1 << 20, 1 << 16), b"")


def test_a_stack_overflow_names_its_function_and_no_sentinel_offset(runner: tuple[GuestRunner, ArtifactCache]) -> None:
    r, cache = runner
    res = _run(r, compile_artifact(cache, bytes(wasmtime.wat2wasm(_RECURSE))))
    assert res.status == "trap" and res.error is not None
    # the recursion (the frames wasmtime keeps of it) as one frame with its count; the innermost
    # has no place: no "(offset 0xffffffffffffffff)"
    assert re.fullmatch(r"trap: call stack exhausted in deeper ×\d+", res.error), res.error


def test_a_trap_keeps_its_cause_and_backtrace(runner: tuple[GuestRunner, ArtifactCache]) -> None:
    r, cache = runner
    res = _run(r, compile_artifact(cache, wat("trap")))
    assert res.status == "trap"
    pattern = r"trap: wasm `unreachable` instruction executed in boom \(offset 0x[0-9a-f]+\) ← function 1 \(offset 0x[0-9a-f]+\)"
    assert res.error is not None and re.fullmatch(pattern, res.error), res.error


_BAD_EXIT = """
(module (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func $leave (call $exit (i32.const 300)))
  (func (export "_start") (call $leave)))
"""


def test_an_error_raised_in_a_wasi_call_keeps_its_cause(runner: tuple[GuestRunner, ArtifactCache]) -> None:
    """A WASI call that fails on the host's side stops the guest with an error whose cause
    wasmtime gives only after its backtrace ("error while executing at wasm backtrace: ...")."""
    r, cache = runner
    res = _run(r, compile_artifact(cache, bytes(wasmtime.wat2wasm(_BAD_EXIT))))
    assert res.status == "trap" and res.error is not None
    assert res.error.startswith("trap: exit with invalid exit status outside of [0..126) in "), res.error
    assert "(offset 0x" in res.error and "backtrace" not in res.error


def test_a_function_name_chosen_by_the_module_is_cut_in_the_message(runner: tuple[GuestRunner, ArtifactCache]) -> None:
    r, cache = runner
    long = "f" * (1 << 20)  # a 1 MiB name in the module's name section
    module = f'(module (memory (export "memory") 1) (func ${long} unreachable) (func (export "_start") (call ${long})))'
    res = _run(r, compile_artifact(cache, bytes(wasmtime.wat2wasm(module))))
    assert res.status == "trap" and res.error is not None
    assert res.error.startswith("trap: wasm `unreachable` instruction executed in ffff") and len(res.error) < 300


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_an_unloadable_artifact_is_reported_without_a_host_path(
    runner: tuple[GuestRunner, ArtifactCache], tmp_path: Path, damage: str
) -> None:
    r, cache = runner
    sha = compile_artifact(cache, bytes(wasmtime.wat2wasm(_RECURSE)))
    if damage == "missing":
        cache.path_for(sha).unlink()
    else:
        cache.path_for(sha).write_bytes(b"not a compiled module")
    res = _run(r, sha)
    assert res.status == "artifact_error" and res.error is not None
    assert res.error.startswith("the function's compiled code could not be loaded: it is")
    assert str(tmp_path) not in res.error and "/" not in res.error and ".cwasm" not in res.error


def test_host_paths_are_cut_out_of_messages() -> None:
    text = "failed deserialization for: /srv/tw/.tensorwasm/cache/modules/ab/cd.cwasm; File \"/opt/app/x.py\", line 3"
    assert without_host_paths(text) == 'failed deserialization for: <path>; File "<path>", line 3'
    kept = "a/b, 1/2, https://example.com/x and ~/relative"
    assert without_host_paths(kept) == kept
