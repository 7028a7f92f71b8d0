"""Encode + decode cost of the node's messages (`python -m app.bench.contract`): msgspec Structs
as MessagePack (what app/contract uses) against json.dumps/loads of plain dicts and pydantic
models (model_dump_json / model_validate_json), for a run header and a lease request."""

from __future__ import annotations

import json
import timeit
from collections.abc import Callable
from typing import Any

import msgspec
from pydantic import BaseModel

from app.contract.messages import (
    LeaseRequest,
    LeaseToken,
    Principal,
    Quota,
    Run,
    node_decoder,
    node_encoder,
    worker_decoder,
    worker_encoder,
)


def _run() -> Run:
    return Run(
        invocation_id="7c3a1f0e9b2d4c6a8e1f3b5d7a9c2e4f",
        function="echo",
        sha256="9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        env={
            "TW_FUNCTION": "echo", "TW_INVOCATION_ID": "7c3a1f0e9b2d4c6a8e1f3b5d7a9c2e4f", "TW_TENANT": "acme",
            "QUERY_STRING": "", "CONTENT_TYPE": "text/plain",
        },
        timeout_ms=10_000,
        wasm_memory_bytes=256 << 20,
        stdout_limit=16 << 20,
        stderr_limit=64 << 10,
        kernels_version="3b5d7a9c2e4f7c3a1f0e9b2d4c6a8e1f",
        lease=LeaseToken("0e9b2d4c6a8e1f3b5d7a9c2e4f7c3a1f", "d4c6a8e1f3b5d7a9c2e4f7c3a1f0e9b2", b"\x01" * 32),
    )


def _lease() -> LeaseRequest:
    quota = Quota(256 << 20, 4, 100.0, 50, 16 << 20, 256 << 20, 10_000, 100, 1 << 30)
    return LeaseRequest(17, Principal("d4c6a8e1f3b5d7a9c2e4f7c3a1f0e9b2", "acme", quota), 11.0, True, None)


class PRun(BaseModel):
    op: str
    invocation_id: str
    function: str
    sha256: str
    env: dict[str, str]
    timeout_ms: int
    wasm_memory_bytes: int
    stdout_limit: int
    stderr_limit: int
    kernels: dict[str, str] | None = None
    kernels_version: str = ""
    traceparent: str | None = None
    lease: dict[str, Any] | None = None


class PQuota(BaseModel):
    gpu_memory_bytes: int
    max_concurrency: int
    requests_per_second: float
    max_functions: int
    max_module_bytes: int
    wasm_memory_bytes: int
    timeout_ms: int
    max_queued: int
    max_stored_bytes: int


class PPrincipal(BaseModel):
    id: str
    name: str
    quota: PQuota


class PLease(BaseModel):
    t: str
    req: int
    principal: PPrincipal
    hard_timeout_s: float
    check_rate: bool = True
    traceparent: str | None = None


def _per_call_us(fn: Callable[[], object], number: int = 20_000) -> float:
    best = min(timeit.repeat(fn, number=number, repeat=5))
    return best / number * 1e6


def measure() -> dict[str, dict[str, float]]:
    run, lease = _run(), _lease()
    as_dict: dict[str, dict[str, Any]] = {
        "run header": msgspec.to_builtins(run),
        "lease request": msgspec.to_builtins(lease),
    }
    as_dict["run header"]["op"] = "run"
    as_dict["lease request"]["t"] = "lease"
    # JSON has no bytes: the MAC goes as hex, as a dict-based protocol would have to
    as_dict["run header"]["lease"]["mac"] = (b"\x01" * 32).hex()
    p_run = PRun.model_validate(as_dict["run header"])
    p_lease = PLease.model_validate(as_dict["lease request"])
    cases: dict[str, dict[str, Callable[[], object]]] = {
        "run header": {
            "msgspec msgpack Struct": lambda: worker_decoder.decode(worker_encoder.encode(run)),
            "json dict": lambda: json.loads(json.dumps(as_dict["run header"], separators=(",", ":"))),
            "pydantic model": lambda: PRun.model_validate_json(p_run.model_dump_json()),
        },
        "lease request": {
            "msgspec msgpack Struct": lambda: node_decoder.decode(node_encoder.encode(lease)),
            "json dict": lambda: json.loads(json.dumps(as_dict["lease request"], separators=(",", ":"))),
            "pydantic model": lambda: PLease.model_validate_json(p_lease.model_dump_json()),
        },
    }
    return {msg: {name: _per_call_us(fn) for name, fn in impls.items()} for msg, impls in cases.items()}


def main() -> int:
    results = measure()
    print(f"{'message':16} {'msgspec msgpack Struct':>24} {'json dict':>12} {'pydantic model':>16}   (µs per encode + decode)")
    for msg, r in results.items():
        print(f"{msg:16} {r['msgspec msgpack Struct']:24.2f} {r['json dict']:12.2f} {r['pydantic model']:16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
