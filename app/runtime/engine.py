"""The one wasmtime configuration shared by the api process (compile) and workers (run).

Compiled artifacts are only valid for the same wasmtime version and Config, so both sides
build their Engine here and the artifact cache key includes `config_fingerprint()`.
"""

from __future__ import annotations

import hashlib
from importlib.metadata import version

import wasmtime

# Bumped whenever make_config() changes in a way that alters generated code.
_CONFIG_REVISION = "1"


def make_config() -> wasmtime.Config:
    cfg = wasmtime.Config()
    cfg.epoch_interruption = True
    cfg.cranelift_opt_level = "speed"
    cfg.parallel_compilation = True
    return cfg


def make_engine() -> wasmtime.Engine:
    return wasmtime.Engine(make_config())


def wasmtime_version() -> str:
    return version("wasmtime")


def config_fingerprint() -> str:
    raw = f"wasmtime={wasmtime_version()};rev={_CONFIG_REVISION};epoch=1;opt=speed"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]
