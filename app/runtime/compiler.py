"""What services call to compile tenant code: Wasm modules (deploy, and again after a cache
loss) and CUDA sources (kernel upload). Every compile runs in the sandbox (`app.sandbox`), never
in this process; a module's compiled artifact is written by the compile process into a file
this process created in the artifact cache, and adopted here only after a clean answer, so
workers only ever deserialize artifacts the platform produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from app.runtime.artifacts import ArtifactCache
from app.runtime.redact import without_host_paths
from app.runtime.validation import InvalidModule, ModuleInfo
from app.sandbox.errors import CompileOutcome, LimitExceeded, SandboxCrashed, SandboxUnavailable
from app.sandbox.pool import JobKind, Sandbox


class ModuleTooComplex(ValueError):
    """Compiling the module went past a limit of the node; the message names it."""


class KernelCompileFailed(ValueError):
    """The CUDA source does not compile, or compiling it went past a limit; the message says."""


class CompilerUnavailable(RuntimeError):
    """The node could not compile anything just now (a fault of the node, not of the code)."""


class ModuleCompiler:
    def __init__(self, cache: ArtifactCache, sandbox: Sandbox) -> None:
        self.cache = cache
        self.sandbox = sandbox
        # one compile per module at a time: concurrent callers (a call and the cache refresh
        # after a cache loss, two deploys of the same bytes) share its result
        self._inflight: dict[str, asyncio.Task[ModuleInfo]] = {}

    async def compile(self, tenant_id: str, wasm: bytes) -> tuple[str, ModuleInfo]:
        """Validate and compile; raises InvalidModule or ModuleTooComplex, for the tenant."""
        sha = hashlib.sha256(wasm).hexdigest()
        return sha, await self._compile(tenant_id, sha, wasm)

    async def ensure_artifact(self, tenant_id: str, sha: str, wasm: bytes) -> Path:
        """Artifact path for a stored module, recompiling if this node has not got it (now)."""
        if not self.cache.has(sha):
            await self._compile(tenant_id, sha, wasm)
        return self.cache.path_for(sha)

    async def check_kernel(self, tenant_id: str, source: str, arch: str | None) -> None:
        """Compile-check a CUDA source with NVRTC; raises KernelCompileFailed, for the tenant.

        Passes when this node has no CUDA compiler (a worker's module_load reports errors then).
        """
        try:
            result = await self.sandbox.run(tenant_id, JobKind.CUDA, source.encode(), arch=arch)
        except LimitExceeded as exc:
            raise KernelCompileFailed(exc.describe("the CUDA source")) from None
        except SandboxCrashed as exc:
            raise KernelCompileFailed(f"the CUDA compiler failed on this source: {exc}") from None
        except SandboxUnavailable as exc:
            raise CompilerUnavailable(str(exc)) from None
        if result.outcome is CompileOutcome.INVALID:
            raise KernelCompileFailed(f"the CUDA source does not compile:\n{result.data['message']}")

    async def _compile(self, tenant_id: str, sha: str, wasm: bytes) -> ModuleInfo:
        task = self._inflight.get(sha)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._compile_once(tenant_id, sha, wasm))
            self._inflight[sha] = task
            task.add_done_callback(lambda _: self._inflight.pop(sha, None))
        # shielded: a caller that goes away (a closed connection) does not cancel the others'
        return await asyncio.shield(task)

    async def _compile_once(self, tenant_id: str, sha: str, wasm: bytes) -> ModuleInfo:
        fd, tmp = tempfile.mkstemp(dir=self.cache.root, suffix=".tmp")  # 0600
        os.close(fd)
        try:
            try:
                result = await self.sandbox.run(tenant_id, JobKind.WASM, wasm, artifact=tmp)
            except LimitExceeded as exc:
                raise ModuleTooComplex(exc.describe("the module")) from None
            except SandboxCrashed as exc:
                raise ModuleTooComplex(f"the compiler failed on this module: {exc}") from None
            except SandboxUnavailable as exc:
                raise CompilerUnavailable(str(exc)) from None
            if result.outcome is CompileOutcome.INVALID:
                raise InvalidModule(without_host_paths(result.data["message"]))
            info = ModuleInfo(
                imports=list(result.data["imports"]),
                uses_gpu=bool(result.data["uses_gpu"]),
                start_function=bool(result.data["start_function"]),
            )
            self.cache.adopt(sha, Path(tmp), start_function=info.start_function)
            return info
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
