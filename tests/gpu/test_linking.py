"""Raw host functions receive the guest's values slot by slot, return theirs, and never trap."""

from __future__ import annotations

from typing import Any

import wasmtime

from app.gpu.linking import define_unchecked, raw_callback
from app.gpu.signatures import Code

_GUEST = """
(module
  (import "host" "mix" (func $mix (param i32 i64 i32) (result i64)))
  (import "host" "none" (func $none (result i32)))
  (memory (export "memory") 1)
  (func (export "mix") (param i32 i64 i32) (result i64) (call $mix (local.get 0) (local.get 1) (local.get 2)))
  (func (export "none") (result i32) (call $none)))
"""
_SIGNATURES = {"mix": (("i32", "i64", "i32"), ("i64",)), "none": ((), ("i32",))}


def _instance(impls: dict[str, Any]) -> tuple[wasmtime.Store, wasmtime.Instance, list[Any]]:
    engine = wasmtime.Engine()
    store = wasmtime.Store(engine)
    linker = wasmtime.Linker(engine)
    keepalive: list[Any] = []
    callbacks = {name: raw_callback(impls[name], params, results[0]) for name, (params, results) in _SIGNATURES.items()}
    define_unchecked(linker, "host", _SIGNATURES, callbacks, keepalive)
    return store, linker.instantiate(store, wasmtime.Module(engine, _GUEST)), keepalive


def test_values_pass_through_raw_slots() -> None:
    seen: list[tuple[Any, ...]] = []

    def mix(caller: int, a: int, b: int, c: int) -> int:
        seen.append((a, b, c))
        return a * b + c

    store, inst, _keep = _instance({"mix": mix, "none": lambda caller: 7})
    exports = inst.exports(store)
    assert exports["mix"](store, -3, 1 << 40, 5) == -3 * (1 << 40) + 5
    assert seen == [(-3, 1 << 40, 5)]
    assert exports["none"](store) == 7


def test_a_raising_host_function_returns_internal() -> None:
    def broken(caller: int) -> int:
        raise RuntimeError("host bug")

    store, inst, _keep = _instance({"mix": lambda caller, a, b, c: 0, "none": broken})
    assert inst.exports(store)["none"](store) == Code.INTERNAL
