"""The load generator wrapper: wrk's figures come back as numbers, replies counted by status."""

from __future__ import annotations

import httpx
import pytest

from app.bench.node import bare_echo, bare_relay
from app.bench.wrk import run_wrk, wrk_path

pytestmark = pytest.mark.skipif(wrk_path() is None, reason="wrk is not installed (`apt-get install wrk`; .ci/run installs it)")


def test_wrk_counts_replies_by_status_against_the_bare_echo_app() -> None:
    with bare_echo(1) as url:
        ok = run_wrk(url, connections=2, seconds=1, method="POST", body="hi")
        missing = run_wrk(url.replace("/echo", "/nowhere"), connections=1, seconds=1)
    assert ok.requests > 0 and ok.ok == ok.requests and ok.other == 0 and ok.socket_errors == 0
    assert 0 < ok.p50_ms <= ok.p99_ms <= ok.max_ms
    assert missing.requests > 0 and missing.ok == 0 and missing.other == missing.requests  # 404s


def test_the_one_hop_baseline_echoes_through_its_other_process() -> None:
    with bare_relay(2) as url:
        body = bytes(range(256)) * 300  # more than one socket read on both sides
        assert httpx.post(url, content=body, timeout=10).content == body
        ok = run_wrk(url, connections=4, seconds=1, method="POST", body="hi")
    assert ok.requests > 0 and ok.ok == ok.requests and ok.socket_errors == 0
