"""bench guest-call: the worker's run of an echo call, piece by piece, beside plain wasmtime-py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from app.bench.guest_call import FIGURES, _report, measure
from app.cli import cli


def test_the_cpu_figures_are_measured_in_this_process() -> None:
    got = measure("cpu", 50)
    assert set(got) == set(FIGURES)
    assert all(v > 0 for k, v in got.items() if k != "end_of_call")
    assert got["end_of_call"] >= 0  # the CPU backend has nothing to finish
    assert got["run"] < got["bare"] * 10  # the same guest, both ran it (a wild ratio means a broken run)


def test_the_command_runs_each_backend_in_its_own_process_and_prints_the_ratio() -> None:
    result = CliRunner().invoke(cli, ["bench", "guest-call", "--backends", "cpu", "--calls", "20", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output[: result.output.index("\n}") + 2])["cpu"]
    ratio = figures["run"] / figures["bare"]
    assert f"{ratio:.2f}x" in next(line for line in result.output.splitlines() if line.startswith("run / bare"))


def test_the_report_puts_backends_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    _report({"cpu": dict.fromkeys(FIGURES, 50.0) | {"run": 100.0}, "cuda": dict.fromkeys(FIGURES, 50.0) | {"run": 300.0}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-2:] == ["cpu", "cuda"]
    assert next(line for line in lines if line.startswith("worker's run")).split()[-2:] == ["100.0", "300.0"]
    assert next(line for line in lines if line.startswith("run / bare")).split()[-2:] == ["2.00x", "6.00x"]
