"""A worker admits a front's run only on a lease token the supervisor made for it: this tenant,
this worker, at most the runs granted, and never again once a newer lease came."""

from __future__ import annotations

from typing import Any

from app.contract.messages import LeaseToken, Run, lease_mac
from app.worker.main import _Worker

SECRET = b"k" * 32


def _worker() -> _Worker:
    w = _Worker(runner=None, host=None, memory=None, stats=None)
    w.tenant_id, w.worker_id, w.secret = "tenant-a", "w1", SECRET
    return w


def _run(lease_id: str, runs: int = 1, tenant: str = "tenant-a", worker: str = "w1", **token: Any) -> Run:
    mac = token.pop("mac", None) or lease_mac(SECRET, lease_id, worker, tenant, runs)
    return Run("inv", "f", "sha", {}, 1000, 1 << 20, 0, 0, lease=LeaseToken(lease_id, tenant, mac, runs))


def test_a_lease_admits_its_granted_runs_and_no_more() -> None:
    w = _worker()
    assert [w.admit(_run("n-1", runs=3)) for _ in range(3)] == [None, None, None]
    assert w.admit(_run("n-1", runs=3)) == "the lease's runs are used up"


def test_a_lease_given_back_admits_nothing_after_a_newer_one() -> None:
    w = _worker()
    assert w.admit(_run("n-1", runs=5)) is None
    assert w.admit(_run("n-2")) is None
    assert w.admit(_run("n-1", runs=5)) == "the lease was given back"


def test_a_token_for_more_runs_another_worker_or_tenant_is_refused() -> None:
    w = _worker()
    forged = lease_mac(SECRET, "n-1", "w1", "tenant-a", 1)
    assert w.admit(_run("n-1", runs=50, mac=forged)) == "bad lease token"  # runs raised by hand
    assert w.admit(_run("n-1", worker="w2")) == "bad lease token"
    assert w.admit(_run("n-1", tenant="tenant-b")) == "the lease is for another tenant"
    assert w.admit(Run("inv", "f", "sha", {}, 1000, 1 << 20, 0, 0)) == "no lease for this worker"
