"""The WASI test suite's wasip1 tests (vendored here, see README.md) against a real node, through
the HTTP API as a user would run them: each test's spec becomes its deploy (env, args, its root
directory as the function's files with a scratch copy per call), the call has an empty stdin,
and its exit code and stdout are judged as the suite's own runner judges them."""

from __future__ import annotations

import io
import json
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ADMIN, ADMIN_TOKEN, server_process

SUITE = Path(__file__).resolve().parent
LANGS = {"assemblyscript": "as", "c": "c", "rust": "rs"}
CASES = sorted((lang, p.stem) for lang in LANGS for p in (SUITE / lang).glob("*.wasm"))


def _spec(lang: str, test: str) -> dict[str, Any]:
    path = SUITE / lang / f"{test}.json"
    spec: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    unknown = set(spec) - {"args", "env", "root", "exit_code", "stdout"}
    assert not unknown, f"{lang}/{test}: spec keys this runner does not map: {unknown}"
    return spec


def _archive(root: Path) -> bytes:
    """The root directory's contents at the archive's root, as `tensorwasm deploy --files` sends."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name)
    return buf.getvalue()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, server_database_url: str) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    data = tmp_path_factory.mktemp("wasi-suite-node")
    with server_process(data, server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN}) as server, httpx.Client(
        base_url=server.url, timeout=60
    ) as client:
        r = client.post("/v1/admin/tenants", json={"name": "wasi-suite", "quota": {"max_functions": len(CASES) + 8}}, headers=ADMIN)
        assert r.status_code == 201, r.text
        r = client.post(f"/v1/admin/tenants/{r.json()['id']}/api-keys", headers=ADMIN)
        yield client, {"Authorization": f"Bearer {r.json()['key']}"}


def _record(client: httpx.Client, key: dict[str, str], invocation_id: str) -> dict[str, Any]:
    """A streamed call's record (written off the call's path: polled until it is there)."""
    deadline = time.monotonic() + 30
    while True:
        r = client.get(f"/v1/invocations/{invocation_id}", headers=key)
        if r.status_code == 200 and r.json()["status"] not in ("queued", "running"):
            return r.json()  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)


@pytest.mark.parametrize(("lang", "test"), CASES, ids=[f"{lang}/{test}" for lang, test in CASES])
def test_wasi_testsuite(node: tuple[httpx.Client, dict[str, str]], lang: str, test: str) -> None:
    client, key = node
    spec = _spec(lang, test)
    name = f"{LANGS[lang]}-{test}"
    params: list[tuple[str, str]] = [("env", f"{k}={v}") for k, v in spec.get("env", {}).items()]
    params += [("arg", a) for a in spec.get("args", [])]
    if spec.get("root"):
        params.append(("scratch", "true"))  # the tests write into their root
    wasm = (SUITE / lang / f"{test}.wasm").read_bytes()
    r = client.put(f"/v1/functions/{name}", params=params, content=wasm, headers={**key, "Content-Type": "application/wasm"})
    assert r.status_code in (200, 201), r.text
    if spec.get("root"):
        archive = _archive(SUITE / lang / spec["root"])
        r = client.put(f"/v1/functions/{name}/files", content=archive, headers={**key, "Content-Type": "application/x-tar"})
        assert r.status_code == 200, r.text
    # a raw stream: stdout whatever the exit, the exit code in the invocation's record
    r = client.post(f"/v1/functions/{name}/invoke", params={"stream": "raw"}, content=b"", headers=key)
    assert r.status_code == 200, r.text
    record = _record(client, key, r.headers["x-invocation-id"])
    assert record["exit_code"] == spec.get("exit_code", 0), (record["status"], record["error"], record["stderr_tail"], r.text)
    if "stdout" in spec:
        assert r.text == spec["stdout"]
