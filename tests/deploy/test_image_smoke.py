"""deploy/image-smoke.sh (the image built from the Dockerfile, run and checked; CI runs it):
its syntax, that CI calls it, and that it finds the base image the Dockerfile's targets need.
The build itself runs in .ci/run (it needs root and a few minutes)."""

from __future__ import annotations

import os
import re
import subprocess

from tests.helpers import ROOT

SCRIPT = ROOT / "deploy" / "image-smoke.sh"


def test_script_parses() -> None:
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert os.access(SCRIPT, os.X_OK)


def test_ci_runs_it_after_both_test_runs() -> None:
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    smoke = lines.index("deploy/image-smoke.sh")
    pytest_runs = [i for i, ln in enumerate(lines) if re.match(r"(python3 -m )?pytest\b", ln)]
    assert len(pytest_runs) == 2 and max(pytest_runs) < smoke


def _external(target: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TENSORWASM_SMOKE_TARGET"}
    if target:
        env["TENSORWASM_SMOKE_TARGET"] = target
    res = subprocess.run([str(SCRIPT), "--print-base"], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_it_finds_the_one_base_image_each_target_needs() -> None:
    images = set(re.findall(r"^FROM\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M | re.I))
    cpu, cuda = _external(None), _external("cuda")
    # the default target (the CPU image) builds on one python image, the one made locally
    assert len(cpu) == 1 and cpu[0] in images and cpu[0].startswith("python:")
    # the CUDA target builds on another registry image, which cannot be made here
    assert len(cuda) == 1 and cuda[0] in images and cuda[0] != cpu[0]


def test_an_unknown_target_fails_with_a_message() -> None:
    env = {**os.environ, "TENSORWASM_SMOKE_TARGET": "no-such-stage"}
    res = subprocess.run([str(SCRIPT), "--print-base"], capture_output=True, text=True, env=env)
    assert res.returncode != 0 and "no stage 'no-such-stage'" in res.stderr
