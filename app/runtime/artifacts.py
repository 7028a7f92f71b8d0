"""On-disk cache of compiled modules, keyed by module sha256 and engine fingerprint.

Only this platform writes the cache directory (mode 0700, inside the data dir), so only
artifacts it produced are ever deserialized: the compile sandbox writes into a file the api
process created here, which is adopted only after the compile process answered cleanly.

Beside an artifact, `<sha256>.nostart` records that its module has no start function, so that
instantiating it runs no guest code and a worker may build its instances ahead of a call
(app/runtime/runner.py). It is written before the artifact is put in place: a worker that sees
an artifact without it (one cached before it existed) only builds no instance ahead.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import wasmtime

from app.runtime.engine import config_fingerprint

log = logging.getLogger(__name__)


class ArtifactUnavailable(Exception):
    """A compiled module could not be loaded; the message says why, without a host path."""


class ArtifactCache:
    def __init__(self, root: Path) -> None:
        self.base = root  # the node's cache dir, which holds functions' files too (app/runtime/bundles.py)
        self.root = root / "modules" / config_fingerprint()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path_for(self, sha256: str) -> Path:
        return self.root / f"{sha256}.cwasm"

    def has(self, sha256: str) -> bool:
        return self.path_for(sha256).exists()

    def has_no_start_function(self, sha256: str) -> bool:
        return (self.root / f"{sha256}.nostart").exists()

    def _record_start(self, sha256: str, start_function: bool) -> None:
        if not start_function:
            (self.root / f"{sha256}.nostart").touch(mode=0o600)

    def store(self, sha256: str, module: wasmtime.Module, *, start_function: bool) -> Path:
        path = self.path_for(sha256)
        if path.exists():
            return path
        self._record_start(sha256, start_function)
        data = module.serialize()
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a reader sees the whole artifact or none
        return path

    def adopt(self, sha256: str, compiled: Path, *, start_function: bool) -> Path:
        """Move a file the compile sandbox wrote (in `root`) into place, atomically."""
        path = self.path_for(sha256)
        if not path.exists():
            self._record_start(sha256, start_function)
            os.replace(compiled, path)
        return path

    def remove(self, sha256: str) -> None:
        """Delete an artifact no kept version uses any more (a worker that loaded it keeps its copy)."""
        self.path_for(sha256).unlink(missing_ok=True)
        (self.root / f"{sha256}.nostart").unlink(missing_ok=True)

    def load(self, engine: wasmtime.Engine, sha256: str) -> wasmtime.Module:
        """Raises ArtifactUnavailable, whose message names no host path (tenants read it)."""
        path = self.path_for(sha256)
        try:
            return wasmtime.Module.deserialize_file(engine, str(path))
        except (wasmtime.WasmtimeError, OSError) as exc:
            # wasmtime's message names the file: the data dir's place is the operator's to know
            log.warning("compiled module %s could not be loaded: %s", sha256, exc)
            why = "it is missing" if not path.exists() else "it is unreadable or damaged"
            raise ArtifactUnavailable(why) from None
