"""The density bench on the CPU backend at tiny sizes: every phase runs and its figures are sane."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from app.bench.density import DensityConfig, devices, report, run_density
from app.cli import cli


def test_every_phase_reports_sane_figures_at_tiny_sizes() -> None:
    cfg = DensityConfig(
        backend="cpu", bound_tenants=3, tenants=3, workers=2, clients=2, seconds=2, ceiling=1, ceiling_tenants=3,
        ceiling_rounds=1, spares=1, start_parallel=2, bound_spares=3,
    )
    res = run_density(cfg)

    bound = res["bound"]
    assert bound["statuses"] == {"200": 3}
    assert bound["spares"] == 3 and bound["spares_ready"] == 3  # every tenant found a ready spare
    cold = bound["cold_ms"]
    assert 0 < cold["p50"] <= cold["p90"] <= cold["p99"] <= cold["max"]
    assert res["burst"]["statuses"] == {"200": 3} and res["burst"]["ms"]["p50"] > 0

    churn = res["churn"]
    assert churn["calls"] > 0 and churn["statuses"].get("200", 0) > 0 and churn["ok_per_s"] > 0
    assert churn["binds"] >= cfg.workers  # three tenants over two workers: each worker was bound at least once
    assert churn["switches_per_s"] > 0 and churn["starts_per_s"] > 0
    assert churn["max_wait_s"] + 0.001 >= churn["ms"]["max"] / 1e3 and churn["503_with_retry_after"] == churn["statuses"].get("503", 0)
    assert abs(churn["switch_to_start_ratio"] - churn["switches_per_s"] / churn["starts_per_s"]) < 0.01
    assert churn["starts_held"] == 0 and churn["starts_per_s_held"] > 0  # two workers, two at once: none held beside
    assert churn["node_starts"] >= 1 and churn["node_start_ms_mean"] > 0
    assert sum(churn["worker_states_mean"].values()) > 0

    ceiling = res["ceiling"]
    assert ceiling["calls"] == 3 and abs(sum(ceiling["share"].values()) - 1) < 0.01
    assert ceiling["bound_held"] and ceiling["max_wait_s"] <= ceiling["bound_s"]
    assert ceiling["503_with_retry_after"] == ceiling["503"]

    for label in ("bound", "churn", "ceiling"):
        mem = res["memory"][label]
        assert mem["workers"] > 0
        assert 0 < mem["pss_mib_mean"] <= mem["rss_mib_mean"] <= mem["rss_mib_max"]
        assert 0 < mem["host_used_mib"] < mem["host_total_mib"]
        assert sum(d["workers"] for d in res["devices"][label].values()) >= mem["workers"]
    assert res["devices"]["bound"]["0"]["bound_tenants"] == 3

    text = report(res)
    assert "switch rate / start rate" in text and "longest wait" in text
    json.dumps(res)  # the --json file is this, as it is


def test_workers_are_grouped_by_device_and_count_each_tenant_once() -> None:
    workers = [
        {"state": "idle", "tenant_id": "a", "device": 1},
        {"state": "busy", "tenant_id": "a", "device": 1},
        {"state": "spare", "tenant_id": None, "device": 1},
        {"state": "idle", "tenant_id": "b"},  # a node that does not say: device 0
        {"state": "dead", "tenant_id": "c", "device": 0},
    ]
    assert devices(workers) == {"0": {"workers": 1, "bound_tenants": 1}, "1": {"workers": 3, "bound_tenants": 1}}


def test_an_unknown_phase_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["bench", "density", "--phases", "bound,nope", "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 2 and "nope" in result.output
    assert not (tmp_path / "r.json").exists()
