"""A front's side of the lease protocol (app/node/client.py), against a scripted supervisor on a
real unix socket: handoffs of a lease to the front's own waiting calls of its tenant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from app.contract.errors import Rejected
from app.contract.messages import (
    Granted,
    Handoff,
    Hello,
    LeaseRequest,
    LeaseToken,
    NodeMessage,
    Outcome,
    Queued,
    Recall,
    Refusal,
    RefusalKind,
    ReleaseLease,
)
from app.node.client import _HANDOFF_WAITING_MAX, RemoteLease, SupervisorClient
from app.node.ipc import MessageProtocol, pack
from app.services.principal import TenantPrincipal, TenantQuota


@dataclass
class Scripted:
    """The supervisor's end: what the front sent, and a way to answer."""

    got: asyncio.Queue[NodeMessage] = field(default_factory=asyncio.Queue)
    transport: asyncio.Transport | None = None

    def send(self, msg: NodeMessage) -> None:
        assert self.transport is not None
        self.transport.write(pack(msg))

    async def next(self) -> NodeMessage:
        while True:
            msg = await asyncio.wait_for(self.got.get(), 5)
            if not isinstance(msg, Hello):
                return msg

    def quiet(self) -> bool:
        return self.got.empty()


@asynccontextmanager
async def front(tmp_path: Path) -> AsyncIterator[tuple[SupervisorClient, Scripted]]:
    sup = Scripted()

    def made(transport: asyncio.Transport) -> None:
        sup.transport = transport

    path = str(tmp_path / "sup.sock")
    server = await asyncio.get_running_loop().create_unix_server(
        lambda: MessageProtocol(made, sup.got.put_nowait, lambda exc: None), path=path
    )
    client = SupervisorClient(path)
    await client.connect()
    try:
        yield client, sup
    finally:
        await client.close()
        server.close()


def tenant(name: str = "t") -> TenantPrincipal:
    quota = TenantQuota(
        gpu_memory_bytes=0, max_concurrency=4, requests_per_second=100.0, max_functions=10,
        max_module_bytes=1 << 20, wasm_memory_bytes=1 << 20, timeout_ms=1000, max_queued=10,
    )
    return TenantPrincipal(f"id-{name}", name, quota)


def grant(req: int, lease_id: str, tenant_id: str, handoffs: int) -> Granted:
    token = LeaseToken(lease_id, tenant_id, b"mac", 1 + handoffs)
    return Granted(req, lease_id, "w1", "/nowhere.sock", token, "", 0.0, handoffs)


async def asked(sup: Scripted) -> LeaseRequest:
    msg = await sup.next()
    assert isinstance(msg, LeaseRequest), msg
    return msg


async def granted(client: SupervisorClient, sup: Scripted, t: TenantPrincipal, lease_id: str, handoffs: int) -> RemoteLease:
    """A call of `t` asks for a lease and the supervisor grants it at once."""
    first = asyncio.create_task(client.lease(t, 1.0, None, True))
    r = await asked(sup)
    sup.send(grant(r.req, lease_id, t.id, handoffs))
    lease = await first
    assert isinstance(lease, RemoteLease)
    return lease


async def waiting(
    client: SupervisorClient, sup: Scripted, t: TenantPrincipal, timeout_s: float = 1.0, queued: bool = True
) -> tuple[asyncio.Task[Any], LeaseRequest]:
    """A call of `t` that asked for a lease and waits; `queued`: the supervisor said it admitted it."""
    task = asyncio.create_task(client.lease(t, timeout_s, None, True))
    r = await asked(sup)
    if queued:
        sup.send(Queued(r.req))
        for _ in range(100):  # until the front has read it
            if r.req in client._queued:
                break
            await asyncio.sleep(0.01)
    return task, r


async def test_a_lease_goes_to_the_oldest_waiting_call_of_its_tenant(tmp_path: Path) -> None:
    t, other = tenant("t"), tenant("u")
    async with front(tmp_path) as (client, sup):
        lease = await granted(client, sup, t, "L1", handoffs=2)
        assert lease.handoffs_left == 2
        waiting_other, r_other = await waiting(client, sup, other)
        second, r2 = await waiting(client, sup, t, 2.5)
        third, r3 = await waiting(client, sup, t)

        client.release(lease, Outcome.OK, "v1")  # the first call ends: its lease goes on
        assert await sup.next() == Handoff("L1", r2.req, 2.5)  # the oldest of its tenant, its timeout
        assert await second is lease and lease.runs == 2 and lease.kernels == "v1"
        assert not waiting_other.done()  # another tenant's call never gets it

        client.release(lease, Outcome.OK, "v1")
        assert await sup.next() == Handoff("L1", r3.req, 1.0)
        assert await third is lease

        # the handoffs are used up: the lease goes back, with the runs it carried
        client.release(lease, Outcome.OK, "v1")
        assert await sup.next() == ReleaseLease("L1", Outcome.OK, "v1", runs=3, unused=0)

        # a grant that crossed a handoff is given back unused
        sup.send(grant(r2.req, "L2", t.id, handoffs=0))
        assert await sup.next() == ReleaseLease("L2", Outcome.UNUSED, "", runs=1, unused=0)
        # and a refusal that crossed one is ignored
        sup.send(Refusal(r3.req, RefusalKind.REJECTED, "rate", "rate", 1))
        sup.send(Refusal(r_other.req, RefusalKind.NO_CAPACITY, "busy"))
        try:
            await waiting_other
        except Exception as exc:
            assert "busy" in str(exc)
        assert sup.quiet()


