"""The real `tensorwasm` command line against a real server process, over HTTP only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from app.cli import cli
from tests.helpers import ADMIN_TOKEN, EXAMPLES, GUESTS, ROOT, ServerProcess, server_process


@pytest.fixture(scope="module")
def node(server_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with server_process(tmp_path_factory.mktemp("cli-node"), server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN}) as s:
        yield s


@pytest.fixture
def tw(node: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """Run `tensorwasm ARGS` in-process from an empty directory; env adds or removes variables."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str, input: bytes | None = None, env: dict[str, str | None] | None = None) -> Result:
        base: dict[str, str | None] = {k: None for k in os.environ if k.startswith("TENSORWASM_")}
        base.update(TENSORWASM_URL=node.url, TENSORWASM_ADMIN_TOKEN=ADMIN_TOKEN)
        base.update(env or {})
        return CliRunner().invoke(cli, list(args), input=input, env=base, prog_name="tensorwasm")

    return run


def name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr, result.exception)
    return result


def test_admin_tenant_lifecycle(tw: Callable[..., Result], tmp_path: Path) -> None:
    t = name()
    created = json.loads(ok(tw("admin", "create-tenant", t, "--gpu-memory-bytes", "1048576", "--max-concurrency", "2")).stdout)
    assert created["name"] == t and created["quota"]["gpu_memory_bytes"] == 1048576

    # by name and by id
    assert json.loads(ok(tw("admin", "get", t)).stdout)["id"] == created["id"]
    assert json.loads(ok(tw("admin", "get", created["id"])).stdout)["name"] == t
    assert t in ok(tw("admin", "list")).stdout
    assert any(x["id"] == created["id"] for x in json.loads(ok(tw("--json", "admin", "list")).stdout))

    # set-quota changes only the fields given; --replace resets the rest to the defaults
    quota = json.loads(ok(tw("admin", "set-quota", t, "--timeout-ms", "5000")).stdout)
    assert quota["timeout_ms"] == 5000 and quota["gpu_memory_bytes"] == 1048576 and quota["max_concurrency"] == 2
    quota = json.loads(ok(tw("admin", "set-quota", t, "--max-stored-bytes", "65536")).stdout)
    assert quota["max_stored_bytes"] == 65536 and quota["timeout_ms"] == 5000
    quota = json.loads(ok(tw("admin", "set-quota", t, "--replace", "--timeout-ms", "6000")).stdout)
    assert quota["timeout_ms"] == 6000 and quota["gpu_memory_bytes"] != 1048576
    bad = tw("admin", "set-quota", t, "--max-concurrency", "0")
    assert bad.exit_code == 1 and "validation_error" in bad.stderr and "max_concurrency" in bad.stderr
    assert tw("admin", "set-quota", t).exit_code == 2  # nothing to change is a usage error

    assert json.loads(ok(tw("admin", "disable", t)).stdout)["disabled"] is True
    assert json.loads(ok(tw("admin", "enable", t)).stdout)["disabled"] is False

    # create-key prints the key alone on stdout, so `KEY=$(tensorwasm admin create-key T)` works
    made = ok(tw("admin", "create-key", t))
    key = made.stdout.strip()
    assert key.startswith("tw_") and "\n" not in key and "shown only now" in made.stderr
    keys = json.loads(ok(tw("--json", "admin", "list-keys", t)).stdout)
    assert len(keys) == 1 and key.startswith(keys[0]["prefix"]) and keys[0]["revoked_at"] is None
    ok(tw("admin", "revoke-key", t, keys[0]["id"]))
    assert json.loads(ok(tw("--json", "admin", "list-keys", t)).stdout)[0]["revoked_at"] is not None
    denied = tw("usage", env={"TENSORWASM_API_KEY": key})
    assert denied.exit_code == 1 and "unauthorized" in denied.stderr

    workers = ok(tw("admin", "workers")).stdout
    assert workers.splitlines()[0].split()[:4] == ["ID", "PID", "STATE", "BACKEND"]

    ok(tw("admin", "delete", t, "--yes"))
    gone = tw("admin", "get", t)
    assert gone.exit_code == 1 and f"no tenant with the id or name {t!r}" in gone.stderr
    # nothing of the above touched a database here: no data dir appeared in the working directory
    assert list(tmp_path.iterdir()) == []


