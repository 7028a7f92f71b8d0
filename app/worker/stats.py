"""A small shared page per worker that the api process reads without asking the worker.

A busy worker is inside a guest, so it cannot answer a request; the page lets /v1/admin/workers
and the metrics show its live GPU bytes and counters at any moment.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

FIELDS = ("gpu_bytes_in_use", "gpu_bytes_cap", "launches", "invocations")
_LAYOUT = struct.Struct("<" + "q" * len(FIELDS))


def stats_dir(data_dir: Path) -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else data_dir
    return base


class StatsPage:
    def __init__(self, path: Path, create: bool) -> None:
        self.path = path
        if create:
            with open(path, "wb") as f:
                f.write(b"\0" * _LAYOUT.size)
        self._f = open(path, "r+b")
        self._map = mmap.mmap(self._f.fileno(), _LAYOUT.size)

    def read(self) -> dict[str, int]:
        return dict(zip(FIELDS, _LAYOUT.unpack_from(self._map, 0)))

    def set(self, field: str, value: int) -> None:
        struct.pack_into("<q", self._map, 8 * FIELDS.index(field), value)

    def close(self, unlink: bool = False) -> None:
        try:
            self._map.close()
            self._f.close()
        finally:
            if unlink:
                self.path.unlink(missing_ok=True)
