"""The one wasmtime configuration shared by the api process (compile) and workers (run).

Compiled artifacts are only valid for the same wasmtime version and Config, so both sides
build their Engine here and the artifact cache key includes `config_fingerprint()`.
"""

from __future__ import annotations

import hashlib
from importlib.metadata import version

import wasmtime

from app.runtime.memory import GuestMemory

# Bumped whenever make_config() changes in a way that alters generated code.
_CONFIG_REVISION = "2"


def make_config() -> wasmtime.Config:
    cfg = wasmtime.Config()
    cfg.epoch_interruption = True
    cfg.cranelift_opt_level = "speed"
    cfg.parallel_compilation = True
    # workers provide linear memory themselves (app/runtime/memory.py), which rules out
    # copy-on-write data-segment images; artifacts record this, so both sides agree
    cfg.memory_init_cow = False
    return cfg


def make_engine(memory: GuestMemory | None = None) -> wasmtime.Engine:
    """`memory`: the worker's reusable guest memories (app/runtime/memory.py); it changes where
    linear memory lives, not the generated code, so artifacts stay compatible."""
    cfg = make_config()
    if memory is not None:
        memory.install(cfg)
    return wasmtime.Engine(cfg)


def wasmtime_version() -> str:
    return version("wasmtime")


def config_fingerprint() -> str:
    raw = f"wasmtime={wasmtime_version()};rev={_CONFIG_REVISION};epoch=1;opt=speed;cow=0"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]
