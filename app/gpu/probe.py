"""List the GPUs this node sees, from a short child process: `python -m app.gpu.probe`.

The scheduler and the fork server must never initialise CUDA (a forked worker needs a clean
driver state, and the scheduler holds no context), so the count and properties of the devices
are read here and printed as JSON: [{index, total_memory_bytes, name, compute_capability,
pci_bus_id}], in the order the CUDA runtime numbers them under this process's own
CUDA_VISIBLE_DEVICES. An empty list: no CuPy or no device.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuInfo:
    index: int  # the runtime's number for it in the probing (node's) environment
    visible_id: str  # what a child's CUDA_VISIBLE_DEVICES must say to see this device alone
    total_memory_bytes: int
    name: str
    compute_capability: str
    pci_bus_id: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def pci_bus_id(props: dict[str, Any]) -> str:
    """domain:bus:device.function of a device, from the runtime's properties of it."""
    return f"{int(props.get('pciDomainID', 0)):04x}:{int(props.get('pciBusID', 0)):02x}:{int(props.get('pciDeviceID', 0)):02x}.0"


def list_gpus() -> list[dict[str, Any]]:
    try:
        import cupy

        rt = cupy.cuda.runtime
        count = rt.getDeviceCount()
    except Exception:
        return []
    out = []
    for i in range(count):
        props = rt.getDeviceProperties(i)  # initialises the driver, creates no context
        out.append(
            {
                "index": i,
                "total_memory_bytes": int(props["totalGlobalMem"]),
                "name": _text(props["name"]),
                "compute_capability": f"{props['major']}{props['minor']}",
                "pci_bus_id": pci_bus_id(props),
            }
        )
    return out


def visible_ids(count: int, env: str | None) -> list[str]:
    """Per runtime index, the entry naming that device in a child's CUDA_VISIBLE_DEVICES: the
    node's own entries when it has the variable (indices, UUIDs or MIG names), else the index."""
    if env is None or not env.strip():
        return [str(i) for i in range(count)]
    entries = [e.strip() for e in env.split(",") if e.strip()]
    return entries[:count] if len(entries) >= count else [str(i) for i in range(count)]


async def probe(timeout_s: float = 60.0) -> list[GpuInfo]:
    """Run the probe in a child process; an empty list when it fails or sees nothing."""
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.gpu.probe", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        log.error("could not run the GPU probe: %s", exc)
        return []
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        log.error("the GPU probe did not answer within %.0f s", timeout_s)
        return []
    if proc.returncode != 0:
        log.error("the GPU probe failed (code %s): %s", proc.returncode, err.decode(errors="replace")[-2000:])
        return []
    rows = json.loads(out or b"[]")
    ids = visible_ids(len(rows), os.environ.get("CUDA_VISIBLE_DEVICES"))
    return [
        GpuInfo(int(r["index"]), ids[n], int(r["total_memory_bytes"]), str(r["name"]), str(r["compute_capability"]), str(r["pci_bus_id"]))
        for n, r in enumerate(rows)
    ]


if __name__ == "__main__":
    print(json.dumps(list_gpus()))
