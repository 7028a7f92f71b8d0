"""Worker-side span recording without an OpenTelemetry SDK in the worker: ids and timestamps
are made here and shipped back in the run result (see app/observability/tracing.py)."""

from __future__ import annotations

import os
import time
from typing import Any

FAMILIES = {
    "device_count": "device",
    "device_info": "device",
    "last_error": "device",
    "buffer_alloc": "buffers",
    "buffer_free": "buffers",
    "buffer_size": "buffers",
    "buffer_write": "buffers",
    "buffer_read": "buffers",
    "buffer_copy": "buffers",
    "module_load": "modules",
    "module_get": "modules",
    "function_get": "modules",
    "launch": "launch",
    "synchronize": "synchronize",
}


def new_span_id() -> str:
    return os.urandom(8).hex()


class SpanRecorder:
    """One `worker.run` span and one span per ABI call family (calls, errors, time inside)."""

    def __init__(self, attributes: dict[str, Any]) -> None:
        self.run_id = new_span_id()
        self.start = time.time_ns()
        self.attributes = attributes
        self.families: dict[str, list[int]] = {}  # family -> [first_start, last_end, calls, errors, busy_ns]

    def abi_call(self, name: str, start: int, end: int, failed: bool) -> None:
        fam = self.families.get(FAMILIES[name])
        if fam is None:
            self.families[FAMILIES[name]] = [start, end, 1, int(failed), end - start]
        else:
            fam[1] = end
            fam[2] += 1
            fam[3] += int(failed)
            fam[4] += end - start

    def finish(self, status: str) -> list[dict[str, Any]]:
        end = time.time_ns()
        attributes = {**self.attributes, "tensorwasm.status": status}
        spans = [{"name": "worker.run", "id": self.run_id, "parent": None, "start": self.start, "end": end, "attributes": attributes}]
        for fam, (first, last, calls, errors, busy) in self.families.items():
            spans.append(
                {
                    "name": f"abi.{fam}",
                    "id": new_span_id(),
                    "parent": self.run_id,
                    "start": first,
                    "end": last,
                    "attributes": {"tensorwasm.abi.calls": calls, "tensorwasm.abi.errors": errors, "tensorwasm.abi.busy_ns": busy},
                }
            )
        return spans
