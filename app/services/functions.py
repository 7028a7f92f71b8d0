"""Function deploy: size-limited upload, validation, compile, versions."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Function, FunctionVersion, utcnow
from app.db.repositories.functions import FunctionRepository
from app.errors import Forbidden, Invalid, NotFound, Unavailable
from app.runtime.compiler import CompilerUnavailable, ModuleCompiler, ModuleTooComplex
from app.runtime.validation import InvalidModule
from app.services.principal import TenantPrincipal


@contextmanager
def compile_errors() -> Iterator[None]:
    """A module compile's refusals as the API states them (deploy and recompile alike)."""
    try:
        yield
    except InvalidModule as exc:
        raise Invalid(str(exc), code="invalid_module") from None
    except ModuleTooComplex as exc:
        raise Invalid(f"{exc}; simplify the module (fewer locals or smaller functions)", code="module_too_complex") from None
    except CompilerUnavailable as exc:
        raise Unavailable(f"{exc}; retry later", retry_after=5) from None


@dataclass(frozen=True)
class FunctionSettings:
    env: dict[str, str] | None = None
    content_type: str | None = None
    timeout_ms: int | None = None


@dataclass
class DeployResult:
    function: Function
    sha256: str
    size: int
    created: bool
    changed: bool


class FunctionService:
    def __init__(self, session: AsyncSession, tenant: TenantPrincipal) -> None:
        self.session = session
        self.tenant = tenant
        self.repo = FunctionRepository(session, tenant.id)

    async def get(self, name: str) -> Function:
        fn = await self.repo.get(name)
        if fn is None:
            raise NotFound.of(f"function {name!r}")
        return fn

    def _check_settings(self, settings: FunctionSettings) -> None:
        if settings.timeout_ms is not None and not 1 <= settings.timeout_ms <= self.tenant.quota.timeout_ms:
            raise Invalid(f"timeout_ms must be between 1 and the tenant quota ({self.tenant.quota.timeout_ms} ms)")

    async def deploy(
        self, name: str, wasm: bytes, settings: FunctionSettings, compiler: ModuleCompiler
    ) -> DeployResult:
        self._check_settings(settings)
        fn = await self.repo.get(name)
        if fn is None and await self.repo.count() >= self.tenant.quota.max_functions:
            raise Forbidden(
                f"the tenant may deploy at most {self.tenant.quota.max_functions} functions; delete one first", code="quota_exceeded"
            )
        sha = hashlib.sha256(wasm).hexdigest()
        current = await self.repo.version_meta(fn, fn.current_version) if fn is not None else None
        if current is None or current[0] != sha:
            with compile_errors():
                await compiler.compile(self.tenant.id, wasm)

        created = fn is None
        if fn is None:
            fn = await self.repo.add(Function(name=name, current_version=1, env={}, content_type="application/octet-stream"))
            await self.repo.add_version(FunctionVersion(function_id=fn.id, version=1, sha256=sha, size=len(wasm), module=wasm))
            changed = True
        elif current is None or current[0] != sha:
            fn.current_version += 1
            await self.repo.add_version(
                FunctionVersion(function_id=fn.id, version=fn.current_version, sha256=sha, size=len(wasm), module=wasm)
            )
            changed = True
        else:
            changed = False
        if settings.env is not None:
            fn.env = dict(settings.env)
        if settings.content_type is not None:
            fn.content_type = settings.content_type
        if settings.timeout_ms is not None:
            fn.timeout_ms = settings.timeout_ms
        fn.updated_at = utcnow()
        await self.session.flush()
        return DeployResult(function=fn, sha256=sha, size=len(wasm), created=created, changed=changed)

    async def delete(self, name: str) -> None:
        await self.repo.delete(await self.get(name))
