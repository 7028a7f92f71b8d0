"""uv.lock was made from pyproject.toml as it is (the image installs from the lock)."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement

from tests.helpers import ROOT


def _normalized(req: Requirement, extra: str | None) -> tuple[str, str, str | None]:
    return (req.name.lower().replace("_", "-"), str(req.specifier), extra)


def test_lock_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_normalized(Requirement(r), None) for r in project["dependencies"]}
    for extra, reqs in project["optional-dependencies"].items():
        wanted |= {_normalized(Requirement(r), extra) for r in reqs}

    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (me,) = [p for p in lock["package"] if p["name"] == project["name"]]
    locked = set()
    for r in me["metadata"]["requires-dist"]:
        marker = r.get("marker", "")
        extra = marker.split("'")[1] if marker.startswith("extra == ") else None
        locked.add((r["name"].lower().replace("_", "-"), str(Requirement(f"x{r.get('specifier', '')}").specifier), extra))
    assert locked == wanted, "uv.lock is stale: run `uv lock`"
    assert set(me["metadata"]["provides-extras"]) == set(project["optional-dependencies"])
