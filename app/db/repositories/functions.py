from __future__ import annotations

import builtins
from collections.abc import Iterable, Sequence

from sqlalchemy import Select, and_, delete, func, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from app.db.models import Function, FunctionFiles, FunctionVersion


def _active() -> Select[Function, FunctionVersion]:
    """Functions with their active version's settings (not its module bytes)."""
    return (
        select(Function, FunctionVersion)
        .join(FunctionVersion, and_(FunctionVersion.function_id == Function.id, FunctionVersion.version == Function.current_version))
        .options(defer(FunctionVersion.module, raiseload=True))
    )


class FunctionRepository:
    """Functions and their versions, always scoped to one tenant."""

    def __init__(self, session: AsyncSession, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    def _functions(self) -> Select[Function]:
        return select(Function).where(Function.tenant_id == self.tenant_id)

    async def list(self) -> Sequence[Function]:
        return (await self.session.scalars(self._functions().order_by(Function.name))).all()

    async def get(self, name: str) -> Function | None:
        return await self.session.scalar(self._functions().where(Function.name == name))

    async def active(self, name: str) -> tuple[Function, FunctionVersion] | None:
        """The function and its active version's settings (not its module bytes) in one read: a
        call's lookup on a cache miss (a refresh reads them all at once: `active_functions`)."""
        q = _active().where(Function.tenant_id == self.tenant_id, Function.name == name)
        row = (await self.session.execute(q)).first()
        return (row[0], row[1]) if row is not None else None

    async def count(self) -> int:
        q = select(func.count()).select_from(Function).where(Function.tenant_id == self.tenant_id)
        return int(await self.session.scalar(q) or 0)

    async def add(self, fn: Function) -> Function:
        fn.tenant_id = self.tenant_id
        self.session.add(fn)
        await self.session.flush()
        return fn

    async def add_version(self, version: FunctionVersion) -> FunctionVersion:
        self.session.add(version)
        await self.session.flush()
        return version

    async def version(self, fn: Function, number: int) -> FunctionVersion | None:
        q = select(FunctionVersion).where(
            FunctionVersion.function_id == fn.id, FunctionVersion.version == number
        )
        return await self.session.scalar(q)

    async def version_meta(self, fn: Function, number: int) -> tuple[str, int] | None:
        """(sha256, size) of a version without loading the module bytes."""
        q = select(FunctionVersion.sha256, FunctionVersion.size).where(
            FunctionVersion.function_id == fn.id, FunctionVersion.version == number
        )
        row = (await self.session.execute(q)).first()
        return (row[0], row[1]) if row else None

    async def versions(self, fn: Function) -> Sequence[tuple[int, str, int, object]]:
        q = (
            select(FunctionVersion.version, FunctionVersion.sha256, FunctionVersion.size, FunctionVersion.created_at)
            .where(FunctionVersion.function_id == fn.id)
            .order_by(FunctionVersion.version)
        )
        return [tuple(r) for r in (await self.session.execute(q)).all()]  # type: ignore[misc]

    async def version_settings(self, fn: Function, number: int) -> FunctionVersion | None:
        """A version with its settings, without loading the module bytes."""
        q = select(FunctionVersion).options(defer(FunctionVersion.module, raiseload=True)).where(
            FunctionVersion.function_id == fn.id, FunctionVersion.version == number
        )
        return await self.session.scalar(q)

    async def versions_settings(self, fn: Function) -> Sequence[FunctionVersion]:
        """Every kept version, oldest first, without their module bytes."""
        q = (
            select(FunctionVersion).options(defer(FunctionVersion.module, raiseload=True))
            .where(FunctionVersion.function_id == fn.id).order_by(FunctionVersion.version)
        )
        return (await self.session.scalars(q)).all()

    async def newest_version(self, fn: Function) -> int:
        q = select(func.max(FunctionVersion.version)).where(FunctionVersion.function_id == fn.id)
        return int(await self.session.scalar(q) or 0)

    async def module_bytes(self, fn: Function, number: int) -> bytes | None:
        q = select(FunctionVersion.module).where(
            FunctionVersion.function_id == fn.id, FunctionVersion.version == number
        )
        return await self.session.scalar(q)

    # -- files --------------------------------------------------------------------------------
    async def files(self, fn: Function) -> FunctionFiles | None:
        """The function's files row, without loading the archive."""
        q = select(FunctionFiles).options(defer(FunctionFiles.archive, raiseload=True)).where(FunctionFiles.function_id == fn.id)
        return await self.session.scalar(q)

    async def files_archive(self, fn: Function) -> bytes | None:
        return await self.session.scalar(select(FunctionFiles.archive).where(FunctionFiles.function_id == fn.id))

    async def set_files(self, fn: Function, files: FunctionFiles | None) -> None:
        """Replace the function's files (None: it has none)."""
        await self.session.execute(delete(FunctionFiles).where(FunctionFiles.function_id == fn.id))
        if files is not None:
            files.function_id = fn.id
            self.session.add(files)
        fn.files_sha256 = files.sha256 if files is not None else None
        await self.session.flush()

    async def delete(self, fn: Function) -> None:
        await self.session.delete(fn)
        await self.session.flush()

    async def prune_versions(self, fn: Function, keep: int) -> builtins.set[str]:
        """Delete the versions of `fn` older than its newest `keep`, except the active one (after
        a rollback, not the newest), which is always kept; returns the sha256 of the modules
        deleted (that a kept version may still use: see referenced_modules)."""
        newest = await self.newest_version(fn)
        old = (
            FunctionVersion.function_id == fn.id,
            FunctionVersion.version <= newest - keep,
            FunctionVersion.version != fn.current_version,
        )
        shas = set((await self.session.scalars(select(FunctionVersion.sha256).where(*old))).all())
        if shas:
            await self.session.execute(delete(FunctionVersion).where(*old))
        return shas

    async def module_shas(self, fn: Function | None = None) -> builtins.set[str]:
        """The modules of every version of `fn`, or of all the tenant's functions (before a delete)."""
        q = select(FunctionVersion.sha256).join(Function, Function.id == FunctionVersion.function_id).where(
            Function.tenant_id == self.tenant_id
        )
        if fn is not None:
            q = q.where(Function.id == fn.id)
        return set((await self.session.scalars(q)).all())


async def referenced_bundles(session: AsyncSession, shas: Iterable[str]) -> set[str]:
    """Which of these file archives a function of any tenant still uses (the unpacked copies on
    a node are shared by every tenant)."""
    wanted = [s for s in shas if s]
    if not wanted:
        return set()
    q = select(Function.files_sha256).where(Function.files_sha256.in_(wanted)).distinct()
    return {s for s in (await session.scalars(q)).all() if s}


async def referenced_modules(session: AsyncSession, shas: Iterable[str]) -> set[str]:
    """Which of these modules a kept version of any function of any tenant still uses: node-wide,
    for the compiled cache, which is shared by every tenant (no bytes leave it)."""
    wanted = list(shas)
    if not wanted:
        return set()
    q = select(FunctionVersion.sha256).where(FunctionVersion.sha256.in_(wanted)).distinct()
    return set((await session.scalars(q)).all())


async def active_functions(
    session: AsyncSession, keys: Sequence[tuple[str, str]], chunk: int = 500
) -> dict[tuple[str, str], tuple[Function, FunctionVersion]]:
    """The active version of each (tenant id, name), as `FunctionRepository.active` reads one, in
    one query per `chunk` keys: a front's cache refresh, whose one read per function had taken
    longer than the entries live once a loaded front held a few dozen of them. Each key is its
    own tenant's: a key's pair of columns scopes it. Keys with no function are absent."""
    found: dict[tuple[str, str], tuple[Function, FunctionVersion]] = {}
    for i in range(0, len(keys), chunk):
        q = _active().where(tuple_(Function.tenant_id, Function.name).in_(list(keys[i : i + chunk])))
        for fn, ver in (await session.execute(q)).all():
            found[(fn.tenant_id, fn.name)] = (fn, ver)
    return found
