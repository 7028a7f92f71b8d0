"""The README's walk-through runs as written: its shell blocks go through bash, command by command,
against a real `tensorwasm serve` started the way the README's set-up starts it (a fresh
directory, SQLite in ./.tensorwasm, a generated admin token), on the CPU backend and a free port.
Every command must succeed, and the outputs the README promises must appear. The section
"Command line and Python client", when the README has it, runs after the walk-through in the
same shell, where a reader would run it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.helpers import EXAMPLES, ROOT

README = ROOT / "README.md"
WALK_THROUGH = "Walk-through with curl"
CLIENT_SECTION = "Command line and Python client"  # run too, when the README has it


def _section_blocks(title: str) -> list[str] | None:
    """The ```sh blocks of the README section whose heading starts with `title` (None if absent)."""
    lines = README.read_text().splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(rf"#+ {re.escape(title)}", ln)), None)
    if start is None:
        return None
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    blocks: list[str] = []
    current: list[str] | None = None  # lines of the ```sh block being read
    fenced = False
    for line in lines[start + 1 :]:
        if line.startswith("```"):
            if not fenced and line.strip() == "```sh":
                current = []
            elif fenced and current is not None:
                blocks.append("\n".join(current) + "\n")
                current = None
            fenced = not fenced
        elif fenced:
            if current is not None:
                current.append(line)
        elif (m := re.match(r"(#+) ", line)) and len(m.group(1)) <= level:
            break  # the next section
    return blocks


def _commands(block: str) -> list[str]:
    """Logical shell commands: continuation lines joined, here-documents kept with the command
    that opens them, comment-only and blank lines dropped."""
    commands: list[str] = []
    pending = ""
    heredoc: str | None = None
    for line in block.splitlines():
        if heredoc is None and not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line + "\n"
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            else:
                continue
        elif (m := re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)) is not None:
            heredoc = m.group(1)
            continue
        if not line.rstrip().endswith("\\"):
            commands.append(pending.rstrip("\n"))
            pending = ""
    assert not pending, f"a command ends in a continuation or an open here-document: {pending!r}"
    return commands


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry_point() -> tuple[str, str]:
    """The `tensorwasm` console script as pyproject.toml declares it (module, function)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["tensorwasm"].partition(":")
    return module, func


def _environment(tmp: Path, port: int) -> dict[str, str]:
    """What a shell after the README's set-up has: `tensorwasm` and `python3` (this interpreter,
    with this tree first on the path) on PATH, no TENSORWASM_* settings but the test's own."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    module, func = _entry_point()
    script = bin_dir / "tensorwasm"
    script.write_text(
        f"#!/bin/sh\nexec '{sys.executable}' -c 'import sys; from {module} import {func} as main; "
        f"sys.argv[0] = \"tensorwasm\"; sys.exit(main())' \"$@\"\n"
    )
    script.chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWASM_")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        TENSORWASM_BACKEND="cpu",
        TENSORWASM_HOST="127.0.0.1",
        TENSORWASM_PORT=str(port),
        TENSORWASM_MAX_WORKERS="2",
        TW=f"http://127.0.0.1:{port}",
        TENSORWASM_URL=f"http://127.0.0.1:{port}",
    )
    return env


