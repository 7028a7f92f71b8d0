"""A function's files through the API (PUT/DELETE /v1/functions/{name}/files): what the guest
sees at `/` in every mode, the scratch copy and its quota, every archive refused with its reason
and nothing lost, and the quotas on files and stored bytes."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable

import httpx
import pytest

from tests.helpers import ADMIN, deploy, new_tenant, submit, tar_archive, wait_status

FILES = {"data/a.txt": b"alpha", "data/sub/b.txt": b"beta", "link": "data/a.txt"}


async def put_files(client: httpx.AsyncClient, key: dict[str, str], name: str, archive: bytes, content_type: str = "application/x-tar") -> httpx.Response:
    return await client.put(f"/v1/functions/{name}/files", content=archive, headers={**key, "Content-Type": content_type})


async def call(client: httpx.AsyncClient, key: dict[str, str], name: str, *args: str, **kw: object) -> httpx.Response:
    return await client.post(f"/v1/functions/{name}/invoke", headers={**key, "X-Function-Args": json.dumps(list(args))}, **kw)  # type: ignore[arg-type]


async def stdout(client: httpx.AsyncClient, key: dict[str, str], name: str, *args: str) -> str:
    """The guest's stdout whatever its exit (a raw stream: the outcome goes to the record)."""
    headers = {**key, "X-Function-Args": json.dumps(list(args))}
    r = await client.post(f"/v1/functions/{name}/invoke", params={"stream": "raw"}, headers=headers)
    assert r.status_code == 200, r.text
    return r.text


async def test_files_are_the_guests_root_in_every_mode(client: httpx.AsyncClient, c_guest: Callable[[str], bytes], platform) -> None:
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "probe", c_guest("wasi_probe.c"))).json()["files"] is None
    archive = tar_archive(FILES)
    r = await put_files(client, key, "probe", archive)
    assert r.status_code == 200, r.text
    files = r.json()["files"]
    assert files["size"] == len(archive) and files["unpacked_bytes"] == 9 and files["entries"] == 5
    assert (await client.get("/v1/functions/probe", headers=key)).json()["files"]["sha256"] == files["sha256"]
    assert (await call(client, key, "probe", "cat", "/data/sub/b.txt")).text == "beta"
    assert (await call(client, key, "probe", "cat", "/link")).text == "alpha"
    # read-only without scratch
    r = await call(client, key, "probe", "write", "/x", "1")
    assert r.status_code == 500 and r.json()["error"]["exit_code"] == 1
    assert (await stdout(client, key, "probe", "write", "/x", "1")).startswith("error: ")
    # streamed and async calls see them too
    r = await client.post("/v1/functions/probe/invoke?stream=raw", headers={**key, "X-Function-Args": '["cat", "/data/a.txt"]'})
    assert r.text == "alpha"
    r = await submit(client, key, "probe", headers={"X-Function-Args": '["cat", "data/a.txt"]'})
    rec = await wait_status(client, key, r.json()["id"], "succeeded")
    assert (await client.get(f"/v1/invocations/{rec['id']}/output", headers=key)).text == "alpha"
    usage = (await client.get("/v1/usage", headers=key)).json()
    assert usage["stored_files_bytes"] == len(archive)
    # the node keeps one unpacked copy; gone with the last function that uses it
    unpacked = platform.function_cache.bundles.path_for(files["sha256"])
    assert (unpacked / "data" / "a.txt").read_bytes() == b"alpha"
    assert (await client.delete("/v1/functions/probe", headers=key)).status_code == 204
    assert not unpacked.exists()


async def test_new_files_replace_the_old_and_delete_removes_them(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "probe", c_guest("wasi_probe.c"))
    await put_files(client, key, "probe", tar_archive({"v.txt": b"one"}))
    assert (await call(client, key, "probe", "cat", "/v.txt")).text == "one"
    await put_files(client, key, "probe", tar_archive({"v.txt": b"two"}))
    assert (await call(client, key, "probe", "cat", "/v.txt")).text == "two"
    # a redeploy of the module keeps the files
    assert (await deploy(client, key, "probe", c_guest("wasi_probe.c"), env=["A=1"])).json()["files"] is not None
    r = await client.delete("/v1/functions/probe/files", headers=key)
    assert r.status_code == 200 and r.json()["files"] is None
    assert await stdout(client, key, "probe", "cat", "/v.txt") == "error: ENOENT\n"
    assert (await client.delete("/v1/functions/probe/files", headers=key)).status_code == 404
    assert (await put_files(client, key, "nope", tar_archive({"a": b"1"}))).status_code == 404


