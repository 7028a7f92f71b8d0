"""A call's files as the runner gives them (app/runtime/files.py): the bundle read-only at `/`, or
a scratch copy per call that stops growing at its cap with ENOSPC in the guest; nothing outside
the mount is reachable, through `..` or links; nothing of one call's scratch reaches the next."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.contract.messages import Run
from app.runtime.artifacts import ArtifactCache
from app.runtime.bundles import BundleStore, check_archive, scratch_root
from app.runtime.engine import make_engine
from app.runtime.memory import GuestMemory
from app.runtime.runner import GuestRunner, RunResult
from tests.helpers import compile_artifact, tar_archive

Env = tuple[GuestRunner, str, str, Path]  # runner, probe sha256, bundle sha256, a host secret's path


@pytest.fixture(scope="module", params=["built at the call", "built ahead"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, c_guest: Callable[[str], bytes]) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("files")
    secret = base / "secret.txt"  # beside the bundles: what a guest must never read
    secret.write_text("host secret")
    cache = ArtifactCache(base / "cache")
    archive = tar_archive({"data/a.txt": b"alpha", "data/sub/b.txt": b"beta", "empty/": None, "link": "data/a.txt"})
    info = check_archive(archive, 1 << 20, 100)
    BundleStore(cache.base).unpack(info.sha256, archive, 100)
    memory = GuestMemory()
    runner = GuestRunner(make_engine(memory), cache, None, 5, memory)
    yield runner, compile_artifact(cache, c_guest("wasi_probe.c")), info.sha256, secret
    del memory


def _run(env: Env, *args: str, scratch: int = 0, ahead: bool = False) -> RunResult:
    runner, sha, files, _ = env
    req = Run("inv", "probe", sha, {}, 10_000, 64 << 20, 4 << 20, 1 << 16, args=list(args), files=files, scratch_bytes=scratch)
    if ahead:
        runner.run(req, b"")
        runner.prepare(req)
    return runner.run(req, b"")


def _out(res: RunResult) -> str:
    return bytes(res.stdout).decode()


def test_the_bundle_is_the_guests_root(env: Env) -> None:
    assert _out(_run(env, "cat", "/data/a.txt")) == "alpha"
    assert _out(_run(env, "cat", "data/sub/b.txt")) == "beta"
    assert _out(_run(env, "cat", "/link")) == "alpha"  # a link inside the bundle works
    assert sorted(_out(_run(env, "ls", "/")).split()) == ["data", "empty", "link"]


@pytest.mark.parametrize(
    "args",
    [("write", "/new.txt", "10"), ("write", "/data/a.txt", "1"), ("mkdir", "/d"), ("rm", "/data/a.txt"), ("symlink", "a", "/l")],
    ids=["create", "overwrite", "mkdir", "rm", "symlink"],
)
def test_the_bundle_is_read_only(env: Env, args: tuple[str, ...]) -> None:
    res = _run(env, *args)
    assert res.exit_code == 1 and _out(res).startswith("error"), _out(res)
    assert _out(_run(env, "cat", "/data/a.txt")) == "alpha"


@pytest.mark.parametrize("path", ["../secret.txt", "/../secret.txt", "/data/../../secret.txt", "/../../../../etc/passwd"])
def test_dotdot_cannot_leave_the_mount(env: Env, path: str) -> None:
    for scratch in (0, 1 << 20):
        res = _run(env, "cat", path, scratch=scratch)
        assert res.exit_code == 1 and "host secret" not in _out(res) and "root:" not in _out(res), _out(res)


def test_a_link_made_by_the_guest_cannot_leave_the_mount(env: Env) -> None:
    _, _, _, secret = env
    for target in ("../secret.txt", str(secret), "/etc/passwd", "../../../../../../etc/passwd", "data/../../secret.txt"):
        res = _run(env, "linkcat", target, "/out", scratch=1 << 20)
        assert res.exit_code == 1 and _out(res).startswith("error"), (target, _out(res))
    # a link that stays inside works
    assert _out(_run(env, "linkcat", "data/sub/b.txt", "/in", scratch=1 << 20)) == "beta"


def test_scratch_is_writable_per_call_and_emptied(env: Env) -> None:
    before = {p.name for p in scratch_root().iterdir() if p.name.startswith("tw-scratch-")}
    res = _run(env, "write", "/data/new.txt", "3000", scratch=1 << 20)
    assert _out(res) == "wrote 3000\n", _out(res)
    # the next call gets a fresh copy: the write is gone, the bundle untouched
    res = _run(env, "cat", "/data/new.txt", scratch=1 << 20)
    assert _out(res) == "error: ENOENT\n"
    assert _out(_run(env, "write", "/data/a.txt", "2", scratch=1 << 20)) == "wrote 2\n"
    assert _out(_run(env, "cat", "/data/a.txt")) == "alpha"
    assert {p.name for p in scratch_root().iterdir() if p.name.startswith("tw-scratch-")} == before


def test_scratch_past_its_cap_is_enospc_in_the_guest(env: Env) -> None:
    cap = 256 * 1024
    res = _run(env, "write", "/big", str(4 * cap), scratch=cap)
    assert res.status == "exit" and res.exit_code == 1
    line = _out(res)
    assert line.startswith("error after ") and line.endswith(": ENOSPC\n"), line
    assert int(line.split()[2].rstrip(":")) <= cap  # what was written stayed within the cap
    # under the cap: fine, also on an instance built ahead
    assert _out(_run(env, "write", "/small", str(cap // 4), scratch=cap, ahead=True)) == f"wrote {cap // 4}\n"


def test_a_function_without_files_has_no_root(env: Env) -> None:
    runner, sha, _, _ = env
    res = runner.run(Run("inv", "probe", sha, {}, 10_000, 64 << 20, 4 << 20, 1 << 16, args=["ls", "/"]), b"")
    assert res.exit_code == 1 and _out(res).startswith("error")


def test_missing_files_fail_the_call_not_the_worker(env: Env) -> None:
    runner, sha, _, _ = env
    res = runner.run(Run("inv", "probe", sha, {}, 10_000, 64 << 20, 4 << 20, 1 << 16, args=["ls", "/"], files="0" * 64), b"")
    assert res.status == "error" and res.error == "the function's files are not unpacked on this node"
    assert _out(_run(env, "cat", "/data/a.txt")) == "alpha"
