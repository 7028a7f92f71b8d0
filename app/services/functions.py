"""Function deploy: size-limited upload, validation, compile, versions."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from app.contract.messages import Principal
from app.db.models import Function, FunctionFiles, FunctionVersion, Tenant, utcnow
from app.db.repositories.functions import FunctionRepository, referenced_bundles, referenced_modules
from app.db.repositories.tenants import TenantRepository
from app.errors import Conflict, Invalid, LimitReached, NotFound, Unavailable
from app.runtime.artifacts import ArtifactCache
from app.runtime.bundles import ENTRY_BYTES, BundleStore, InvalidArchive, check_archive
from app.runtime.compiler import CompilerUnavailable, ModuleCompiler, ModuleTooComplex
from app.runtime.validation import InvalidModule
from app.services.secrets import check_exist


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
    """What a deploy changes besides the module; None: left as it is."""

    env: dict[str, str] | None = None
    args: list[str] | None = None
    cgi: bool | None = None
    scratch: bool | None = None
    content_type: str | None = None
    timeout_ms: int | None = None
    max_attempts: int | None = None  # runs of an async invocation whose node is lost mid-run
    secrets: list[str] | None = None  # names of the tenant's secrets the guest gets as variables


@dataclass(frozen=True)
class VersionSettings:
    """What a version holds besides its module; a change of any makes a new version. The
    function's own columns of the same names are its active version's."""

    env: dict[str, Any]
    args: list[str]
    cgi: bool
    scratch: bool
    content_type: str
    timeout_ms: int | None
    secrets: list[str]

    @classmethod
    def of(cls, row: Function | FunctionVersion) -> VersionSettings:
        return cls(
            env=dict(row.env or {}), args=list(row.args or []), cgi=bool(row.cgi), scratch=bool(row.scratch),
            content_type=row.content_type, timeout_ms=row.timeout_ms, secrets=list(row.secrets or []),
        )

    def with_changes(self, settings: FunctionSettings) -> VersionSettings:
        given = {f.name: getattr(settings, f.name) for f in fields(self) if getattr(settings, f.name) is not None}
        return replace(self, **given)

    def apply(self, row: Function | FunctionVersion) -> None:
        for f in fields(self):
            setattr(row, f.name, getattr(self, f.name))


NEW_FUNCTION = VersionSettings(env={}, args=[], cgi=False, scratch=False, content_type="application/octet-stream",
                               timeout_ms=None, secrets=[])


@dataclass
class DeployResult:
    function: Function
    sha256: str
    size: int
    created: bool
    changed: bool
    pruned: set[str]  # sha256 of the versions this deploy deleted (not this one's)


class FunctionService:
    def __init__(self, session: AsyncSession, tenant: Principal) -> None:
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

    def _too_many(self, max_functions: int) -> Conflict:
        return Conflict(f"the tenant may deploy at most {max_functions} functions; delete one first", code="quota_exceeded")

    async def deploy(
        self, name: str, wasm: bytes, settings: FunctionSettings, compiler: ModuleCompiler, kept_versions: int
    ) -> DeployResult:
        """Compile, then write under the tenant's lock (TenantRepository.lock), where the function
        count, the name and the storage quota are checked again: concurrent deploys of a tenant
        take turns there, on every node, and the compile (slow) holds no lock."""
        self._check_settings(settings)
        sha = hashlib.sha256(wasm).hexdigest()
        # a first look, without the lock: refuse early what will be refused, and skip the
        # compile of bytes that are already the active version
        fn = await self.repo.get(name)
        if fn is None and await self.repo.count() >= self.tenant.quota.max_functions:
            raise self._too_many(self.tenant.quota.max_functions)
        current = await self.repo.version_meta(fn, fn.current_version) if fn is not None else None
        compiled = current is not None and current[0] == sha
        await self.session.commit()  # ends the read: nothing is held across the compile
        for _ in range(2):
            if not compiled:
                with compile_errors():
                    await compiler.compile(self.tenant.id, wasm)
                compiled = True
            written = await self._write(name, wasm, sha, settings, kept_versions, compiled)
            if written is not None:
                return written
            # the active version changed since the first look and these bytes were not compiled
            await self.session.rollback()
        raise AssertionError("unreachable: the second round always compiled first")  # pragma: no cover

    async def _write(
        self, name: str, wasm: bytes, sha: str, settings: FunctionSettings, kept_versions: int, compiled: bool
    ) -> DeployResult | None:
        """The deploy's write, under the tenant's lock; None if it needs a compile first."""
        self.session.expire_all()  # read everything again under the lock
        tenant = await TenantRepository(self.session).lock(self.tenant.id)
        if tenant is None:
            raise NotFound.of("tenant")
        fn = await self.repo.get(name)
        if not compiled:
            current = await self.repo.version_meta(fn, fn.current_version) if fn is not None else None
            if current is None or current[0] != sha:
                return None
        pruned: set[str] = set()
        created = fn is None
        wanted = (NEW_FUNCTION if fn is None else VersionSettings.of(fn)).with_changes(settings)
        _check_secret_names(wanted)
        await check_exist(self.session, self.tenant.id, wanted.secrets, f"function {name!r}")
        if fn is None:
            if await self.repo.count() >= tenant.max_functions:
                raise self._too_many(tenant.max_functions)
            fn = Function(name=name, current_version=1, env={}, args=[], content_type="application/octet-stream")
            try:
                fn = await self.repo.add(fn)
            except IntegrityError:  # the lock makes this a bug, never a 500 for the client
                raise Conflict(f"function {name!r} was created by another deploy at the same time; retry") from None
            changed = True
        else:
            current = await self.repo.version_meta(fn, fn.current_version)
            changed = current is None or current[0] != sha or wanted != VersionSettings.of(fn)
            if changed:  # numbered after the newest, which may not be the active one (a rollback)
                fn.current_version = await self.repo.newest_version(fn) + 1
        if changed:
            version = FunctionVersion(function_id=fn.id, version=fn.current_version, sha256=sha, size=len(wasm), module=wasm)
            wanted.apply(version)
            await self.repo.add_version(version)
            if not created:
                pruned = await self.repo.prune_versions(fn, kept_versions)
        if changed:
            stored = await TenantRepository(self.session).stored_bytes(self.tenant.id)
            if stored.total > tenant.max_stored_bytes:
                raise LimitReached(
                    f"this module ({len(wasm)} bytes) would take the tenant's stored bytes to {stored.total}, past its "
                    f"max_stored_bytes quota of {tenant.max_stored_bytes} (old versions beyond the {kept_versions} kept "
                    "were counted as deleted); delete functions, or async outputs (they expire after the retention)",
                    code="storage_quota_exceeded",
                )
        wanted.apply(fn)
        if fn.scratch:
            files = await self.repo.files(fn)
            if files is not None:
                _check_scratch(files.unpacked_bytes, files.entries, tenant)
        if settings.max_attempts is not None:
            fn.max_attempts = settings.max_attempts
        fn.updated_at = utcnow()
        await self.session.flush()
        return DeployResult(function=fn, sha256=sha, size=len(wasm), created=created, changed=changed, pruned=pruned - {sha})

    async def versions(self, name: str) -> tuple[Function, list[FunctionVersion]]:
        fn = await self.get(name)
        return fn, list(await self.repo.versions_settings(fn))

    async def rollback(self, name: str, number: int) -> tuple[Function, str]:
        """Make version `number` active (its module and settings) from the next call on; the
        module's sha256 is returned. Under the tenant's lock, as deploys."""
        tenant = await TenantRepository(self.session).lock(self.tenant.id)
        if tenant is None:
            raise NotFound.of("tenant")
        fn = await self.get(name)
        version = await self.repo.version_settings(fn, number)
        if version is None:
            raise version_not_found(name, number)
        target = VersionSettings.of(version)
        await check_exist(self.session, self.tenant.id, target.secrets, f"version {number} of function {name!r}")
        if target.timeout_ms is not None and target.timeout_ms > tenant.timeout_ms:
            raise Invalid(f"version {number} has a timeout of {target.timeout_ms} ms, past the tenant's timeout_ms quota "
                          f"({tenant.timeout_ms} ms)")
        if target.scratch:
            files = await self.repo.files(fn)
            if files is not None:
                _check_scratch(files.unpacked_bytes, files.entries, tenant)
        if fn.current_version != number:
            target.apply(fn)
            fn.current_version = number
            fn.updated_at = utcnow()
            await self.session.flush()
        return fn, version.sha256

    async def delete(self, name: str) -> tuple[set[str], str | None]:
        """Delete a function and its versions; returns their modules' sha256 (see
        drop_unused_artifacts) and its files' (drop_unused_bundles)."""
        fn = await self.get(name)
        shas = await self.repo.module_shas(fn)
        files = fn.files_sha256
        await self.repo.delete(fn)
        return shas, files

    async def put_files(self, name: str, archive: bytes, max_entries: int) -> FilesResult:
        """Give the function these files (a tar archive, checked whole first), under the tenant's
        lock: its max_files_bytes, and its max_stored_bytes with the archive counted; with
        scratch on, a copy must fit scratch_bytes. Nothing changes when one is refused."""
        try:
            info = check_archive(archive, self.tenant.quota.max_files_bytes, max_entries)
        except InvalidArchive as exc:
            raise Invalid(f"the archive cannot be the function's files: {exc}", code="invalid_archive") from None
        tenant = await TenantRepository(self.session).lock(self.tenant.id)
        if tenant is None:
            raise NotFound.of("tenant")
        fn = await self.get(name)
        if info.unpacked_bytes > tenant.max_files_bytes:
            raise Invalid(
                f"the archive's files hold {info.unpacked_bytes} bytes, past this tenant's max_files_bytes quota of "
                f"{tenant.max_files_bytes}", code="files_quota_exceeded",
            )
        if fn.scratch:
            _check_scratch(info.unpacked_bytes, info.entries, tenant)
        old = fn.files_sha256
        await self.repo.set_files(fn, FunctionFiles(
            sha256=info.sha256, size=len(archive), unpacked_bytes=info.unpacked_bytes, entries=info.entries, archive=archive,
        ))
        stored = await TenantRepository(self.session).stored_bytes(self.tenant.id)
        if stored.total > tenant.max_stored_bytes:
            raise LimitReached(
                f"this archive ({len(archive)} bytes) would take the tenant's stored bytes to {stored.total}, past its "
                f"max_stored_bytes quota of {tenant.max_stored_bytes}; delete functions or files, or async outputs",
                code="storage_quota_exceeded",
            )
        fn.updated_at = utcnow()
        await self.session.flush()
        return FilesResult(fn, info.sha256, old if old != info.sha256 else None)

    async def delete_files(self, name: str) -> FilesResult:
        fn = await self.get(name)
        old = fn.files_sha256
        if old is None:
            raise NotFound.of(f"files of function {name!r}")
        await self.repo.set_files(fn, None)
        fn.updated_at = utcnow()
        await self.session.flush()
        return FilesResult(fn, None, old)


