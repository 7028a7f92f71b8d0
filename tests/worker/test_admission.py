"""A worker admits a front's run only on a lease token the supervisor made for it: this tenant,
this worker, one run, and never again once used."""

from __future__ import annotations

from typing import Any

from app.contract.messages import LeaseToken, Run, lease_mac
from app.worker.main import _Worker

SECRET = b"k" * 32


def _worker() -> _Worker:
    w = _Worker(runner=None, host=None, memory=None, stats=None)
    w.tenant_id, w.worker_id, w.secret = "tenant-a", "w1", SECRET
    return w


def _run(lease_id: str, tenant: str = "tenant-a", worker: str = "w1", **token: Any) -> Run:
    mac = token.pop("mac", None) or lease_mac(SECRET, lease_id, worker, tenant)
    return Run("inv", "f", "sha", {}, 1000, 1 << 20, 0, 0, lease=LeaseToken(lease_id, tenant, mac))


def test_a_lease_admits_one_run() -> None:
    w = _worker()
    assert w.admit(_run("n-1")) is None
    assert w.admit(_run("n-1")) == "the lease was used"


def test_a_lease_given_back_admits_nothing_after_a_newer_one() -> None:
    w = _worker()
    assert w.admit(_run("n-1")) is None
    assert w.admit(_run("n-2")) is None
    assert w.admit(_run("n-1")) == "the lease was used"


def test_a_token_for_another_lease_worker_or_tenant_is_refused() -> None:
    w = _worker()
    forged = lease_mac(SECRET, "n-2", "w1", "tenant-a")
    assert w.admit(_run("n-1", mac=forged)) == "bad lease token"  # another lease's token
    assert w.admit(_run("n-1", worker="w2")) == "bad lease token"
    assert w.admit(_run("n-1", tenant="tenant-b")) == "the lease is for another tenant"
    assert w.admit(Run("inv", "f", "sha", {}, 1000, 1 << 20, 0, 0)) == "no lease for this worker"
