"""Every walk-through of the README and docs/ runs as written: its shell blocks go through bash,
command by command, against a real `tensorwasm serve` started the way the README's set-up starts
it (a fresh directory holding a copy of examples/, SQLite in ./.tensorwasm, a generated admin
token), on the CPU backend and a free port. Every command must succeed, and the outputs the text
promises must appear. The walk-throughs run in one shell session on one server, in the order a
reader goes through them (`WALK_THROUGHS`: the curl walk-through first, which sets TW and KEY),
wherever they are now (README.md or docs/*.md); any other section whose heading says
"walk-through" runs too, after them. A guest a section gives as a block marked
`<!-- guest: NAME -->` is saved as NAME first, as a reader would save it."""

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
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import EXAMPLES, ROOT

README = ROOT / "README.md"
DOCUMENTS = (README, *sorted((ROOT / "docs").glob("*.md")))
WALK_THROUGH = "Walk-through with curl"
CLIENT_SECTION = "Command line and Python client"  # run too, when the README has it
ASYNC_SECTION = "Async invocations and streaming"
_HEADING = re.compile(r"(#+) (.*)")


@dataclass
class Section:
    document: Path
    title: str
    blocks: list[str]  # its ```sh blocks
    guests: dict[str, str]  # file name -> text of the blocks marked <!-- guest: NAME -->


def _find_section(title: str) -> Section | None:
    """The section whose heading starts with `title`, in README.md or docs/*.md (None if absent)."""
    for document in DOCUMENTS:
        lines = document.read_text().splitlines()
        start = next((i for i, ln in enumerate(lines) if re.match(rf"#+ {re.escape(title)}", ln)), None)
        if start is not None:
            return _read_section(document, lines, start)
    return None


def _read_section(document: Path, lines: list[str], start: int) -> Section:
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    section = Section(document, lines[start].lstrip("#").strip(), [], {})
    current: list[str] | None = None  # lines of the ```sh block (or marked guest) being read
    guest: str | None = None
    fenced = False
    for i, line in enumerate(lines[start + 1 :], start + 1):
        if line.startswith("```"):
            if not fenced:
                marked = re.fullmatch(r"<!-- guest: (\S+) -->", lines[i - 1].strip())
                guest = marked.group(1) if marked else None
                current = [] if line.strip() == "```sh" or guest else None
            elif current is not None:
                text = "\n".join(current) + "\n"
                if guest:
                    section.guests[guest] = text
                else:
                    section.blocks.append(text)
                current = None
            fenced = not fenced
        elif fenced:
            if current is not None:
                current.append(line)
        elif (m := _HEADING.match(line)) and len(m.group(1)) <= level:
            break  # the next section
    return section


def _section_blocks(title: str) -> list[str] | None:
    """The ```sh blocks of the section whose heading starts with `title` (None if absent)."""
    section = _find_section(title)
    return None if section is None else section.blocks


def _walk_through_headings() -> list[str]:
    """Every heading of README.md and docs/*.md that calls its section a walk-through."""
    found: list[str] = []
    for document in DOCUMENTS:
        fenced = False
        for line in document.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and (m := _HEADING.match(line)) and re.search(r"walk-?through", m.group(2), re.I):
                found.append(m.group(2).strip())
    return found


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
    # a script, not a symlink: a venv's interpreter reached through a symlink in another directory
    # does not find its pyvenv.cfg and runs without the venv's packages
    python = bin_dir / "python3"
    python.write_text(f"#!/bin/sh\nexec '{sys.executable}' \"$@\"\n")
    python.chmod(0o755)
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
            f"walk-through command failed (exit {res.returncode}):\n{which}\n--- stdout ---\n{parts[-1]}\n--- stderr ---\n{res.stderr[-3000:]}"
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


def _wc(path: Path) -> list[str]:
    """Lines, words and bytes of a file, as `wc` counts them."""
    data = path.read_bytes()
    return [str(data.count(b"\n")), str(len(data.split())), str(len(data))]


CLIENT_EXPECTS: dict[str, Callable[[str], bool]] = {
    "| tensorwasm invoke echo": lambda out: out == "hello\n",
    "tensorwasm invoke hello -d fail": lambda out: "failed as asked: exit status 1" in out,
}

