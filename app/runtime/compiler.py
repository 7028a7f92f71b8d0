"""Compile-and-validate in the api process; the result lands in the artifact cache."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from app.runtime.artifacts import ArtifactCache
from app.runtime.engine import make_engine
from app.runtime.validation import ModuleInfo, check_module, compile_module


class ModuleCompiler:
    def __init__(self, cache: ArtifactCache) -> None:
        self.engine = make_engine()
        self.cache = cache
        self._lock = threading.Lock()

    def compile(self, wasm: bytes) -> tuple[str, ModuleInfo]:
        """Validate and compile; raises InvalidModule with a message for the tenant."""
        sha = hashlib.sha256(wasm).hexdigest()
        module = compile_module(self.engine, wasm)
        info = check_module(module)
        with self._lock:
            self.cache.store(sha, module)
        return sha, info

    def ensure_artifact(self, sha: str, wasm: bytes) -> Path:
        """Artifact path for a stored module, recompiling if this node has not got it yet."""
        if not self.cache.has(sha):
            module = compile_module(self.engine, wasm)
            with self._lock:
                self.cache.store(sha, module)
        return self.cache.path_for(sha)