def test_tenant_commands(tw: Callable[..., Result], tmp_path: Path, c_guest: Callable[[str], bytes]) -> None:
    t = name()
    ok(tw("admin", "create-tenant", t))
    key = {"TENSORWASM_API_KEY": ok(tw("admin", "create-key", t)).stdout.strip()}

    deployed = ok(tw("deploy", "echo", str(EXAMPLES / "echo.wat"), env=key))
    assert "uploaded echo.wat" in deployed.stderr and "compiling…" in deployed.stderr
    assert "(new function)" in deployed.stderr and json.loads(deployed.stdout)["version"] == 1
    assert ok(tw("invoke", "echo", input=b"hello", env=key)).stdout_bytes == b"hello"
    assert ok(tw("invoke", "echo", "-d", "from a flag", env=key)).stdout_bytes == b"from a flag"
    assert ok(tw("invoke", "echo", "--stream", input=b"streamed", env=key)).stdout_bytes == b"streamed"

    missing = tw("invoke", "nope", input=b"x", env=key)
    assert missing.exit_code == 1 and missing.stdout == "" and "function 'nope' not found" in missing.stderr

    hello = tmp_path / "hello.wasm"
    hello.write_bytes(c_guest("hello.c"))
    ok(tw("deploy", "hello", str(hello), "--env", "GREETING=hi", "--content-type", "text/plain", "--cgi", "-q", env=key))
    out = ok(tw("invoke", "hello", "--query", "x=1", input=b"world", env=key)).stdout
    assert "GREETING=hi" in out and "QUERY_STRING=x=1" in out and "body=world" in out
    failed = tw("invoke", "hello", input=b"fail", env=key)
    assert failed.exit_code == 1 and "guest_error" in failed.stderr

    probe = tmp_path / "probe.wasm"
    probe.write_bytes(c_guest("wasi_probe.c"))
    deployed = ok(tw("deploy", "probe", str(probe), "--arg", "env", "--arg", "two words", "-q", env=key))
    assert json.loads(deployed.stdout)["args"] == ["env", "two words"]
    assert "arg=two words" in ok(tw("invoke", "probe", "-d", "", env=key)).stdout
    out = ok(tw("invoke", "probe", "--arg", "env", "--arg", "own", "-d", "", env=key)).stdout
    assert "arg=own" in out and "two words" not in out and "arg=probe" in out
    files = tmp_path / "files"
    (files / "sub").mkdir(parents=True)
    (files / "sub" / "data.txt").write_text("from a directory")
    ok(tw("functions", "files", "probe", str(files), "-q", env=key))
    assert ok(tw("invoke", "probe", "--arg", "cat", "--arg", "/sub/data.txt", "-d", "", env=key)).stdout == "from a directory"
    archive = tmp_path / "files.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(files / "sub" / "data.txt", arcname="in-a-tar.txt")
    redeployed = ok(tw("deploy", "probe", str(probe), "--files", str(archive), "--scratch", "-q", env=key))
    assert json.loads(redeployed.stdout)["scratch"] is True and json.loads(redeployed.stdout)["files"]["entries"] == 1
    assert ok(tw("invoke", "probe", "--arg", "cat", "--arg", "in-a-tar.txt", "-d", "", env=key)).stdout == "from a directory"
    not_tar = tw("functions", "files", "probe", str(probe), env=key)
    assert not_tar.exit_code == 1 and "neither a directory nor a tar archive" in not_tar.stderr
    assert "exit_code: 7" in failed.stderr and "asked to fail" in failed.stderr

    listed = ok(tw("functions", "list", env=key)).stdout
    assert "echo" in listed and "hello" in listed
    assert json.loads(ok(tw("functions", "get", "hello", env=key)).stdout)["env"] == {"GREETING": "hi"}

    records = json.loads(ok(tw("--json", "invocations", "list", "--function", "hello", env=key)).stdout)
    assert {r["status"] for r in records} == {"succeeded", "guest_error"}
    one = json.loads(ok(tw("invocations", "get", records[0]["id"], env=key)).stdout)
    assert one["id"] == records[0]["id"] and one["function"] == "hello"

    usage = json.loads(ok(tw("usage", env=key)).stdout)
    assert usage["tenant"] == t and usage["functions"] == 3

    source = tmp_path / "scale.cu"
    source.write_text('extern "C" __global__ void scale(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] *= 2.0f; }\n')
    assert json.loads(ok(tw("kernels", "put", "mine", str(source), env=key)).stdout)["name"] == "mine"
    assert "mine" in ok(tw("kernels", "list", env=key)).stdout
    assert "scale" in json.loads(ok(tw("kernels", "get", "mine", env=key)).stdout)["source"]
    ok(tw("kernels", "delete", "mine", env=key))
    assert tw("kernels", "get", "mine", env=key).exit_code == 1

    ok(tw("functions", "delete", "echo", env=key))
    assert "echo" not in ok(tw("functions", "list", env=key)).stdout


