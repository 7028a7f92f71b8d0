"""A wheel built with `pip wheel` and installed in a fresh venv works from any directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import ADMIN, ADMIN_TOKEN, ROOT, server_process

pytestmark = pytest.mark.slow


def _run(cmd: list[str | Path], cwd: Path, env: dict[str, str]) -> str:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _venv_with_these_dependencies(venv: Path, env: dict[str, str]) -> Path:
    """A fresh venv (with pip) that sees the dependencies of the interpreter running the tests but
    not its `app`: a .pth file lists this interpreter's site-packages directories. Not
    `--system-site-packages`: made from a venv's interpreter, that would give the base
    interpreter's packages, not this environment's. The .pth files of those directories (an
    editable install's path to this tree among them) are not processed: a directory a .pth file
    names is only appended to sys.path."""
    _run([sys.executable, "-m", "venv", venv], venv.parent, env)
    python = venv / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], venv.parent, env).strip())
    here = [p for p in dict.fromkeys(sys.path) if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    assert here, f"no site-packages directory on this interpreter's path: {sys.path}"
    (purelib / "_tensorwasm_test_dependencies.pth").write_text("".join(f"{p}\n" for p in here))
    return venv


def test_wheel_is_self_contained(tmp_path: Path, c_guest: Callable[[str], bytes]) -> None:
    # build from a copy, so the checkout gets no build/ directory
    src = tmp_path / "src"
    shutil.copytree(
        ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", ".tensorwasm", "__pycache__", ".pytest_cache", ".venv", "*.wasm")
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TENSORWASM_")}
    venv = _venv_with_these_dependencies(tmp_path / "venv", env)
    bin_ = venv / "bin"
    _run([bin_ / "python", "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", src], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("tensorwasm-*.whl")

    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"app", wheel.name.split("-py3")[0] + ".dist-info"}
    for data in ("app/kernels/std.cu", "app/kernels/std_numpy.py", "app/migrations/env.py", "app/migrations/script.py.mako"):
        assert data in names
    assert any(n.startswith("app/migrations/versions/0001") for n in names)
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "app").rglob("__init__.py")}
    assert all(f"{p}/__init__.py" in names for p in packages)  # every package of the tree ships

    # the app only from the wheel
    _run([bin_ / "python", "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel], tmp_path, env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run([bin_ / "python", "-c", "import app, app.kernels, app.migrations; print(app.__file__)"], elsewhere, env)
    assert where.startswith(str(venv)), where

    db = tmp_path / "db" / "tw.db"
    db.parent.mkdir()
    migrate_env = {**env, "TENSORWASM_DATABASE_URL": f"sqlite:///{db}", "TENSORWASM_DATA_DIR": str(tmp_path / "data")}
    assert "database is at head" in _run([bin_ / "tensorwasm", "migrate"], elsewhere, migrate_env)
    assert "wrote openapi.json" in _run([bin_ / "tensorwasm", "openapi"], elsewhere, env)
    assert (elsewhere / "openapi.json").is_file()

    node_env: dict[str, str | None] = {"PYTHONPATH": None, "TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN}
    with server_process(tmp_path / "data", f"sqlite:///{db}", command=[str(bin_ / "tensorwasm"), "serve"], env=node_env, cwd=elsewhere) as node:
        t = httpx.post(f"{node.url}/v1/admin/tenants", json={"name": "wheel"}, headers=ADMIN).json()
        key = httpx.post(f"{node.url}/v1/admin/tenants/{t['id']}/api-keys", headers=ADMIN).json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        r = httpx.put(f"{node.url}/v1/functions/vadd", content=c_guest("vector_add.c"), headers={**auth, "Content-Type": "application/wasm"}, timeout=60)
        assert r.status_code == 201, r.text
        a = np.arange(5, dtype=np.float32)
        b = np.full(5, 0.5, dtype=np.float32)
        r = httpx.post(f"{node.url}/v1/functions/vadd/invoke", content=a.tobytes() + b.tobytes(), headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        assert np.frombuffer(r.content, np.float32).tolist() == (a + b).tolist()  # the std kernel's NumPy twin ran
        log = node.log()
    assert f"serving: backend {os.environ.get('TENSORWASM_TEST_BACKEND', 'cpu')}" in log and not (elsewhere / ".tensorwasm").exists()
