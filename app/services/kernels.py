from __future__ import annotations

import hashlib
from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncSession

from app.contract.messages import Principal
from app.db.models import Kernel, utcnow
from app.db.repositories.kernels import KernelRepository
from app.db.repositories.tenants import TenantRepository
from app.errors import Conflict, Invalid, NotFound, Unavailable
from app.runtime.compiler import CompilerUnavailable, KernelCompileFailed, ModuleCompiler

MAX_KERNELS = 100


class KernelService:
    def __init__(self, session: AsyncSession, tenant: Principal) -> None:
        self.session = session
        self.tenant = tenant
        self.repo = KernelRepository(session, tenant.id)

    async def list(self) -> Sequence[Kernel]:
        return await self.repo.list()

    async def get(self, name: str) -> Kernel:
        kernel = await self.repo.get(name)
        if kernel is None:
            raise NotFound.of(f"kernel module {name!r}")
        return kernel

    async def put(self, name: str, raw: bytes, arch: str | None, compiler: ModuleCompiler) -> tuple[Kernel, bool]:
        if name == "std":
            raise Conflict("`std` is the platform's kernel library; choose another name")
        try:
            source = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Invalid("kernel source must be UTF-8 text", code="invalid_kernel") from None
        if not source.strip():
            raise Invalid("kernel source is empty", code="invalid_kernel")
        try:
            await compiler.check_kernel(self.tenant.id, source, arch)
        except KernelCompileFailed as exc:
            raise Invalid(str(exc), code="compile_failed") from None
        except CompilerUnavailable as exc:
            raise Unavailable(f"{exc}; retry later", retry_after=5) from None
        sha = hashlib.sha256(raw).hexdigest()
        # the count and the name are read under the tenant's lock, taken after the compile: two
        # uploads of one name at once are a create and an update, never a 500 of the unique key
        if await TenantRepository(self.session).lock(self.tenant.id) is None:
            raise NotFound.of("tenant")
        kernel = await self.repo.get(name)
        if kernel is None:
            if await self.repo.count() >= MAX_KERNELS:
                raise Conflict(f"a tenant may register at most {MAX_KERNELS} kernel modules; delete one first", code="quota_exceeded")
            return await self.repo.add(Kernel(name=name, source=source, sha256=sha)), True
        kernel.source, kernel.sha256, kernel.updated_at = source, sha, utcnow()
        await self.session.flush()
        return kernel, False

    async def delete(self, name: str) -> None:
        await self.repo.delete(await self.get(name))
