"""A call's WASI context as the runner sets it (app/runtime/wasi.py): argv, the environment and
stdin reach the guest exactly, call after call, and nothing of one call reaches the next; on an
instance built at the call and on one built ahead of it (`GuestRunner.prepare`) alike."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import wasmtime

from app.bench.invoke import ECHO_WAT
from app.contract.messages import Run
from app.runtime.artifacts import ArtifactCache
from app.runtime.engine import make_engine
from app.runtime.memory import GuestMemory
from app.runtime.runner import GuestRunner, RunResult
from app.runtime.wasi import WasiContexts
from tests.helpers import compile_artifact

Guests = tuple[GuestRunner, dict[str, str], bool]  # the runner, guests' sha256 by name, built ahead


@pytest.fixture(scope="module", params=["built at the call", "built ahead"])
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, c_guest: Callable[[str], bytes]) -> Iterator[Guests]:
    cache = ArtifactCache(Path(tmp_path_factory.mktemp("wasi")))
    shas = {
        "echo": compile_artifact(cache, bytes(wasmtime.wat2wasm(ECHO_WAT))),
        "hello": compile_artifact(cache, c_guest("hello.c")),
    }
    memory = GuestMemory()  # its callbacks must outlive the engine: this frame holds it meanwhile
    yield GuestRunner(make_engine(memory), cache, None, 5, memory), shas, request.param == "built ahead"


def _run(runner: Guests, guest: str, stdin: bytes, env: dict[str, str] | None = None, name: str = "") -> RunResult:
    r, shas, ahead = runner
    req = Run("inv", name or guest, shas[guest], env or {}, 10_000, 64 << 20, 4 << 20, 1 << 16)
    if ahead:
        r.run(req, b"")  # loads the module: only a loaded one is built ahead
        r.prepare(req)
        assert r._ready is not None
    res = r.run(req, stdin)
    assert res.status == "ok", res.error
    return res


def _lines(res: RunResult) -> dict[str, str]:
    return dict(line.split("=", 1) for line in bytes(res.stdout).decode().splitlines())


@pytest.mark.parametrize("body", [b"hello", b"\x00\xff\x00 binary \x00", bytes(range(256)) * 4096], ids=["text", "nul-bytes", "1-MiB"])
def test_stdin_reaches_the_guest_byte_for_byte(runner: Guests, body: bytes) -> None:
    assert bytes(_run(runner, "echo", body).stdout) == body


def test_an_empty_body_reads_as_end_of_file(runner: Guests) -> None:
    _run(runner, "echo", b"long enough to be seen if it stayed")
    assert bytes(_run(runner, "echo", b"").stdout) == b""


def test_argv_and_environment(runner: Guests) -> None:
    lines = _lines(_run(runner, "hello", b"world", {"GREETING": "grüße, 世界", "TW_TENANT": "acme"}, name="greeter"))
    assert lines["argv0"] == "greeter" and lines["GREETING"] == "grüße, 世界" and lines["TW_TENANT"] == "acme"
    assert lines["body"] == "world"
    # the next call sees its own environment only, under its own name
    lines = _lines(_run(runner, "hello", b"", {"TW_FUNCTION": "x"}, name="other"))
    assert lines["argv0"] == "other" and lines["GREETING"] == "" and lines["TW_TENANT"] == "" and lines["TW_FUNCTION"] == "x"


def test_argv_stays_right_past_its_cache(runner: Guests) -> None:
    r, _, _ = runner
    r._wasi = WasiContexts(argv_cache=2)  # a small cache: names come and go from it
    for name in ["a", "b", "c", "a", "d", "b"] * 3:
        assert _lines(_run(runner, "hello", b"", name=name))["argv0"] == name
