"""A front's side of the lease protocol (app/node/supervisor_client.py), against a scripted supervisor on a
real unix socket: one lease per call, asked for as the call starts and released as it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import app.node.supervisor_client as supervisor_client
from app.contract.errors import NoCapacity, Rejected
from app.contract.messages import (
    Granted,
    Grow,
    Hello,
    LeaseRequest,
    LeaseToken,
    NodeMessage,
    Outcome,
    Principal,
    Quota,
    Refusal,
    RefusalKind,
    ReleaseLease,
    Routes,
    WithdrawLease,
)
from app.node.ipc import MessageProtocol, pack
from app.node.supervisor_client import RemoteLease, SupervisorClient


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


def tenant(name: str = "t") -> Principal:
    quota = Quota(
        gpu_memory_bytes=0, max_concurrency=4, requests_per_second=100.0, max_functions=10,
        max_module_bytes=1 << 20, wasm_memory_bytes=1 << 20, timeout_ms=1000, max_queued=10,
    )
    return Principal(f"id-{name}", name, quota)


def grant(req: int, lease_id: str, tenant_id: str, kernels_version: str = "") -> Granted:
    return Granted(req, lease_id, "w1", "/nowhere.sock", LeaseToken(lease_id, tenant_id, b"mac"), kernels_version)


async def asked(sup: Scripted) -> LeaseRequest:
    msg = await sup.next()
    assert isinstance(msg, LeaseRequest), msg
    return msg


async def test_a_call_gets_its_grant_and_releases_it_with_its_outcome(tmp_path: Path) -> None:
    t = tenant()
    async with front(tmp_path) as (client, sup):
        call = asyncio.create_task(client.lease(t, 2.5, "00-trace-span-01", True))
        r = await asked(sup)
        assert (r.principal.id, r.hard_timeout_s, r.check_rate, r.traceparent) == (t.id, 2.5, True, "00-trace-span-01")
        sup.send(grant(r.req, "L1", t.id, "v0"))
        lease = await call
        assert isinstance(lease, RemoteLease) and lease.kernels_version == "v0"
        client.release(lease, Outcome.OK, "v1")
        assert await sup.next() == ReleaseLease("L1", Outcome.OK, "v1")
        assert sup.quiet()


async def test_each_call_waits_for_its_own_lease(tmp_path: Path) -> None:
    """A lease ends with its call: the tenant's next call waiting in the same front never runs on
    it, it waits for the supervisor's grant."""
    t = tenant()
    async with front(tmp_path) as (client, sup):
        first = asyncio.create_task(client.lease(t, 1.0, None, True))
        r1 = await asked(sup)
        sup.send(grant(r1.req, "L1", t.id))
        lease = await first
        second = asyncio.create_task(client.lease(t, 1.0, None, True))
        r2 = await asked(sup)
        client.release(lease, Outcome.OK, "")
        assert await sup.next() == ReleaseLease("L1", Outcome.OK, "")
        await asyncio.sleep(0.05)
        assert not second.done()
        sup.send(grant(r2.req, "L2", t.id))
        got = await second
        assert got is not lease and got.grant.lease_id == "L2"


async def test_a_grant_to_a_call_that_went_away_goes_back_unused(tmp_path: Path) -> None:
    t = tenant()
    async with front(tmp_path) as (client, sup):
        call = asyncio.create_task(client.lease(t, 1.0, None, True))
        r = await asked(sup)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await sup.next() == WithdrawLease(r.req)  # out of the supervisor's queue
        sup.send(grant(r.req, "L1", t.id, "v0"))  # granted before the withdrawal came
        assert await sup.next() == ReleaseLease("L1", Outcome.UNUSED, "v0")


async def test_refusals_reach_the_call(tmp_path: Path) -> None:
    t = tenant()
    async with front(tmp_path) as (client, sup):
        call = asyncio.create_task(client.lease(t, 1.0, None, True))
        r = await asked(sup)
        sup.send(Refusal(r.req, RefusalKind.REJECTED, "over its rate", "rate", 3))
        with pytest.raises(Rejected) as rejected:
            await call
        assert rejected.value.retry_after == 3
        call = asyncio.create_task(client.lease(t, 1.0, None, True))
        r = await asked(sup)
        sup.send(Refusal(r.req, RefusalKind.NO_CAPACITY, "busy"))
        with pytest.raises(NoCapacity, match="busy"):
            await call
        assert sup.quiet()


async def test_grow_hints_slow_down_while_unanswered_and_start_over_when_the_tenants_workers_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(supervisor_client, "_now", lambda: now[0])
    async with front(tmp_path) as (client, sup):
        t = tenant()

        async def hints_at(*times: float) -> int:
            for at in times:
                now[0] = 100.0 + at
                client._grow(t)
            await asyncio.sleep(0.05)  # what was sent has arrived
            sent = 0
            while not sup.got.empty():
                sent += isinstance(sup.got.get_nowait(), Grow)
            return sent

        # asked every 10 ms for 2 s: hints at 0, 50, 150, 350, 750 ms, then a second apart (1.55 s)
        assert await hints_at(*(i / 100 for i in range(200))) == 6
        # a full node answers none: the pace stays at a second
        assert await hints_at(2.0, 2.5) == 0
        assert await hints_at(2.56) == 1
        # the tenant's workers changed: the first pace again
        sup.send(Routes(t.id, []))
        await asyncio.sleep(0.05)
        assert await hints_at(3.01, 3.02, 3.07) == 2