ASYNC_EXPECTS: dict[str, Callable[[str], bool]] = {
    "examples/slow.c -o slow.wasm": lambda out: out == "",
    "examples/stream.c -o stream.wasm": lambda out: out == "",
    "functions/slow?content_type": lambda out: _json(out)["name"] == "slow",  # type: ignore[index]
    "functions/stream?content_type": lambda out: _json(out)["name"] == "stream",  # type: ignore[index]
    "--data-binary @examples/hello.c": lambda out: out == "",
    "invocations/$ID -H": lambda out: _json(out)["status"] in ("queued", "running", "succeeded"),  # type: ignore[index]
    "invocations/$ID/output": lambda out: out.split() == _wc(EXAMPLES / "hello.c"),
    "invocations/$FAILED/output -H": lambda out: _error(out)["code"] == "guest_error" and _error(out)["exit_code"] == 2
    and "nothing to count" in str(_error(out)["stderr_tail"]),
    "invocations/$FAILED/output?any=true": lambda out: out.split(":")[1].strip() == "guest_error",
    "invocations/$LONG/cancel": lambda out: _json(out)["status"] == "cancelled",  # type: ignore[index]
    "function=slow&status=succeeded": lambda out: [i["status"] for i in _json(out)["items"]] == ["succeeded"],  # type: ignore[index]
    "Accept: text/event-stream": lambda out: [ln.rstrip() for ln in out.splitlines()][:8]
    == ["event: output", "data: a", "data:", "", "event: output", "data: prompt", "data:", ""]
    and '"status":"succeeded"' in out.replace(" ", ""),
    "stream=raw": lambda out: out == "one\ntwo\nthree\ndone\n",
}

# The walk-throughs, in the order a reader runs them (in one shell, so TW and KEY carry over):
# heading, what its commands promise, whether it must exist.
WALK_THROUGHS: list[tuple[str, dict[str, Callable[[str], bool]], bool]] = [
    (WALK_THROUGH, WALK_THROUGH_EXPECTS, True),
    (CLIENT_SECTION, CLIENT_EXPECTS, False),
    # docs/guest-abi.md: the reference's example guests, deployed and called
    ("A C guest: the sum of the numbers in the request", {"functions/sum/invoke": lambda out: out.strip() == "5050"}, True),
    ("A WAT guest: doubling numbers without a compiler", {"functions/double/invoke": lambda out: out.strip() == "[0. 2. 4. 6.]"}, True),
    (ASYNC_SECTION, ASYNC_EXPECTS, True),  # last: it ends with a cancel, whose worker is replaced
]


def _plan() -> tuple[list[Section], list[str], list[tuple[int, Callable[[str], bool]]]]:
    """The sections to run, their commands in order, and each promise with its command's index."""
    sections: list[Section] = []
    commands: list[str] = []
    checks: list[tuple[int, Callable[[str], bool]]] = []
    known = [title for title, _, _ in WALK_THROUGHS]
    others = [h for h in _walk_through_headings() if not any(h.startswith(k) for k in known)]
    for title, expects, required in [*WALK_THROUGHS, *((h, {}, True) for h in others)]:
        section = _find_section(title)
        if section is None:
            assert not required, f"no section {title!r} in README.md or docs/*.md; update WALK_THROUGHS with the text"
            continue
        mine = [c for b in section.blocks for c in _commands(b)]
        assert mine or not required, f"the section {title!r} ({section.document.name}) has no ```sh commands"
        for fragment, check in expects.items():
            matches = [i for i, c in enumerate(mine) if fragment in c]
            assert len(matches) == 1, f"{fragment!r} picks {len(matches)} commands of {title!r}; update the test with the text"
            checks.append((len(commands) + matches[0], check))
        sections.append(section)
        commands += mine
    return sections, commands, checks


def test_every_walk_through_is_planned() -> None:
    """The sections exist where the plan says, their promises each pick one command, and any
    section called a walk-through is among those run."""
    sections, commands, _ = _plan()
    titles = [s.title for s in sections]
    assert commands and WALK_THROUGH in titles[0] and any(t.startswith(ASYNC_SECTION) for t in titles)
    for heading in _walk_through_headings():
        assert any(t == heading for t in titles), f"{heading!r} is not run"



@pytest.fixture(scope="module")
def tools() -> None:
    if shutil.which("bash") is None or shutil.which("curl") is None:
        pytest.skip("the walk-through needs bash and curl on PATH")


@pytest.mark.slow
def test_the_walk_through_runs_as_written(tools: None, tmp_path: Path) -> None:
    """Every walk-through (the curl one, the command line, async and streaming, the guest
    reference's examples, ...) in one shell session on one server, as a reader following the
    README and docs/ would run them."""
    sections, commands, checks = _plan()
    with _server(tmp_path) as (cwd, env):
        for section in sections:
            for name, text in section.guests.items():
                (cwd / name).write_text(text)
        outputs = _run_block_commands(commands, cwd, env, tmp_path)
    for i, check in checks:
        try:
            ok = check(outputs[i])
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            ok, outputs[i] = False, f"{outputs[i]}\n({type(exc).__name__}: {exc})"
        assert ok, f"command:\n{commands[i]}\nprinted:\n{outputs[i]}"


def test_blocks_split_into_commands_as_bash_reads_them() -> None:
    block = "# c\nA=1 \\\n  B=2\n\necho x | \\\n  cat   # -> x\n"
    assert _commands(block) == ["A=1 \\\n  B=2", "echo x | \\\n  cat   # -> x"]


def test_here_documents_stay_with_their_command() -> None:
    block = "python3 - <<'EOF'\nprint(1)\n\n# not a comment here\nEOF\necho after\n"
    assert _commands(block) == ["python3 - <<'EOF'\nprint(1)\n\n# not a comment here\nEOF", "echo after"]