def test_async_stream_and_cancel(tw: Callable[..., Result], tmp_path: Path) -> None:
    t = name()
    ok(tw("admin", "create-tenant", t, "--timeout-ms", "20000", "--max-concurrency", "1"))
    key = {"TENSORWASM_API_KEY": ok(tw("admin", "create-key", t)).stdout.strip()}
    for fn in ("echo", "exit3", "utf8_lines", "write_then_spin"):
        guest = tmp_path / f"{fn}.wat"
        guest.write_text((GUESTS / f"{fn}.wat").read_text())
        ok(tw("deploy", fn, str(guest), "-q", env=key))

    # --async prints only the id; --wait writes the output, and exits 1 on a failed run
    inv = ok(tw("invoke", "echo", "--async", input=b"later", env=key)).stdout.strip()
    assert len(inv) == 32
    waited = ok(tw("invoke", "echo", "--async", "--wait", input=b"waited", env=key))
    assert waited.stdout_bytes == b"waited" and "queued invocation" in waited.stderr and "succeeded" in waited.stderr
    assert ok(tw("invocations", "output", inv, env=key)).stdout_bytes == b"later"  # drained before the one behind it
    assert json.loads(ok(tw("invocations", "get", inv, env=key)).stdout)["mode"] == "async"
    failed = tw("invoke", "exit3", "--async", "--wait", env=key)
    assert failed.exit_code == 1 and failed.stdout_bytes == b"partial output\n" and "guest_error" in failed.stderr
    # `invocations output` of a failed one: the stored stdout still written, how it ended on stderr, exit 1
    failed_id = failed.stderr.split("queued invocation ")[1].split()[0]
    output = tw("invocations", "output", failed_id, env=key)
    assert output.exit_code == 1 and output.stdout_bytes == b"partial output\n", (output.stdout, output.stderr)
    assert f"invocation {failed_id} ended guest_error (exit code 3)" in output.stderr
    assert "stderr_tail: something went wrong" in output.stderr
    key_once = ("--idempotency-key", f"k-{uuid.uuid4().hex}")
    first = ok(tw("invoke", "echo", "--async", *key_once, input=b"1", env=key)).stdout
    assert ok(tw("invoke", "echo", "--async", *key_once, input=b"2", env=key)).stdout == first
    assert tw("invoke", "echo", "--wait", env=key).exit_code == 2  # --wait goes with --async

    # --stream: UTF-8 text as written, the outcome from the stream's end event
    assert ok(tw("invoke", "utf8_lines", "--stream", env=key)).stdout == "héllo\nwörld\n"
    streamed_fail = tw("invoke", "exit3", "--stream", env=key)
    assert streamed_fail.exit_code == 1 and "guest_error" in streamed_fail.stderr

    # cancel a running invocation, then again: the server's 409 message, exit 1
    spinning = ok(tw("invoke", "write_then_spin", "--async", env=key)).stdout.strip()
    assert json.loads(ok(tw("invocations", "cancel", spinning, env=key)).stdout)["status"] == "cancelled"
    again = tw("invocations", "cancel", spinning, env=key)
    assert again.exit_code == 1 and "already" in again.stderr
    cancelled = tw("invocations", "output", spinning, env=key)
    assert cancelled.exit_code == 1 and f"invocation {spinning} ended cancelled" in cancelled.stderr
    assert tw("invoke", "missing", "--async", env=key).exit_code == 1


def test_missing_credentials_are_usage_errors(tw: Callable[..., Result]) -> None:
    r = tw("usage")
    assert r.exit_code == 2 and "TENSORWASM_API_KEY" in r.stderr
    r = tw("admin", "list", env={"TENSORWASM_ADMIN_TOKEN": None, "TENSORWASM_DATA_DIR": "/nonexistent"})
    assert r.exit_code == 2 and "TENSORWASM_ADMIN_TOKEN" in r.stderr


