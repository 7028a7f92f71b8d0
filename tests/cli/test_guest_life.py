"""A guest's life as its author lives it, through the real `tensorwasm` command line against a real
server process: `new` -> `build` -> `deploy` -> `invoke` from an empty directory, `logs -f`
showing what the guest wrote, `invoke -v` naming the invocation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result

from app.cli import cli
from tests.helpers import ADMIN_TOKEN, EXAMPLES, GUESTS, ServerProcess, server_process


@pytest.fixture(scope="module")
def node(server_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with server_process(tmp_path_factory.mktemp("guest-life"), server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN}) as s:
        yield s


@pytest.fixture
def tw(node: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """Run `tensorwasm ARGS` in-process, from an empty directory (or the one given as cwd)."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str, input: bytes | None = None, env: dict[str, str | None] | None = None, cwd: Path | None = None) -> Result:
        base: dict[str, str | None] = {k: None for k in os.environ if k.startswith("TENSORWASM_")}
        base.update(TENSORWASM_URL=node.url, TENSORWASM_ADMIN_TOKEN=ADMIN_TOKEN)
        base.update(env or {})
        if cwd is not None:
            monkeypatch.chdir(cwd)
        try:
            return CliRunner().invoke(cli, list(args), input=input, env=base, prog_name="tensorwasm")
        finally:
            monkeypatch.chdir(tmp_path)

    return run


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr, result.exception)
    return result


def tenant_key(tw: Callable[..., Result]) -> dict[str, str | None]:
    t = f"t-{uuid.uuid4().hex[:10]}"
    ok(tw("admin", "create-tenant", t))
    return {"TENSORWASM_API_KEY": ok(tw("admin", "create-key", t)).stdout.strip()}


@pytest.mark.parametrize("lang", ["c", "wat"])
def test_new_build_deploy_invoke_from_an_empty_directory(tw: Callable[..., Result], tmp_path: Path, lang: str) -> None:
    key = tenant_key(tw)
    assert list(tmp_path.iterdir()) == []
    made = Path(ok(tw("new", "greeter", "--lang", lang)).stdout.strip())
    d = tmp_path / made
    source = "greeter.c" if lang == "c" else "greeter.wat"
    assert {p.name for p in d.iterdir()} == {source, "tensorwasm.h", "tensorwasm.toml"}
    assert (d / "tensorwasm.h").read_text() == (EXAMPLES / "tensorwasm.h").read_text()  # the project's own header
    manifest = tomllib.loads((d / "tensorwasm.toml").read_text())
    assert manifest["name"] == "greeter" and manifest["source"] == source and manifest["output"] == "greeter.wasm"
    assert manifest["env"] == {"GREETING": "hello"} and manifest["secrets"] == [] and manifest["timeout_ms"] == 5000
    assert ("ziglang cc" in manifest.get("build", "")) == (lang == "c")
    assert tw("new", "greeter").exit_code == 1  # never over an existing directory

    built = ok(tw("build", cwd=d))
    assert built.stdout.strip() == "greeter.wasm" and (d / "greeter.wasm").read_bytes()[:4] == b"\0asm"

    # the manifest's env and content type reach the function
    text = (d / "tensorwasm.toml").read_text().replace('GREETING = "hello"', 'GREETING = "bonjour"')
    (d / "tensorwasm.toml").write_text(text)
    deployed = ok(tw("deploy", cwd=d, env=key))
    fn = json.loads(deployed.stdout)
    assert fn["name"] == "greeter" and fn["content_type"].startswith("text/plain") and fn["timeout_ms"] == 5000
    assert "deployed greeter" in deployed.stderr
    out = ok(tw("invoke", "greeter", input=b"world", env=key)).stdout
    assert out == ("bonjour, world\n" if lang == "c" else "hello, world")

    # deploy with no manifest here says what to do; NAME without FILE is a usage error
    missing = tw("deploy", env=key)
    assert missing.exit_code == 1 and "tensorwasm.toml" in missing.stderr and "tensorwasm new" in missing.stderr
    assert tw("deploy", "greeter", env=key).exit_code == 2


def test_build_reports_a_compile_error(tw: Callable[..., Result], tmp_path: Path) -> None:
    d = tmp_path / Path(ok(tw("new", "broken")).stdout.strip())
    (d / "broken.c").write_text("int main(void) { return nope; }\n")
    failed = tw("build", cwd=d)
    assert failed.exit_code == 1 and "the build failed" in failed.stderr and "nope" in failed.stderr
    (d / "tensorwasm.toml").write_text('name = "bad name"\nsource = "broken.c"\n')
    bad = tw("build", cwd=d)
    assert bad.exit_code == 1 and "name" in bad.stderr and "Traceback" not in bad.stderr


def test_logs_follow_shows_a_guest_line_within_a_second(tw: Callable[..., Result], node: ServerProcess) -> None:
    key = tenant_key(tw)
    ok(tw("deploy", "talker", str(GUESTS / "echo_stderr.wat"), env=key))
    first = ok(tw("invoke", "talker", "-v", input=b"before\n", env=key))
    assert first.stdout == "ok" and first.stderr.startswith("invocation ")
    first_id = first.stderr.split()[1]
    shown = ok(tw("logs", "talker", env=key)).stdout.splitlines()
    assert len(shown) == 1 and shown[0].split()[1:] == [first_id, "v1", "before"]

    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWASM_")}
    env.update(TENSORWASM_URL=node.url, TENSORWASM_API_KEY=str(key["TENSORWASM_API_KEY"]))
    # Ctrl-C as a terminal gives it to a command in the foreground: this suite may itself run as a
    # shell's background job, whose children inherit SIGINT ignored (Python then leaves it so)
    follower = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "logs", "talker", "-f"], env=env, stdout=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: list[tuple[str, float]] = []

    def read() -> None:
        assert follower.stdout is not None
        for line in follower.stdout:
            lines.append((line.rstrip("\n"), time.monotonic()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while not lines and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lines and lines[0][0].endswith(" before")  # the recent lines first
        with httpx.Client(base_url=node.url, headers={"Authorization": f"Bearer {key['TENSORWASM_API_KEY']}"}) as c:
            r = c.post("/v1/functions/talker/invoke", content=b"while followed\n")
        ended = time.monotonic()
        while len(lines) < 2 and time.monotonic() < ended + 10:
            time.sleep(0.01)
        assert len(lines) == 2 and lines[1][0].split()[1:] == [r.headers["X-Invocation-Id"], "v1", "while", "followed"]
        # about half a second on a quiet node (a record batch, then a poll); here the node, the CLI
        # and the test share the host's cores
        assert lines[1][1] - ended < 2.0, f"the line was shown {lines[1][1] - ended:.2f} s after the call ended"
    finally:
        follower.send_signal(signal.SIGINT)
        follower.wait(timeout=10)

    # the same over HTTP: server-sent events, one JSON line each
    with httpx.Client(base_url=node.url, headers={"Authorization": f"Bearer {key['TENSORWASM_API_KEY']}"}, timeout=10) as c:
        with c.stream("GET", "/v1/functions/talker/logs", params={"follow": "1", "limit": "2"}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = []
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if len(events) == 2:
                    break
        assert [e["line"] for e in events] == ["before", "while followed"]
        assert c.get("/v1/functions/nope/logs", params={"follow": "1"}).json()["error"]["code"] == "not_found"
    assert tw("logs", "nope", env=key).exit_code == 1