async def test_a_lease_without_handoffs_a_recalled_one_or_a_failed_call_goes_back(tmp_path: Path) -> None:
    t = tenant()
    async with front(tmp_path) as (client, sup):
        for handoffs, recall, outcome in ((0, False, Outcome.OK), (3, True, Outcome.OK), (3, False, Outcome.LOST)):
            lease_id = f"L-{handoffs}-{recall}-{outcome}"
            lease = await granted(client, sup, t, lease_id, handoffs)
            waiter, r2 = await waiting(client, sup, t)
            if recall:
                sup.send(Recall([lease_id]))
                await asyncio.sleep(0.05)
            client.release(lease, outcome, "")
            released = await sup.next()
            assert isinstance(released, ReleaseLease) and released.lease_id == lease_id and released.outcome == outcome
            sup.send(grant(r2.req, lease_id + "-next", t.id, 0))
            got = await waiter
            assert got is not lease  # it had to wait for its own grant
            client.release(got, Outcome.OK, "")
            assert (await sup.next()).lease_id == lease_id + "-next"  # type: ignore[union-attr]


async def test_a_call_that_leaves_after_the_handoff_passes_the_lease_on(tmp_path: Path) -> None:
    """The caller of the call handed the lease went away before it ran: the run it would have
    made is not counted, and the lease goes to the next waiting call."""
    t = tenant()
    async with front(tmp_path) as (client, sup):
        lease = await granted(client, sup, t, "L", handoffs=4)
        second, r2 = await waiting(client, sup, t)
        third, r3 = await waiting(client, sup, t)
        client.release(lease, Outcome.OK, "")
        second.cancel()  # its lease arrived as it was cancelled
        assert await sup.next() == Handoff("L", r2.req, 1.0)
        assert await sup.next() == Handoff("L", r3.req, 1.0)
        assert await third is lease and lease.runs == 2 and lease.handoffs_left == 3  # the unused one came back
        client.release(lease, Outcome.OK, "")
        assert msgspec.structs.astuple(await sup.next()) == ("L", Outcome.OK, "", 2, 0)


async def test_a_grant_that_crossed_a_handoff_serves_the_next_waiting_call(tmp_path: Path) -> None:
    """The supervisor granted a call the front had just passed a lease to: the grant goes to the
    front's next waiting call of the tenant (a handoff of its own), not back to the supervisor."""
    t = tenant()
    async with front(tmp_path) as (client, sup):
        lease = await granted(client, sup, t, "L1", handoffs=3)
        second, r2 = await waiting(client, sup, t)
        third, r3 = await waiting(client, sup, t, 3.0)
        client.release(lease, Outcome.OK, "")
        assert await sup.next() == Handoff("L1", r2.req, 1.0)
        assert await second is lease
        sup.send(grant(r2.req, "L2", t.id, handoffs=3))  # crossed the handoff
        assert await sup.next() == Handoff("L2", r3.req, 3.0)
        got = await third
        assert got.grant.lease_id == "L2" and got.runs == 1 and got.handoffs_left == 3 and got.hard_timeout_s == 3.0
        for held in (lease, got):
            client.release(held, Outcome.OK, "")
            released = await sup.next()
            assert isinstance(released, ReleaseLease) and released.runs == held.runs
        assert sup.quiet()


async def test_a_front_with_many_calls_waiting_gives_the_lease_back(tmp_path: Path) -> None:
    """Past `_HANDOFF_WAITING_MAX` waiting calls of the tenant the front's own loop would hold the
    worker between runs: the lease goes back, and the supervisor's grants spread it."""
    t = tenant()
    async with front(tmp_path) as (client, sup):
        lease = await granted(client, sup, t, "L", handoffs=7)
        calls = [await waiting(client, sup, t) for _ in range(_HANDOFF_WAITING_MAX + 1)]
        client.release(lease, Outcome.OK, "")
        assert await sup.next() == ReleaseLease("L", Outcome.OK, "", runs=1, unused=0)
        sup.send(grant(calls[0][1].req, "L2", t.id, handoffs=7))
        second = await calls[0][0]
        client.release(second, Outcome.OK, "")  # now at the bound: passed on
        assert await sup.next() == Handoff("L2", calls[1][1].req, 1.0)
        assert await calls[1][0] is second
        for task, _ in calls[2:]:
            task.cancel()


async def test_a_call_the_supervisor_has_not_admitted_yet_is_never_handed_a_lease(tmp_path: Path) -> None:
    """Until `Queued` comes, a waiting call's request may still be refused for the rate (the
    refusal on its way): the lease passes it by, to an admitted call behind it or back."""
    t = tenant()
    async with front(tmp_path) as (client, sup):
        lease = await granted(client, sup, t, "L", handoffs=3)
        unknown, r_unknown = await waiting(client, sup, t, queued=False)
        admitted, r_admitted = await waiting(client, sup, t)
        client.release(lease, Outcome.OK, "")
        assert await sup.next() == Handoff("L", r_admitted.req, 1.0)  # the older one is passed by
        assert await admitted is lease
        sup.send(Refusal(r_unknown.req, RefusalKind.REJECTED, "over its rate", "rate", 1))
        with pytest.raises(Rejected):
            await unknown
        client.release(lease, Outcome.OK, "")  # nobody admitted waits: back it goes
        assert await sup.next() == ReleaseLease("L", Outcome.OK, "", runs=2, unused=0)
