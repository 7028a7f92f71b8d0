"""Per-front cache of function metadata and tenant kernel sets, kept fresh off the call path."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import Function, FunctionVersion
from app.db.repositories.functions import FunctionRepository, active_functions
from app.db.repositories.kernels import KernelRepository, kernel_sources
from app.errors import DomainError, NotFound
from app.runtime.bundles import BundleStore
from app.runtime.compiler import ModuleCompiler
from app.scheduler.leases import KernelSet
from app.services.functions import compile_errors, version_not_found
from app.services.sealing import NodeKey
from app.services.secrets import open_secrets
from app.services.shared_reads import SharedReads
from app.settings import Settings


class SecretEnv:
    """The secret variables of a function's calls, opened in this front. Shown, it names them
    only: a meta logged or printed never carries a value."""

    __slots__ = ("values",)

    def __init__(self, values: dict[str, str] | None = None) -> None:
        self.values: dict[str, str] = values or {}

    def __repr__(self) -> str:
        return f"SecretEnv({sorted(self.values)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretEnv) and other.values == self.values

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.values)))


@dataclass(frozen=True)
class FunctionMeta:
    name: str
    version: int
    sha256: str
    env: dict[str, str]
    content_type: str
    timeout_ms: int | None
    artifact: Path
    expires: float
    args: tuple[str, ...] = ()
    cgi: bool = False
    scratch: bool = False
    files: str = ""  # sha256 of its file bundle, unpacked on this node ("": none)
    secrets: SecretEnv = field(default_factory=SecretEnv)  # added to env for each call


class FunctionCache:
    """(tenant, function) -> what a worker needs to run it; deploys on this node invalidate.

    Entries used recently are re-read in the background before they expire (`refresh`), so only
    a tenant's first call, or its first after minutes of silence, reads the database. A local
    change (deploy, delete, kernel upload) bumps the entry's generation, and a refresh that read
    the database before that change does not overwrite it.

    Only functions that exist are kept fresh, at most `max_entries` of them (least recently used
    go first); a name that does not exist is remembered as missing for one TTL (a deploy on this
    node clears that at once), so a stream of made-up names costs bounded memory, one read per
    name and TTL, and no background work.
    """

    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], compiler: ModuleCompiler, ttl_s: float, max_entries: int = 10_000,
        max_files_entries: int = 10_000, keys: NodeKey | None = None,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.compiler = compiler
        self.bundles = BundleStore(compiler.cache.base)  # functions' files, unpacked beside their artifacts
        self.max_files_entries = max_files_entries
        self.ttl_s = ttl_s
        self.keys = keys  # opens the secrets functions get (None: functions with secrets cannot run)
        self.max_entries = max_entries
        self._fns: dict[tuple[str, str], FunctionMeta] = {}
        self._kernels: dict[str, tuple[float, KernelSet]] = {}
        self._used: dict[tuple[str, str], float] = {}  # found functions, least recently used first
        self._missing: dict[tuple[str, str], float] = {}  # names found missing -> until when
        self._gen: dict[object, int] = {}  # (tenant, name) or tenant -> local change counter
        # versions calls pinned (X-Function-Version), by function: dropped with its entry
        self._pinned: dict[tuple[str, str], dict[int, FunctionMeta]] = {}
        # misses being read, by (tenant, name, its generation, the tenant's)
        self._reads: SharedReads[tuple[str, str, int, int], tuple[FunctionMeta, KernelSet]] = SharedReads()

    async def lookup(self, tenant_id: str, name: str, version: int | None = None) -> tuple[FunctionMeta, KernelSet]:
        """The function (its active version, or `version`) and the tenant's kernels; on a miss,
        both reads run concurrently, shared by every call that misses meanwhile."""
        if version is not None:
            return await self.pinned(tenant_id, name, version), await self.kernels(tenant_id)
        cached = self.cached(tenant_id, name)
        if cached is not None:
            return cached
        key = (tenant_id, name)
        self._check_missing(key, time.monotonic())
        # a change here since a read began (its generation) starts another: no call made after a
        # deploy gets what was read before it
        reading = (tenant_id, name, self._gen.get(key, 0), self._gen.get(tenant_id, 0))
        return await self._reads.read(reading, lambda: self._read(tenant_id, name))

    async def _read(self, tenant_id: str, name: str) -> tuple[FunctionMeta, KernelSet]:
        found, kernels = await asyncio.gather(self.function(tenant_id, name), self.kernels(tenant_id))
        self._touch((tenant_id, name), time.monotonic())
        return found, kernels

    def cached(self, tenant_id: str, name: str) -> tuple[FunctionMeta, KernelSet] | None:
        """The active version and the kernels when both are fresh here: the hot path, no task,
        no await. None: `lookup` reads what is missing."""
        key = (tenant_id, name)
        now = time.monotonic()
        meta = self._fns.get(key)
        hit = self._kernels.get(tenant_id)
        if meta is not None and meta.expires > now and hit is not None and hit[0] > now:
            self._touch(key, now)
            return meta, hit[1]
        return None

    def _touch(self, key: tuple[str, str], now: float) -> None:
        used = self._used
        used.pop(key, None)  # re-inserted at the end: the dict's order is the LRU order
        used[key] = now
        if len(used) > self.max_entries:
            del used[next(iter(used))]

    def known_missing(self, tenant_id: str, name: str) -> bool:
        """The name was read as missing lately (a lookup would raise NotFound without a read)."""
        return self._missing_now((tenant_id, name), time.monotonic())

    def _check_missing(self, key: tuple[str, str], now: float) -> None:
        if self._missing_now(key, now):
            raise NotFound.of(f"function {key[1]!r}")

    def _missing_now(self, key: tuple[str, str], now: float) -> bool:
        """Remembered as missing and not expired (an expired entry is dropped)."""
        until = self._missing.get(key)
        if until is None:
            return False
        if until > now:
            return True
        del self._missing[key]
        return False

    def _note_missing(self, key: tuple[str, str]) -> None:
        self._missing.pop(key, None)
        self._missing[key] = time.monotonic() + self.ttl_s
        if len(self._missing) > self.max_entries:
            del self._missing[next(iter(self._missing))]

    async def function(self, tenant_id: str, name: str, *, fresh: bool = False) -> FunctionMeta:
        """`fresh`: read it from the database even if cached (after a change here)."""
        key = (tenant_id, name)
        now = time.monotonic()
        meta = self._fns.get(key)
        if meta is not None and meta.expires > now and not fresh:
            return meta
        self._check_missing(key, now)
        gen = self._gen.get(key, 0)
        async with self.sessionmaker() as session:
            meta = await self._load_function(session, tenant_id, name)
        if meta is None:
            if self._gen.get(key, 0) == gen:
                self._note_missing(key)
            raise NotFound.of(f"function {name!r}")
        if self._gen.get(key, 0) == gen:
            self._fns[key] = meta
        return meta

    def keys_for(self, settings: Settings) -> NodeKey:
        """The node key that seals and opens secrets (made from `settings` if none was given)."""
        if self.keys is None:
            self.keys = NodeKey(settings)
        return self.keys

    async def pinned(self, tenant_id: str, name: str, version: int) -> FunctionMeta:
        """A version a call pinned: versions do not change, but a function deleted and deployed
        again numbers its versions anew, so these go with the function's entry (and its TTL)."""
        key = (tenant_id, name)
        hit = self._pinned.get(key, {}).get(version)
        if hit is not None and hit.expires > time.monotonic():
            return hit
        gen = self._gen.get(key, 0)
        async with self.sessionmaker() as session:
            meta = await self._load_function(session, tenant_id, name, version)
        if meta is None:
            raise NotFound.of(f"function {name!r}")
        if self._gen.get(key, 0) == gen:
            self._pinned.setdefault(key, {})[version] = meta
            if len(self._pinned) > self.max_entries:
                del self._pinned[next(iter(self._pinned))]
        return meta

    async def _load_function(self, session: AsyncSession, tenant_id: str, name: str, number: int | None = None) -> FunctionMeta | None:
        """Its active version, or version `number` (a version it does not keep: version_not_found)."""
        repo = FunctionRepository(session, tenant_id)
        if number is None:  # the usual read: one query
            found = await repo.active(name)
            if found is None:
                return None
            fn, ver = found
        else:
            pinned_fn = await repo.get(name)
            if pinned_fn is None:
                return None
            pinned = await repo.version_settings(pinned_fn, number)
            if pinned is None:
                raise version_not_found(name, number)
            fn, ver = pinned_fn, pinned
        return await self._meta_of(session, tenant_id, fn, ver)

    async def _meta_of(self, session: AsyncSession, tenant_id: str, fn: Function, ver: FunctionVersion) -> FunctionMeta | None:
        """What a call of `ver` needs, its module compiled and its files unpacked on this node
        where they were not (given through another node); None: its files were replaced meanwhile."""
        repo, name, sha = FunctionRepository(session, tenant_id), fn.name, ver.sha256
        if not self.compiler.cache.has(sha):  # deployed through another node
            wasm = await repo.module_bytes(fn, ver.version)
            assert wasm is not None
            with compile_errors():
                await self.compiler.ensure_artifact(tenant_id, sha, wasm)
        files = fn.files_sha256
        if files and not self.bundles.has(files):  # given through another node, or removed here since
            archive = await repo.files_archive(fn)
            if archive is None:  # replaced meanwhile: the next read sees the new files
                return None
            await asyncio.to_thread(self.bundles.unpack, files, archive, self.max_files_entries)
        secrets = await open_secrets(session, tenant_id, ver.secrets or [], self.keys, f"version {ver.version} of function {name!r}")
        return self.meta_for(fn, ver, secrets)

    async def kernels(self, tenant_id: str) -> KernelSet:
        hit = self._kernels.get(tenant_id)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        gen = self._gen.get(tenant_id, 0)
        async with self.sessionmaker() as session:
            sources = await KernelRepository(session, tenant_id).sources()
        return self._store_kernels(tenant_id, sources, gen)

    def _store_kernels(self, tenant_id: str, sources: dict[str, str], gen: int) -> KernelSet:
        hit = self._kernels.get(tenant_id)
        old = hit[1] if hit else None
        # unchanged: keep the object; either way the version is the sources' hash, so any front
        # can tell whether a worker holds them
        ks = old if old is not None and old.sources == sources else KernelSet.of(sources)
        if self._gen.get(tenant_id, 0) == gen:
            self._kernels[tenant_id] = (time.monotonic() + self.ttl_s, ks)
        return ks

    async def refresh(self, keep_s: float) -> None:
        """Re-read every function used within `keep_s` and its tenant's kernels; forget the rest."""
        now = time.monotonic()
        self._used = {k: t for k, t in self._used.items() if now - t <= keep_s}
        self._missing = {k: t for k, t in self._missing.items() if t > now}
        for key in [k for k in self._fns if k not in self._used]:
            del self._fns[key]
        tenants = {t for t, _ in self._used}
        for tenant_id in [t for t in self._kernels if t not in tenants]:
            del self._kernels[tenant_id]
        if not self._used:
            return
        keys = list(self._used)
        gens = {k: self._gen.get(k, 0) for k in [*keys, *tenants]}  # a local change after this wins
        async with self.sessionmaker() as session:
            found = await active_functions(session, keys)  # one read for all: see its docstring
            for key in keys:
                row = found.get(key)
                try:
                    meta = await self._meta_of(session, key[0], *row) if row is not None else None
                except DomainError:  # its module cannot be compiled here now; its calls say so
                    meta = None
                if self._gen.get(key, 0) != gens[key]:
                    continue  # changed on this node while we read: the local entry is newer
                if row is None:  # deleted elsewhere: stop keeping it fresh
                    self._fns.pop(key, None)
                    self._used.pop(key, None)
                    self._note_missing(key)
                elif meta is not None:
                    self._fns[key] = meta
                else:  # not compilable here now, or its files replaced meanwhile: its next call
                    # reads it (and keeps it fresh again); no compile tried at every refresh
                    self._fns.pop(key, None)
                    self._used.pop(key, None)
            sources = await kernel_sources(session, list(tenants))
        for tenant_id in tenants:
            self._store_kernels(tenant_id, sources[tenant_id], gens[tenant_id])

    def _bump(self, key: object) -> None:
        self._gen[key] = self._gen.get(key, 0) + 1

    def remember(self, tenant_id: str, meta: FunctionMeta) -> None:
        """Prime the cache at deploy, so the first call after a deploy skips the database."""
        key = (tenant_id, meta.name)
        self._bump(key)
        self._missing.pop(key, None)  # a name just deployed here is no longer missing
        self._fns[key] = meta
        self._touch(key, time.monotonic())

    def meta_for(self, fn: Function, ver: FunctionVersion, secrets: dict[str, str]) -> FunctionMeta:
        """What a call of version `ver` of `fn` runs: the version's module and settings, the
        function's files, the secrets' values."""
        return FunctionMeta(
            name=fn.name,
            version=ver.version,
            sha256=ver.sha256,
            env=dict(ver.env or {}),
            content_type=ver.content_type,
            timeout_ms=ver.timeout_ms,
            artifact=self.compiler.cache.path_for(ver.sha256),
            expires=time.monotonic() + self.ttl_s,
            args=tuple(ver.args or ()),
            cgi=ver.cgi,
            scratch=ver.scratch,
            files=fn.files_sha256 or "",
            secrets=SecretEnv(secrets),
        )

    def drop(self, tenant_id: str, name: str) -> None:
        self._bump((tenant_id, name))
        self._fns.pop((tenant_id, name), None)
        self._used.pop((tenant_id, name), None)
        self._pinned.pop((tenant_id, name), None)

    def discard_artifact(self, tenant_id: str, name: str, sha256: str) -> None:
        """Forget a compiled file a worker could not load; the next lookup recompiles it."""
        self.compiler.cache.path_for(sha256).unlink(missing_ok=True)
        self.drop(tenant_id, name)

    def forget(self, tenant_id: str, name: str) -> None:
        """Changed on another front: drop the entry and any note that the name is missing."""
        self.drop(tenant_id, name)
        self._missing.pop((tenant_id, name), None)

    def drop_kernels(self, tenant_id: str) -> None:
        self._bump(tenant_id)
        self._kernels.pop(tenant_id, None)

    def drop_tenant(self, tenant_id: str) -> None:
        for key in [k for k in (*self._fns, *self._pinned) if k[0] == tenant_id]:
            self.drop(*key)
        self.drop_kernels(tenant_id)