def test_admin_token_from_a_local_data_dir(tw: Callable[..., Result], tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "admin_token").write_text(ADMIN_TOKEN + "\n")
    env: dict[str, str | None] = {"TENSORWASM_ADMIN_TOKEN": None, "TENSORWASM_DATA_DIR": str(data)}
    assert ok(tw("admin", "list", env=env)).stdout.startswith("ID")
    # only a server on this machine can have written that file: elsewhere it is not read
    far = tw("--url", "http://tensorwasm.invalid:8080", "admin", "list", env=env)
    assert far.exit_code == 2 and "no admin token" in far.stderr


def one_line(result: Result, code: int = 1) -> str:
    """A failure's stderr: exactly one line, no traceback; returns it."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert "Traceback" not in result.stderr and isinstance(result.exception, SystemExit)
    (line,) = result.stderr.splitlines()
    return line


def test_unreachable_server(tw: Callable[..., Result]) -> None:
    line = one_line(tw("--url", "http://127.0.0.1:9", "admin", "list"))
    assert line.startswith("error: cannot reach http://127.0.0.1:9 (") and "Connection refused" in line
    assert line.endswith("start one with `tensorwasm serve`, or give its address with --url or TENSORWASM_URL")


@pytest.mark.parametrize("url", ["http://bad:host", "127.0.0.1:8080", "ftp://example.org", "http://:8080", "http://example.org:99999"])
def test_a_bad_url_is_one_line(tw: Callable[..., Result], url: str) -> None:
    line = one_line(tw("--url", url, "admin", "list"))
    assert line.startswith(f"error: the server URL {url!r} ") and line.endswith("set TENSORWASM_URL or pass --url, e.g. http://127.0.0.1:8080")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_quota_flags_refuse_nan_and_infinity(tw: Callable[..., Result], value: str) -> None:
    r = tw("admin", "set-quota", "anyone", "--requests-per-second", value)
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert f"Invalid value for '--requests-per-second': {value!r} is not a finite number" in r.stderr


def test_unexpected_failures_are_one_line_and_debug_shows_the_traceback(tw: Callable[..., Result], monkeypatch: pytest.MonkeyPatch) -> None:
    from app.client import AdminClient

    def broken(self: AdminClient) -> None:
        raise RuntimeError("something broke\nsecond line")

    monkeypatch.setattr(AdminClient, "list_tenants", broken)
    line = one_line(tw("admin", "list"))
    assert line == "error: RuntimeError: something broke (run again with --debug for the traceback)"
    debug = tw("--debug", "admin", "list")
    assert debug.exit_code == 1 and isinstance(debug.exception, RuntimeError)  # raised: Python prints the traceback

    def unreadable(self: AdminClient) -> None:
        raise PermissionError(13, "Permission denied", "/some/file")

    monkeypatch.setattr(AdminClient, "list_tenants", unreadable)
    assert one_line(tw("admin", "list")) == "error: Permission denied: /some/file"
    debug = tw("--debug", "admin", "list")
    assert isinstance(debug.exception, PermissionError)


def test_deploy_errors_name_what_to_do(tw: Callable[..., Result], tmp_path: Path) -> None:
    t = name()
    ok(tw("admin", "create-tenant", t, "--max-module-bytes", "1000"))
    key = {"TENSORWASM_API_KEY": ok(tw("admin", "create-key", t)).stdout.strip()}

    big = tmp_path / "big.wasm"
    big.write_bytes(b"\0asm\x01\0\0\0" + b"\0" * 2000)
    line = one_line(tw("deploy", "big", str(big), env=key))  # refused before the upload: no progress, no "compiling…"
    assert line.startswith("error: big.wasm is 2008 bytes, larger than this tenant's max_module_bytes quota of 1000 bytes")
    assert "--max-module-bytes" in line

    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    r = tw("deploy", "notes", str(text), "-q", env=key)
    assert r.exit_code == 1 and "Traceback" not in r.stderr
    assert "this is not a WebAssembly module" in r.stderr and "python3 -m ziglang cc" in r.stderr and "wat2wasm" in r.stderr
    assert "expected" not in r.stderr

    missing = tw("deploy", "f", str(tmp_path / "nope.wasm"), env=key)
    assert missing.exit_code == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_a_tenant_is_named_by_name_in_every_admin_command(tw: Callable[..., Result]) -> None:
    t = name()
    tid = json.loads(ok(tw("admin", "create-tenant", t)).stdout)["id"]
    assert json.loads(ok(tw("admin", "set-quota", t, "--timeout-ms", "4000")).stdout)["timeout_ms"] == 4000
    assert json.loads(ok(tw("admin", "set-quota", tid, "--timeout-ms", "4100")).stdout)["timeout_ms"] == 4100
    missing = one_line(tw("admin", "set-quota", "no-such-tenant", "--timeout-ms", "4000"))
    assert missing == "error: no tenant with the id or name 'no-such-tenant' (not_found, HTTP 404)"
    ok(tw("admin", "delete", t, "--yes"))


def test_openapi_writes_where_asked(tw: Callable[..., Result], tmp_path: Path) -> None:
    out = tmp_path / "doc" / "api.json"
    out.parent.mkdir()
    ok(tw("openapi", "-o", str(out)))
    assert json.loads(out.read_text())["openapi"].startswith("3.")
    ok(tw("openapi", "--check", "-o", str(out)))
    assert (ROOT / "openapi.json").read_text() == out.read_text()
    out.write_text("{}\n")
    assert tw("openapi", "--check", "-o", str(out)).exit_code == 1


def test_shell_completion(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = subprocess.run([sys.executable, "-m", "app.cli", "completion", "bash"], env=env, capture_output=True, text=True, check=True)
    assert "_TENSORWASM_COMPLETE=bash_complete" in script.stdout
    # what the script asks for when the user presses TAB after `tensorwasm adm`
    env.update(_TENSORWASM_COMPLETE="bash_complete", COMP_WORDS="tensorwasm adm", COMP_CWORD="1")
    done = subprocess.run([sys.executable, "-m", "app.cli"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert "plain,admin" in done.stdout.split()
    env.update(COMP_WORDS="tensorwasm admin set-quota acme --time", COMP_CWORD="4")
    done = subprocess.run([sys.executable, "-m", "app.cli"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert "plain,--timeout-ms" in done.stdout.split()


def complete(args: list[str], incomplete: str) -> list[str]:
    """What TAB offers after `tensorwasm ARGS INCOMPLETE` (click's completion API, as the shell
    script's call runs it)."""
    from click.shell_completion import ShellComplete

    return [item.value for item in ShellComplete(cli, {}, "tensorwasm", "_TENSORWASM_COMPLETE").get_completions(args, incomplete)]


def test_completion_of_function_kernel_and_tenant_names(
    tw: Callable[..., Result], node: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    t = name()
    ok(tw("admin", "create-tenant", t))
    key = ok(tw("admin", "create-key", t)).stdout.strip()
    for fn in ("echo-one", "echo-two", "other"):
        ok(tw("deploy", fn, str(EXAMPLES / "echo.wat"), "-q", env={"TENSORWASM_API_KEY": key}))
    source = tmp_path / "k.cu"
    source.write_text('extern "C" __global__ void k(float* x) {}\n')
    ok(tw("kernels", "put", "scale-k", str(source), env={"TENSORWASM_API_KEY": key}))

    for k in [k for k in os.environ if k.startswith("TENSORWASM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TENSORWASM_URL", node.url)
    monkeypatch.setenv("TENSORWASM_API_KEY", key)
    monkeypatch.setenv("TENSORWASM_ADMIN_TOKEN", ADMIN_TOKEN)
    assert complete(["invoke"], "echo") == ["echo-one", "echo-two"]
    assert complete(["invoke"], "") == ["echo-one", "echo-two", "other"]
    assert complete(["functions", "get"], "o") == ["other"]
    assert complete(["functions", "delete"], "echo-t") == ["echo-two"]
    assert complete(["deploy"], "oth") == ["other"]
    assert complete(["kernels", "get"], "sc") == ["scale-k"]
    assert t in complete(["admin", "set-quota"], t[:5])
    assert complete(["admin", "get"], t) == [t]
    assert t in complete(["admin", "create-key"], "")
    # the flags on the line count too: another key, another server
    assert complete(["--api-key", "tw_wrong", "invoke"], "") == []
    capsys.readouterr()
    # no server, no credentials: nothing offered, nothing printed
    assert complete(["--url", "http://127.0.0.1:9", "invoke"], "") == []
    assert complete(["--url", "http://127.0.0.1:9", "admin", "get"], "") == []
    assert complete(["--url", "not a url", "invoke"], "") == []
    monkeypatch.delenv("TENSORWASM_API_KEY")
    assert complete(["invoke"], "") == []
    assert capsys.readouterr() == ("", "")
