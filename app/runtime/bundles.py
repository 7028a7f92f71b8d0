"""A function's files: the tar archive a tenant uploads, checked, and unpacked once per node.

An archive is checked whole before it is stored (`check_archive`): only regular files,
directories and symbolic links whose target stays inside the archive (relative, and no `..` past
its root); no absolute paths, no `..`, no hard links, devices or fifos, no path twice and none
through a link or a file. So unpacking it (`BundleStore.unpack`, into the node's data dir, keyed
by the archive's sha256) writes only inside its directory, and never through a link.

The guest sees the unpacked directory as its `/`: read-only, or, with scratch, a copy made for
the call (`ScratchDir`) and removed after it. Neither the directory's host path nor anything
outside it is visible to the guest: wasmtime's WASI resolves every path, and every symbolic link
the guest follows or makes, inside the preopened directory.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENTRY_BYTES = 512  # what a file, directory or link counts in a scratch copy besides its bytes
_MAX_PATH = 1024  # bytes of a member's path


class InvalidArchive(ValueError):
    """The archive cannot be a function's files; the message says which member and why."""


@dataclass(frozen=True)
class ArchiveInfo:
    sha256: str
    unpacked_bytes: int  # the regular files' contents
    entries: int  # files, directories (implied ones too) and links


@dataclass(frozen=True)
class _Member:
    path: str  # normalized, relative, no `..`
    info: tarfile.TarInfo


def _normalized(name: str) -> str:
    if "\x00" in name or len(name.encode()) > _MAX_PATH:
        raise InvalidArchive(f"member {name[:80]!r}: a path holds at most {_MAX_PATH} bytes and no NUL")
    if name.startswith("/"):
        raise InvalidArchive(f"member {name[:80]!r}: absolute paths are not allowed; make them relative to the archive's root")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidArchive(f"member {name[:80]!r}: `..` is not allowed in a path")
    return "/".join(parts)


def _members(data: bytes, max_entries: int) -> list[_Member]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            members: list[_Member] = []
            for info in tar:
                if len(members) >= max_entries:
                    raise InvalidArchive(f"the archive has more than {max_entries} members")
                members.append(_Member(_normalized(info.name), info))
            return members
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise InvalidArchive(f"not a readable tar archive ({exc})") from None


def check_archive(data: bytes, max_unpacked_bytes: int, max_entries: int) -> ArchiveInfo:
    """Check every member (see the module's docstring); raises InvalidArchive."""
    members = _members(data, max_entries)
    kinds: dict[str, str] = {}  # path -> "file" | "dir" | "link"
    total = 0
    for m in members:
        info, path = m.info, m.path
        if not path:
            if info.isdir():
                continue  # the archive's root itself ("." or "./")
            raise InvalidArchive(f"member {info.name[:80]!r} has no name")
        if info.isreg():
            kind = "file"
            total += info.size
        elif info.isdir():
            kind = "dir"
        elif info.issym():
            kind = "link"
            target = info.linkname
            if "\x00" in target or target.startswith("/") or len(target.encode()) > _MAX_PATH:
                raise InvalidArchive(f"link {path[:80]!r}: its target must be a relative path inside the archive, got {target[:80]!r}")
            if posixpath.normpath(posixpath.join(posixpath.dirname(path), target)).split("/")[0] == "..":
                raise InvalidArchive(f"link {path[:80]!r}: its target {target[:80]!r} points outside the archive")
        elif info.islnk():
            raise InvalidArchive(f"member {path[:80]!r} is a hard link; store the file itself (or a symbolic link)")
        else:
            raise InvalidArchive(f"member {path[:80]!r} is a device, fifo or other special file; only files, directories and links")
        parents = path.split("/")[:-1]
        for i in range(1, len(parents) + 1):
            parent = "/".join(parents[:i])
            parent_kind = kinds.setdefault(parent, "dir")
            if parent_kind != "dir":
                raise InvalidArchive(f"member {path[:80]!r}: its parent {parent[:80]!r} is a {parent_kind}, not a directory")
        seen = kinds.get(path)
        if seen is not None and not (seen == "dir" and kind == "dir"):
            raise InvalidArchive(f"member {path[:80]!r} appears twice (or a directory of that name came before it)")
        kinds[path] = kind
        if len(kinds) > max_entries:
            raise InvalidArchive(f"the archive has more than {max_entries} entries")
        if total > max_unpacked_bytes:
            raise InvalidArchive(f"the archive's files hold more than {max_unpacked_bytes} bytes")
    return ArchiveInfo(hashlib.sha256(data).hexdigest(), total, len(kinds))


class BundleStore:
    """Unpacked archives under `<cache dir>/files/<sha256>/` (mode 0700), shared by the node's
    fronts and workers; an archive is unpacked once however many functions use it."""

    def __init__(self, cache_dir: Path) -> None:
        self.root = cache_dir / "files"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path_for(self, sha256: str) -> Path:
        return self.root / sha256

    def has(self, sha256: str) -> bool:
        return self.path_for(sha256).is_dir()

    def unpack(self, sha256: str, data: bytes, max_entries: int) -> Path:
        """Unpack a checked archive (atomically: a reader sees all of it or none)."""
        final = self.path_for(sha256)
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".unpack-"))
        try:
            links = []
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                for m in _members(data, max_entries):
                    if not m.path:
                        continue
                    target = tmp / m.path
                    if m.info.isdir():
                        target.mkdir(parents=True, exist_ok=True, mode=0o700)
                    elif m.info.isreg():
                        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                        src = tar.extractfile(m.info)
                        assert src is not None
                        # O_EXCL | O_NOFOLLOW: never through a link, never over another entry
                        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                        with os.fdopen(fd, "wb") as out:
                            shutil.copyfileobj(src, out)
                    elif m.info.issym():
                        links.append((target, m.info.linkname))
            for target, linkname in links:  # last: nothing is written after a link exists
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.symlink(linkname, target)
            try:
                os.rename(tmp, final)
            except OSError:  # unpacked by another process meanwhile
                if not final.is_dir():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def remove(self, sha256: str) -> None:
        """Delete an unpacked archive no function uses any more (a call running over it keeps
        its open files)."""
        path = self.path_for(sha256)
        if path.is_dir():
            doomed = Path(tempfile.mkdtemp(dir=self.root, prefix=".remove-"))
            try:
                os.rename(path, doomed / "x")
            except OSError:
                pass
            shutil.rmtree(doomed, ignore_errors=True)


def scratch_root() -> Path:
    """Where calls' scratch copies go: /dev/shm (memory) where the host has it, else the
    temporary directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def usage(root: Path) -> int:
    """Bytes a scratch copy holds: its regular files' sizes, and ENTRY_BYTES per entry."""
    total = 0
    stack = [str(root)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                total += ENTRY_BYTES
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


class ScratchDir:
    """One call's writable copy of a bundle, in a directory of its own (0700), removed by `close`."""

    def __init__(self, bundle: Path, base: Path) -> None:
        self.holder = Path(tempfile.mkdtemp(dir=base, prefix="tw-scratch-"))
        self.path = self.holder / "root"
        try:
            shutil.copytree(bundle, self.path, symlinks=True)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        shutil.rmtree(self.holder, ignore_errors=True)
