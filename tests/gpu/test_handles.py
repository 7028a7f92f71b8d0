"""Handles are private to the instance that made them and name one kind of object."""

from __future__ import annotations

import pytest

from app.gpu.handles import AbiFailure, Buffer, Instance, ModuleRef, get_handle
from app.gpu.signatures import Code


def test_handles_are_positive_consecutive_and_typed() -> None:
    inst = Instance({})
    buf, mod = Buffer(mem=None, size=8), ModuleRef(std=True, name="std")
    hb, hm = inst.add(buf), inst.add(mod)
    assert 0 < hb < 1 << 31 and hm == hb + 1
    assert get_handle(inst, "buffer_size", hb, Buffer, "buffer") is buf
    with pytest.raises(AbiFailure) as exc:
        get_handle(inst, "buffer_size", hm, Buffer, "buffer")
    assert exc.value.code == Code.INVALID_HANDLE
    assert exc.value.message == f"buffer_size: {hm} is not a live buffer handle of this instance"


def test_instances_start_at_different_bases() -> None:
    # a handle remembered from an earlier instance almost surely names nothing in a later one
    bases = {Instance({}).next_handle for _ in range(64)}
    assert len(bases) > 60 and all(b % 16 == 0 and 0 < b < 1 << 31 for b in bases)


def test_objects_compare_by_identity() -> None:
    # the launch cache keys on these objects: two equal-looking buffers are different buffers
    assert Buffer(mem=None, size=8) != Buffer(mem=None, size=8)


def test_an_instance_tells_whether_it_made_any_handle_even_one_freed() -> None:
    inst = Instance({})
    assert not inst.made_handles()
    h = inst.add(Buffer(mem=None, size=8))
    del inst.handles[h]  # freed by the guest: its copies may still be on the stream
    assert inst.made_handles()
