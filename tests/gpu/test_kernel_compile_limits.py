"""NVRTC checks of tenant kernels (PUT /v1/kernels) run in the compile sandbox: a pathological
source is stopped at a limit, a bad one is refused with the compiler's log. Marked `gpu`."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import new_tenant

pytestmark = pytest.mark.gpu

GOOD = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }'
BAD = 'extern "C" __global__ void k( {'


def macro_bomb(depth: int) -> str:
    """A short source whose preprocessing doubles `depth` times: 2**depth tokens in one
    expression (depth 16 ran for over 25 s in NVRTC on an H200 host)."""
    lines = ["#define A0 x+", *(f"#define A{i} A{i - 1} A{i - 1}" for i in range(1, depth + 1))]
    return "\n".join(lines) + f'\nextern "C" __global__ void k(int* p) {{ int x = p[1]; p[0] = A{depth} 0; }}\n'


def cuda_compiles(text: str) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "tensorwasm_compiles_total" and s.labels["kind"] == "cuda"
    }


async def test_a_pathological_source_hits_the_time_limit(app_factory) -> None:
    async with app_factory(compile_timeout_s=3) as (client, _):
        _, key = await new_tenant(client)
        hdr = {**key, "Content-Type": "text/plain"}
        r = await client.put("/v1/kernels/bomb", content=macro_bomb(18), headers=hdr)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "compile_failed" and "took longer than 3 s (TENSORWASM_COMPILE_TIMEOUT_S)" in err["message"]
        r = await client.put("/v1/kernels/broken", content=BAD, headers=hdr)
        assert r.status_code == 422 and r.json()["error"]["code"] == "compile_failed"
        assert "does not compile" in r.json()["error"]["message"]
        assert (await client.put("/v1/kernels/good", content=GOOD, headers=hdr)).status_code == 201
        counts = cuda_compiles((await client.get("/metrics")).text)
        assert (counts["timeout"], counts["invalid"], counts["ok"]) == (1, 1, 1)


async def test_the_memory_limit_names_itself(app_factory) -> None:
    # The compile process maps NVRTC before its limit is set, so the limit bounds what a compile
    # adds: at the smallest limit allowed, a source whose preprocessing doubles 16 times runs out
    # of memory long before the time limit.
    low = 256 * 1024 * 1024
    async with app_factory(compile_memory_bytes=low, compile_timeout_s=120) as (client, _):
        _, key = await new_tenant(client)
        r = await client.put("/v1/kernels/k", content=macro_bomb(16), headers={**key, "Content-Type": "text/plain"})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "compile_failed"
        assert f"more than {low} bytes of memory (TENSORWASM_COMPILE_MEMORY_BYTES)" in err["message"], err["message"]
        assert cuda_compiles((await client.get("/metrics")).text)["memory"] == 1