@dataclass
class FilesResult:
    function: Function
    sha256: str | None  # of the function's files now (None: it has none)
    replaced: str | None  # of the files it had before, if others (see drop_unused_bundles)


def version_not_found(name: str, number: int) -> NotFound:
    return NotFound(
        f"function {name!r} has no version {number} (old versions are deleted past the kept count); "
        "list them with GET /v1/functions/{name}/versions", code="version_not_found",
    )


def _check_secret_names(wanted: VersionSettings) -> None:
    clash = sorted(set(wanted.secrets) & set(wanted.env))
    if clash:
        raise Invalid(f"{', '.join(clash)}: both an env variable and a secret; give each variable one source")


def _check_scratch(unpacked_bytes: int, entries: int, tenant: Tenant) -> None:
    """A scratch copy of these files must fit the tenant's scratch_bytes, with room to spare."""
    need = unpacked_bytes + ENTRY_BYTES * entries
    if need > tenant.scratch_bytes:
        raise Invalid(
            f"a scratch copy of the function's files takes {need} bytes ({ENTRY_BYTES} per entry besides the contents), "
            f"past this tenant's scratch_bytes quota of {tenant.scratch_bytes}; ship fewer files or turn scratch off",
            code="scratch_quota_exceeded",
        )


async def drop_unused_bundles(session: AsyncSession, store: BundleStore, shas: set[str]) -> int:
    """After the commit that replaced or deleted files: remove this node's unpacked copies that
    no function uses any more (other nodes drop theirs when they restart, see the docs)."""
    unused = {s for s in shas if s} - await referenced_bundles(session, shas)
    for sha in unused:
        store.remove(sha)
    return len(unused)


async def drop_unused_artifacts(session: AsyncSession, cache: ArtifactCache, shas: set[str]) -> int:
    """After the commit that deleted versions: remove the compiled artifacts of these modules that
    no kept version of any tenant uses (the cache is shared by every tenant). A deploy of the same
    bytes racing this finds its artifact gone and compiles it again (FunctionCache, the worker's
    artifact error); returns how many were removed."""
    unused = shas - await referenced_modules(session, shas)
    for sha in unused:
        cache.remove(sha)
    return len(unused)
