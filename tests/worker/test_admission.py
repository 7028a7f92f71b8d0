"""A worker admits a front's run only on a token the supervisor made for it: a lease's (this
tenant, this worker, one run, and never again once used) or a route's (this tenant and worker,
every run while the tenant is bound)."""

from __future__ import annotations

from typing import Any

from app.contract.messages import LeaseToken, Run, lease_mac
from app.worker.main import _Worker

SECRET = b"k" * 32


def _worker() -> _Worker:
    w = _Worker(runner=None, host=None, memory=None, stats=None)
    w.bind_tokens("tenant-a", "w1", SECRET)
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


def test_a_route_token_admits_every_run_of_its_tenant_while_bound() -> None:
    w = _worker()
    assert [w.admit(_run("")) for _ in range(3)] == [None, None, None]
    assert w.admit(_run("", worker="w2")) == "bad lease token"
    assert w.admit(_run("", mac=lease_mac(b"x" * 32, "", "w1", "tenant-a"))) == "bad lease token"  # another node's secret
    w.bind_tokens("tenant-b", "w1", SECRET)  # bound again: the old tenant's route is not this one's
    assert w.admit(_run("")) == "the lease is for another tenant"
    assert w.admit(_run("", tenant="tenant-b")) is None
