"""`tensorwasm functions versions|rollback`, `invoke --version` and `tensorwasm secrets` against a
real server process: what the next call runs, and a secret's value in no output or server log."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

from click.testing import Result

from tests.cli.test_commands import name, node, ok, tw  # noqa: F401  (fixtures)
from tests.helpers import ADMIN_TOKEN, EXAMPLES, ServerProcess

VALUE = "cli-s3cr3t-7d41e0"


def _key(tw: Callable[..., Result]) -> dict[str, str]:  # noqa: F811
    t = name()
    ok(tw("admin", "create-tenant", t))
    return {"TENSORWASM_API_KEY": ok(tw("admin", "create-key", t)).stdout.strip()}


def test_versions_rollback_and_pinned_calls(tw: Callable[..., Result], tmp_path: Path) -> None:  # noqa: F811
    key = _key(tw)
    noop = tmp_path / "noop.wat"
    noop.write_text('(module (memory (export "memory") 1) (func (export "_start")))')
    ok(tw("deploy", "f", str(EXAMPLES / "echo.wat"), "-q", env=key))
    assert json.loads(ok(tw("deploy", "f", str(noop), "-q", env=key)).stdout)["version"] == 2
    assert ok(tw("invoke", "f", input=b"hi", env=key)).stdout_bytes == b""
    # a pinned call runs its version, in each mode
    assert ok(tw("invoke", "f", "--version", "1", input=b"hi", env=key)).stdout_bytes == b"hi"
    assert ok(tw("invoke", "f", "--version", "1", "--stream", input=b"st", env=key)).stdout_bytes == b"st"
    assert ok(tw("invoke", "f", "--version", "1", "--async", "--wait", input=b"as", env=key)).stdout_bytes == b"as"
    gone = tw("invoke", "f", "--version", "9", input=b"x", env=key)
    assert gone.exit_code == 1 and "no version 9" in gone.stderr and "Traceback" not in gone.stderr

    listed = json.loads(ok(tw("--json", "functions", "versions", "f", env=key)).stdout)
    assert [(v["version"], v["active"]) for v in listed] == [(1, False), (2, True)]
    assert "ACTIVE" in ok(tw("functions", "versions", "f", env=key)).stdout
    # rollback with no VERSION: the one before the active; the next call runs it
    rolled = ok(tw("functions", "rollback", "f", env=key))
    assert json.loads(rolled.stdout)["version"] == 1 and "runs version 1" in rolled.stderr
    assert ok(tw("invoke", "f", input=b"back", env=key)).stdout_bytes == b"back"
    none_before = tw("functions", "rollback", "f", env=key)
    assert none_before.exit_code == 1 and "no version before" in none_before.stderr
    assert json.loads(ok(tw("functions", "rollback", "f", "2", env=key)).stdout)["version"] == 2
    missing = tw("functions", "rollback", "f", "7", env=key)
    assert missing.exit_code == 1 and "no version 7" in missing.stderr


def test_secrets_set_list_delete_and_the_guest_sees_one(
    tw: Callable[..., Result], tmp_path: Path, c_guest: Callable[[str], bytes], node: ServerProcess,  # noqa: F811
) -> None:
    key = _key(tw)
    created = ok(tw("secrets", "set", "TOKEN", input=VALUE.encode(), env=key))
    assert "created secret TOKEN" in created.stderr and VALUE not in created.stdout + created.stderr
    value_file = tmp_path / "v"
    value_file.write_text(VALUE)
    assert "replaced" in ok(tw("secrets", "set", "TOKEN", "--from-file", str(value_file), env=key)).stderr
    empty = tw("secrets", "set", "EMPTY", env=key)
    assert empty.exit_code == 1 and "no value" in empty.stderr
    listed = ok(tw("--json", "secrets", "list", env=key))
    assert [s["name"] for s in json.loads(listed.stdout)] == ["TOKEN"] and VALUE not in listed.stdout

    probe = tmp_path / "probe.wasm"
    probe.write_bytes(c_guest("wasi_probe.c"))
    deployed = ok(tw("deploy", "p", str(probe), "--arg", "env", "--secret", "TOKEN", "-q", env=key))
    assert json.loads(deployed.stdout)["secrets"] == ["TOKEN"] and VALUE not in deployed.stdout
    assert f"env=TOKEN={VALUE}" in ok(tw("invoke", "p", env=key)).stdout
    unknown = tw("deploy", "q", str(probe), "--secret", "NOPE", "-q", env=key)
    assert unknown.exit_code == 1 and "NOPE" in unknown.stderr

    in_use = tw("secrets", "delete", "TOKEN", env=key)
    assert in_use.exit_code == 1 and "given to functions p" in in_use.stderr
    ok(tw("deploy", "p", str(probe), "--secret", "", "-q", env=key))
    assert "deleted secret TOKEN" in ok(tw("secrets", "delete", "TOKEN", env=key)).stderr
    for out in (
        ok(tw("--json", "functions", "get", "p", env=key)).stdout,
        ok(tw("--json", "invocations", "list", env=key)).stdout,
        urllib.request.urlopen(urllib.request.Request(f"{node.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})).read().decode(),
        node.log(),
    ):
        assert VALUE not in out
