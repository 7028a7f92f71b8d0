"""Copies between guest memory and a managed buffer of 256 KiB or more go through the worker's
device staging block, STAGE_BYTES at a time (app/gpu/cuda.py): what is read back is what was
written, at any offset, across pieces, and from guest memory split into pieces of any size (as
the worker's pinned chunks split it)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.gpu.cuda import STAGE_BYTES, cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device (run on the GPU machine)")]


@pytest.fixture(scope="module", params=["managed", "device"])
def backend(request: pytest.FixtureRequest) -> Any:
    from app.gpu.cuda import CudaBackend

    b = CudaBackend(Path(tempfile.mkdtemp()), request.param)
    b.set_cap(1 << 30)
    return b


def _odd_pieces(addr: int, length: int) -> list[tuple[int, int, bool]]:
    """Guest memory in pieces of 1 MiB + 13 bytes (the last shorter), none page-locked."""
    step = (1 << 20) + 13
    return [(a, min(step, addr + length - a), False) for a in range(addr, addr + length, step)]


def _bytes(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _round_trip(backend: Any, buf: Any, data: np.ndarray) -> np.ndarray:
    """`data` written over the whole of `buf`, then read back."""
    backend.write(buf, 0, data.ctypes.data, data.size)
    out = np.zeros(data.size, dtype=np.uint8)
    backend.read(buf, 0, out.ctypes.data, data.size)
    return out


@pytest.mark.parametrize("size", [1000, 256 * 1024, STAGE_BYTES, 2 * STAGE_BYTES + 4099])
@pytest.mark.parametrize("offset", [0, 24])
def test_written_is_read(backend: Any, size: int, offset: int) -> None:
    data = _bytes(size, size + offset)
    buf = backend.alloc(size + offset + 8)
    backend.write(buf, offset, data.ctypes.data, size)
    out = np.empty(size + offset + 8, dtype=np.uint8)
    backend.read(buf, 0, out.ctypes.data, out.nbytes)
    assert np.array_equal(out[offset : offset + size], data)
    assert not out[:offset].any() and not out[offset + size :].any()  # zeros around a partial write
    part = np.empty(size // 2, dtype=np.uint8)  # a read from within the buffer
    backend.read(buf, offset + size // 3, part.ctypes.data, part.nbytes)
    assert np.array_equal(part, data[size // 3 : size // 3 + part.size])


def test_guest_memory_in_pieces(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "_segments", _odd_pieces)
    data = _bytes(2 * STAGE_BYTES + 777, 7)
    assert np.array_equal(_round_trip(backend, backend.alloc(data.size), data), data)


def test_no_room_for_the_block_copies_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device with no room for the staging block: managed copies go straight, and the block is
    asked for again in the next call."""
    import cupy

    from app.gpu.cuda import CudaBackend

    b = CudaBackend(Path(tempfile.mkdtemp()), "managed")
    b.set_cap(1 << 30)
    asked: list[int] = []

    def no_room(size: int) -> Any:
        asked.append(size)
        raise cupy.cuda.memory.OutOfMemoryError(size, 0, 0)

    monkeypatch.setattr(cupy.cuda, "Memory", no_room)
    data = _bytes(STAGE_BYTES + 99, 3)
    buf = b.alloc(data.size)
    assert np.array_equal(_round_trip(b, buf, data), data)
    assert asked == [STAGE_BYTES]  # once in the call
    b.end_invocation()
    monkeypatch.undo()
    assert np.array_equal(_round_trip(b, buf, data), data)  # the next call gets the block
    assert b._stage is not None
