"""The supervisor's framing of node messages (app/node/ipc.py): whatever the reads bring, each
message is delivered once and in order; garbage or an oversized length closes the connection and
says why."""

from __future__ import annotations

from typing import Any

import pytest

from app.contract.frames import ProtocolError
from app.contract.messages import Hello, NodeMessage, Outcome, ReleaseLease
from app.node.ipc import MAX_MESSAGE, MessageProtocol, pack


class _Transport:
    closed = False

    def close(self) -> None:
        self.closed = True


def _protocol() -> tuple[MessageProtocol, list[NodeMessage], list[Exception | None], _Transport]:
    got: list[NodeMessage] = []
    lost: list[Exception | None] = []
    transport = _Transport()
    p = MessageProtocol(lambda t: None, got.append, lost.append)
    p.connection_made(transport)  # type: ignore[arg-type]
    return p, got, lost, transport


MESSAGES: list[Any] = [Hello(front=1, pid=42), *(ReleaseLease(f"lease-{i}", Outcome.OK, f"v{i}") for i in range(1, 6))]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_messages_come_out_whole_and_in_order_however_the_reads_cut_them(step: int) -> None:
    p, got, lost, transport = _protocol()
    stream = b"".join(pack(m) for m in MESSAGES)
    for i in range(0, len(stream), step):
        p.data_received(stream[i : i + step])
    assert got == MESSAGES
    p.connection_lost(None)
    assert lost == [None] and not transport.closed


def test_a_length_past_the_limit_closes_the_connection() -> None:
    p, got, lost, transport = _protocol()
    p.data_received(pack(MESSAGES[0]) + (MAX_MESSAGE + 1).to_bytes(4, "little"))
    assert got == [MESSAGES[0]] and transport.closed
    p.data_received(pack(MESSAGES[1]))  # nothing more is read from a broken stream
    p.connection_lost(None)
    assert got == [MESSAGES[0]]
    assert len(lost) == 1 and isinstance(lost[0], ProtocolError) and "too large" in str(lost[0])


def test_bytes_that_are_no_message_close_the_connection() -> None:
    p, got, lost, transport = _protocol()
    junk = b"\xc1\xc1\xc1"
    p.data_received(len(junk).to_bytes(4, "little") + junk + pack(MESSAGES[0]))
    assert got == [] and transport.closed
    p.connection_lost(None)
    assert isinstance(lost[0], ProtocolError) and "bad node message" in str(lost[0])
