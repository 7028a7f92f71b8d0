"""A launch's argument records, shape and `std` arguments are checked in the order, and with the
codes and messages, that guests read back through `last_error`."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from app.gpu.backend import DeviceLimits
from app.gpu.handles import AbiFailure, Buffer, Instance, ModuleRef
from app.gpu.launch_args import buffer_handles, check_dims, check_std, parse_args, typed
from app.gpu.signatures import MAX_ARG_RECORDS, Code, Tag
from app.kernels.std_numpy import STD


def _buf(handle: int, offset: int = 0) -> bytes:
    return bytes([Tag.BUFFER]) + struct.pack("<iq", handle, offset)


def _i32(v: int) -> bytes:
    return bytes([Tag.I32]) + struct.pack("<i", v)


def _fails(code: Code, message: str, fn: Any, *args: Any) -> None:
    with pytest.raises(AbiFailure) as exc:
        fn(*args)
    assert exc.value.code == code and exc.value.message == message


@pytest.fixture
def inst() -> Instance:
    return Instance({})


def test_records_of_every_tag(inst: Instance) -> None:
    buf = Buffer(mem=None, size=64)
    h = inst.add(buf)
    raw = (
        _i32(-7) + bytes([Tag.I64]) + struct.pack("<q", 1 << 40) + bytes([Tag.F32]) + struct.pack("<f", 0.5)
        + bytes([Tag.F64]) + struct.pack("<d", -2.25) + _buf(h, 64)
    )
    assert parse_args(inst, raw) == [(Tag.I32, -7), (Tag.I64, 1 << 40), (Tag.F32, 0.5), (Tag.F64, -2.25), (Tag.BUFFER, (buf, 64))]
    assert buffer_handles(raw) == [h]
    assert parse_args(inst, b"") == [] and buffer_handles(b"") == []


def test_record_failures(inst: Instance) -> None:
    h = inst.add(Buffer(mem=None, size=16))
    m = inst.add(ModuleRef(std=True, name="std"))
    bad = Code.INVALID_ARGUMENT
    _fails(bad, "launch: record 1 (buffer) is truncated", parse_args, inst, _i32(1) + _buf(h)[:12])
    _fails(bad, "launch: record 0 is truncated", parse_args, inst, _i32(1)[:4])
    _fails(bad, "launch: record 1 has unknown tag 0x11", parse_args, inst, _i32(1) + b"\x11")
    _fails(bad, "launch: record 0: offset 17 is outside the buffer (16 bytes)", parse_args, inst, _buf(h, 17))
    _fails(bad, "launch: record 0: offset -1 is outside the buffer (16 bytes)", parse_args, inst, _buf(h, -1))
    _fails(Code.INVALID_HANDLE, f"launch: {m} is not a live buffer handle of this instance", parse_args, inst, _buf(m))
    # records are checked one by one: the first bad record is the one reported
    _fails(Code.INVALID_HANDLE, f"launch: {h + 99} is not a live buffer handle of this instance", parse_args, inst, _buf(h + 99) + b"\x11")
    _fails(bad, f"launch: more than {MAX_ARG_RECORDS} argument records", parse_args, inst, _i32(0) * (MAX_ARG_RECORDS + 1))
    assert len(parse_args(inst, _i32(0) * MAX_ARG_RECORDS)) == MAX_ARG_RECORDS


def test_dims() -> None:
    lim = DeviceLimits()
    check_dims(lim, lim.max_grid, (1024, 1, 1), lim.max_shared_bytes)
    bad = Code.INVALID_ARGUMENT
    # a zero dimension is reported before a dimension over the limit
    _fails(bad, "launch: grid (0, 1, 1) and block (2048, 1, 1) must all be >= 1", check_dims, lim, (0, 1, 1), (2048, 1, 1), 0)
    _fails(bad, f"launch: grid (1, 65536, 1) exceeds the device maximum {lim.max_grid}", check_dims, lim, (1, 65536, 1), (1, 1, 1), -1)
    _fails(
        bad, f"launch: block (32, 32, 2) exceeds the device maximum {lim.max_block} / 1024 threads",
        check_dims, lim, (1, 1, 1), (32, 32, 2), -1,
    )
    _fails(bad, "launch: shared_bytes must be 0..49152, got -1", check_dims, lim, (1, 1, 1), (1, 1, 1), -1)
    _fails(bad, "launch: shared_bytes must be 0..49152, got 49153", check_dims, lim, (1, 1, 1), (1, 1, 1), 49153)


def test_std_arguments() -> None:
    spec = STD["scale_f32"]
    buf = Buffer(mem=None, size=16)
    f32 = (Tag.F32, 2.0)
    assert check_std("scale_f32", spec, [(Tag.BUFFER, (buf, 0)), f32, (Tag.I32, 4)]) == [(buf, 0), 2.0, 4]
    bad = Code.INVALID_ARGUMENT
    wrong = [(Tag.BUFFER, (buf, 0)), (Tag.I32, 2), (Tag.I32, 4)]
    _fails(bad, "launch: std.scale_f32 takes (buf, f32, i32), got (buffer, i32, i32)", check_std, "scale_f32", spec, wrong)
    _fails(bad, "launch: std.scale_f32 takes (buf, f32, i32), got (buffer, f32)", check_std, "scale_f32", spec, [(Tag.BUFFER, (buf, 0)), f32])
    _fails(bad, "launch: std.scale_f32 argument 2 must be >= 0, got -1", check_std, "scale_f32", spec, [(Tag.BUFFER, (buf, 0)), f32, (Tag.I32, -1)])
    _fails(
        bad, "launch: std.scale_f32 argument 0 needs 16 bytes from offset 4, the buffer has 16",
        check_std, "scale_f32", spec, [(Tag.BUFFER, (buf, 4)), f32, (Tag.I32, 4)],
    )


def test_typed_scalars() -> None:
    for tag, kind in ((Tag.I32, np.int32), (Tag.I64, np.int64), (Tag.F32, np.float32), (Tag.F64, np.float64)):
        v = typed(tag, 3)
        assert type(v) is kind and v == 3