@contextmanager
def _server(tmp: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """`tensorwasm serve` in a fresh directory holding a copy of examples/; yields (cwd, env)."""
    work = tmp / "work"
    work.mkdir()
    shutil.copytree(EXAMPLES, work / "examples")
    port = _free_port()
    env = _environment(tmp, port)
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(
        ["tensorwasm", "serve"], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"tensorwasm serve exited:\n{(tmp / 'serve.log').read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready in 90 s:\n{(tmp / 'serve.log').read_text()[-3000:]}"
            time.sleep(0.2)
        assert (work / ".tensorwasm" / "admin_token").exists(), "serve did not write ./.tensorwasm/admin_token"
        yield work, env
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _run_block_commands(commands: list[str], cwd: Path, env: dict[str, str], tmp: Path) -> list[str]:
    """Run the commands in one bash session (so variables carry over), stopping at the first that
    fails; returns each command's stdout."""
    lines = ["set -eo pipefail"]
    for i, cmd in enumerate(commands):
        lines += [f"printf '\\n@@step {i}@@\\n'", cmd]
    lines.append("printf '\\n@@step end@@\\n'")
    script = tmp / "block.sh"
    script.write_text("\n".join(lines) + "\n")
    res = subprocess.run(["bash", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    parts = re.split(r"\n@@step (\d+|end)@@\n", "\n" + res.stdout)
    reached = parts[1::2]
    if res.returncode != 0 or not reached or reached[-1] != "end":
        failed = reached[-1] if reached else "0"
        which = commands[int(failed)] if failed.isdigit() else "(after the last command)"
        pytest.fail(
            f"README command failed (exit {res.returncode}):\n{which}\n--- stdout ---\n{parts[-1]}\n--- stderr ---\n{res.stderr[-3000:]}"
        )
    return parts[2::2][: len(commands)]


def _json(out: str) -> object:
    return json.loads(out)


def _error(out: str) -> dict[str, object]:
    return _json(out)["error"]  # type: ignore[index,no-any-return]


# What the walk-through promises, by a fragment that picks out exactly one of its commands.
WALK_THROUGH_EXPECTS: dict[str, Callable[[str], bool]] = {
    "wasmtime.wat2wasm(open('examples/echo.wat')": lambda out: out == "",
    "PUT $TW/v1/functions/echo ": lambda out: _json(out)["name"] == "echo" and _json(out)["version"] == 1,  # type: ignore[index]
    "functions/echo/invoke": lambda out: out == "hello",
    "examples/hello.c -o hello.wasm": lambda out: out == "",
    "functions/hello?env=GREETING=hi": lambda out: _json(out)["env"] == {"GREETING": "hi"}  # type: ignore[index]
    and _json(out)["content_type"] == "text/plain",  # type: ignore[index]
    "hello/invoke?x=1": lambda out: {"argv0=hello", "TW_FUNCTION=hello", "TW_TENANT=acme", "QUERY_STRING=x=1",
                                     "GREETING=hi", "body=world"} <= set(out.splitlines()),
    "-d 'fail'": lambda out: _error(out)["code"] == "guest_error" and _error(out)["exit_code"] == 7
    and "asked to fail" in str(_error(out)["stderr_tail"]),
    "examples/vector_add.c -o vadd.wasm": lambda out: out == "",
    "PUT $TW/v1/functions/vadd ": lambda out: _json(out)["name"] == "vadd",  # type: ignore[index]
    "functions/vadd/invoke": lambda out: out.strip() == "[0. 2. 4. 6.]",
    "invocations?function=hello": lambda out: "guest_error" in out and "succeeded" in out and isinstance(_json(out), (dict, list)),
    "/v1/usage": lambda out: "268435456" in out and isinstance(_json(out), dict),
    "/v1/admin/workers": lambda out: isinstance(_json(out), (dict, list)),
}


@pytest.fixture(scope="module")
def tools() -> None:
    if shutil.which("bash") is None or shutil.which("curl") is None:
        pytest.skip("the walk-through needs bash and curl on PATH")


@pytest.mark.slow
def test_the_walk_through_runs_as_written(tools: None, tmp_path: Path) -> None:
    """The curl walk-through, then the command-line section when the README has one, in one
    shell session on one server, as a reader following the README would run them."""
    blocks = _section_blocks(WALK_THROUGH)
    assert blocks, f"the README has no ```sh block under {WALK_THROUGH!r}"
    commands = [c for b in blocks for c in _commands(b)]
    for fragment in WALK_THROUGH_EXPECTS:
        matches = [c for c in commands if fragment in c]
        assert len(matches) == 1, f"{fragment!r} picks {len(matches)} walk-through commands; update the test with the README"
    client_blocks = _section_blocks(CLIENT_SECTION) or []
    client_commands = [c for b in client_blocks for c in _commands(b)]
    assert client_commands or not client_blocks, f"the section {CLIENT_SECTION!r} has no ```sh commands"
    with _server(tmp_path) as (cwd, env):
        outputs = _run_block_commands(commands + client_commands, cwd, env, tmp_path)
    for fragment, check in WALK_THROUGH_EXPECTS.items():
        i = next(i for i, c in enumerate(commands) if fragment in c)
        try:
            ok = check(outputs[i])
        except (ValueError, KeyError, TypeError) as exc:
            ok, outputs[i] = False, f"{outputs[i]}\n({type(exc).__name__}: {exc})"
        assert ok, f"README command:\n{commands[i]}\nprinted:\n{outputs[i]}"


def test_blocks_split_into_commands_as_bash_reads_them() -> None:
    block = "# c\nA=1 \\\n  B=2\n\necho x | \\\n  cat   # -> x\n"
    assert _commands(block) == ["A=1 \\\n  B=2", "echo x | \\\n  cat   # -> x"]


def test_here_documents_stay_with_their_command() -> None:
    block = "python3 - <<'EOF'\nprint(1)\n\n# not a comment here\nEOF\necho after\n"
    assert _commands(block) == ["python3 - <<'EOF'\nprint(1)\n\n# not a comment here\nEOF", "echo after"]