async def test_scratch_gives_each_call_a_writable_copy_capped_by_quota(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    cap = 256 * 1024
    _, key = await new_tenant(client, scratch_bytes=cap)
    r = await deploy(client, key, "probe", c_guest("wasi_probe.c"), scratch="true")
    assert r.status_code == 201 and r.json()["scratch"] is True
    await put_files(client, key, "probe", tar_archive(FILES))
    assert (await call(client, key, "probe", "write", "/data/new.txt", "1000")).text == "wrote 1000\n"
    # another call: its own fresh copy
    assert await stdout(client, key, "probe", "cat", "/data/new.txt") == "error: ENOENT\n"
    r = await call(client, key, "probe", "write", "/big", str(2 * cap))
    assert r.status_code == 500 and r.json()["error"]["exit_code"] == 1  # the guest's own exit, not a node error
    out = await stdout(client, key, "probe", "write", "/big", str(2 * cap))
    assert out.startswith("error after ") and out.endswith(": ENOSPC\n"), out


async def test_scratch_quota_is_checked_when_files_or_scratch_change(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    _, key = await new_tenant(client, scratch_bytes=4096)
    await deploy(client, key, "probe", c_guest("wasi_probe.c"))
    big = tar_archive({"big.bin": b"x" * 8192})
    assert (await put_files(client, key, "probe", big)).status_code == 200  # read-only: scratch_bytes does not apply
    r = await deploy(client, key, "probe", c_guest("wasi_probe.c"), scratch="true")
    assert r.status_code == 422 and r.json()["error"]["code"] == "scratch_quota_exceeded", r.text
    assert (await client.get("/v1/functions/probe", headers=key)).json()["scratch"] is False
    await put_files(client, key, "probe", tar_archive({"small": b"x"}))
    assert (await deploy(client, key, "probe", c_guest("wasi_probe.c"), scratch="true")).status_code == 200
    r = await put_files(client, key, "probe", big)
    assert r.status_code == 422 and r.json()["error"]["code"] == "scratch_quota_exceeded"
    assert (await call(client, key, "probe", "cat", "/small")).text == "x"


def _with(member: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("ok.txt"), io.BytesIO(b""))
        tar.addfile(member, io.BytesIO(data) if data else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


BAD_ARCHIVES = {
    "absolute": _with(_member("/etc/passwd")),
    "dotdot": _with(_member("a/../../escape")),
    "symlink-out": _with(_member("l", tarfile.SYMTYPE, "../../etc")),
    "symlink-absolute": _with(_member("l", tarfile.SYMTYPE, "/etc/passwd")),
    "symlink-deep-out": _with(_member("a/b/l", tarfile.SYMTYPE, "../../../x")),
    "hardlink": _with(_member("h", tarfile.LNKTYPE, "ok.txt")),
    "device": _with(_member("dev", tarfile.CHRTYPE)),
    "fifo": _with(_member("fifo", tarfile.FIFOTYPE)),
    "duplicate": _with(_member("ok.txt")),
    "through-a-link": tar_archive({"d": "sub", "d/x": b"1"}),
    "under-a-file": tar_archive({"f": b"1", "f/x": b"2"}),
    "not-tar": b"just some bytes that are not a tar archive" * 20,
}


@pytest.mark.parametrize("case", sorted(BAD_ARCHIVES))
async def test_bad_archives_are_refused_and_lose_nothing(client: httpx.AsyncClient, c_guest: Callable[[str], bytes], case: str) -> None:
    _, key = await new_tenant(client)
    await deploy(client, key, "probe", c_guest("wasi_probe.c"))
    await put_files(client, key, "probe", tar_archive({"kept.txt": b"kept"}))
    r = await put_files(client, key, "probe", BAD_ARCHIVES[case])
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_archive", r.text
    assert (await call(client, key, "probe", "cat", "/kept.txt")).text == "kept"


async def test_files_quotas(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    module = c_guest("wasi_probe.c")
    tid, key = await new_tenant(client, max_files_bytes=10_000, max_stored_bytes=len(module) + 30_000)
    await deploy(client, key, "probe", module)
    r = await put_files(client, key, "probe", tar_archive({"a": b"x" * 10_001}))
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_archive" and "10000" in r.text
    r = await put_files(client, key, "probe", b"x" * (10_000 + 1024 * 10_000 + 10241))
    assert r.status_code == 413
    r = await put_files(client, key, "probe", tar_archive({"a": b"x"}), content_type="application/zip")
    assert r.status_code == 415
    assert (await put_files(client, key, "probe", tar_archive({"a": b"x" * 9000}))).status_code == 200


async def test_files_count_against_stored_bytes(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    module = c_guest("wasi_probe.c")
    small, large = tar_archive({"a": b"small"}), tar_archive({"a": b"x" * 50_000})
    tid, key = await new_tenant(client, max_stored_bytes=len(module) + len(small) + 100)
    await deploy(client, key, "probe", module)
    assert (await put_files(client, key, "probe", small)).status_code == 200
    assert (await client.get("/v1/usage", headers=key)).json()["stored_bytes"] == len(module) + len(small)
    r = await put_files(client, key, "probe", large)
    assert r.status_code == 429 and r.json()["error"]["code"] == "storage_quota_exceeded", r.text
    assert (await call(client, key, "probe", "cat", "/a")).text == "small"  # nothing lost
    await client.patch(f"/v1/admin/tenants/{tid}/quota", json={"max_stored_bytes": len(module) + len(large)}, headers=ADMIN)
    assert (await put_files(client, key, "probe", large)).status_code == 200  # the old archive no longer counts
