"""`tensorwasm deploy | invoke | functions`: a tenant's functions over HTTP (API key)."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import click

from app.cli.completion import complete_functions
from app.cli.context import CliError, Config, emit, emit_table, pass_config, status, stdin_bytes
from app.cli.scaffold import deploy_manifest

FUNCTION_COLUMNS = ("name", "version", "size", "content_type", "timeout_ms", "updated_at")


def _pairs(values: tuple[str, ...], flag: str) -> list[tuple[str, str]]:
    out = []
    for v in values:
        key, sep, value = v.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {v!r}", param_hint=flag)
        out.append((key, value))
    return out


class _UploadProgress:
    """Bytes sent while the module uploads, then 'compiling…' until the server answers (the
    module's size was checked against the tenant's quota first, so the server reads it all)."""

    def __init__(self, label: str, quiet: bool, then: str = "compiling…") -> None:
        self.label = label
        self.quiet = quiet
        self.then = then
        self.tty = sys.stderr.isatty()

    def __call__(self, sent: int, total: int) -> None:
        if self.quiet:
            return
        if self.tty:
            click.echo(f"\ruploading {self.label}: {sent}/{total} bytes", err=True, nl=sent == total)
        elif sent == total:
            status(f"uploaded {self.label}: {total} bytes")
        if sent == total:
            status(self.then)


@click.command()
@click.argument("name", required=False, shell_complete=complete_functions)
@click.argument("file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="environment variable of the guest (repeatable; replaces all)")
@click.option("--arg", "args", multiple=True, metavar="ARG", help="default argument after the function's name (repeatable; replaces all)")
@click.option("--cgi/--no-cgi", default=None, help="add the request variables (QUERY_STRING, CONTENT_TYPE, TW_*) to the environment")
@click.option("--files", "files", type=click.Path(exists=True, path_type=Path), help="a directory or tar archive the guest sees at /")
@click.option("--scratch/--no-scratch", default=None, help="each call gets a writable in-memory copy of the files")
@click.option("--content-type", help="Content-Type of the function's responses")
@click.option("--timeout-ms", type=int, help="per-call limit (at most the tenant's quota)")
@click.option("--max-attempts", type=int, help="runs of an async invocation whose node is lost mid-run (1: never run again)")
@click.option("--secret", "secret_names", multiple=True, metavar="NAME",
              help="a secret of the tenant the guest gets as variable NAME (repeatable; replaces all; --secret '' for none)")
@click.option("-q", "--quiet", is_flag=True, help="no progress on stderr")
@pass_config
def deploy(
    cfg: Config, name: str | None, file: Path | None, env: tuple[str, ...], args: tuple[str, ...], cgi: bool | None, files: Path | None,
    scratch: bool | None, content_type: str | None, timeout_ms: int | None, max_attempts: int | None,
    secret_names: tuple[str, ...], quiet: bool,
) -> None:
    """Upload FILE (a .wasm module, or WAT text) as function NAME, or as its new version; with
    --files, then its files. With no arguments: build and deploy the tensorwasm.toml here."""
    if name is None and file is None:
        return deploy_manifest(cfg, quiet)
    if name is None or file is None:
        raise click.UsageError("give NAME and FILE, or neither to deploy the tensorwasm.toml of this directory")
    module = file.read_bytes()
    with cfg.tenant() as c:
        limit = c.usage().quota.max_module_bytes
        if len(module) > limit:  # refused before a byte is sent, as the server would after
            raise CliError(
                f"{file.name} is {len(module)} bytes, larger than this tenant's max_module_bytes quota of {limit} bytes "
                f"({limit / 2**20:.1f} MiB): make it smaller (e.g. build with -O2 -s, or run wasm-opt) or ask an operator "
                "to raise the quota (`tensorwasm admin set-quota TENANT --max-module-bytes N`)"
            )
        result = c.deploy(
            name, module, env=dict(_pairs(env, "--env")), args=list(args) if args else None, cgi=cgi, scratch=scratch,
            content_type=content_type, timeout_ms=timeout_ms, max_attempts=max_attempts,
            secrets=list(secret_names) if secret_names else None, progress=_UploadProgress(file.name, quiet),
        )
        fn = result.function
        if not quiet:
            status(f"deployed {fn.name} version {fn.version}" + (" (new function)" if result.created else ""))
        if files is not None:
            fn = c.put_files(name, archive_of(files), progress=_UploadProgress(files.name, quiet, "unpacking…"))
    emit(fn)


def archive_of(path: Path) -> bytes:
    """A tar archive of directory `path`'s contents (at the archive's root), or the bytes of a
    tar file as they are."""
    if path.is_dir():
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for child in sorted(path.iterdir()):
                tar.add(child, arcname=child.name)
        return buf.getvalue()
    data = path.read_bytes()
    if not _is_tar(data):
        raise CliError(f"{path} is neither a directory nor a tar archive")
    return data


def _is_tar(data: bytes) -> bool:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:"):
            return True
    except tarfile.TarError:
        return False


@click.command("files")
@click.argument("name", shell_complete=complete_functions)
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("-q", "--quiet", is_flag=True, help="no progress on stderr")
@pass_config
def put_files(cfg: Config, name: str, path: Path, quiet: bool) -> None:
    """Give function NAME the files of PATH (a directory or a tar archive), seen at / by its guest."""
    with cfg.tenant() as c:
        emit(c.put_files(name, archive_of(path), progress=_UploadProgress(path.name, quiet, "unpacking…")))


@click.command()
@click.argument("name", shell_complete=complete_functions)
@click.option("-d", "--data", help="stdin for the guest (default: this command's stdin)")
@click.option("--query", "query", multiple=True, metavar="KEY=VALUE", help="query parameter passed to the guest (repeatable)")
@click.option("--arg", "args", multiple=True, metavar="ARG", help="argument after the function's name, instead of its defaults (repeatable)")
@click.option("--stream", is_flag=True, help="write the guest's output as it is produced")
@click.option("--async", "run_async", is_flag=True, help="queue the invocation and print its id")
@click.option("--wait", is_flag=True, help="with --async: wait for the end and write the output")
@click.option("--idempotency-key", help="with --async: the same key within 24 h returns the same invocation")
@click.option("--version", "pinned", type=click.IntRange(min=1), help="run this version of the function, not its active one")
@click.option("--callback-url", help="with --async: POST the final record there when it ends, signed (`tensorwasm callbacks secret`)")
@click.option("-v", "--verbose", is_flag=True, help="print the invocation id on stderr")
@pass_config
def invoke(
    cfg: Config, name: str, data: str | None, query: tuple[str, ...], args: tuple[str, ...], stream: bool, run_async: bool, wait: bool,
    idempotency_key: str | None, callback_url: str | None, verbose: bool, pinned: int | None,
) -> None:
    """Run function NAME: stdin goes to the guest, its stdout comes back on stdout."""
    call_args = list(args) if args else None
    if (wait or idempotency_key or callback_url) and not run_async:
        raise click.UsageError("--wait, --idempotency-key and --callback-url go with --async")
    body = data.encode() if data is not None else stdin_bytes()
    params = _pairs(query, "--query")
    out = sys.stdout.buffer
    with cfg.tenant() as c:
        if run_async:
            record = c.submit(
                name, body, query=params, idempotency_key=idempotency_key, args=call_args, callback_url=callback_url, version=pinned
            )
            if verbose:
                status(f"invocation {record.id}")
            if not wait:
                click.echo(record.id)
                return
            status(f"queued invocation {record.id}")
            record = c.wait(record.id, on_status=lambda r: status(str(r.status)))
            _ended(record.id, record.status, record.error, c.invocation_output(record.id, any_status=True))
        elif stream:
            for event in c.invoke_events(name, body, query=params, args=call_args, version=pinned):
                if event.event == "output":
                    out.write(event.data.encode())
                    out.flush()
                elif event.outcome is not None:
                    end = event.outcome
                    if verbose:
                        status(f"invocation {end.get('invocation_id')}")
                    _ended(str(end.get("invocation_id")), str(end.get("status")), end.get("error"), b"")
        else:
            result = c.invoke(name, body, query=params, args=call_args, version=pinned)
            if verbose:
                status(f"invocation {result.invocation_id}")
            out.write(result.output)
            out.flush()


def _ended(invocation_id: str, outcome: str, error: object, output: bytes) -> None:
    """Write a finished invocation's output; exit 1 with its error unless it succeeded."""
    sys.stdout.buffer.write(output)
    sys.stdout.flush()
    if outcome != "succeeded":
        click.echo(f"error: invocation {invocation_id} ended {outcome}: {error}", err=True)
        raise SystemExit(1)


@click.group()
def functions() -> None:
    """List, show and delete functions."""


@functions.command("list")
@pass_config
def list_functions(cfg: Config) -> None:
    """List the tenant's functions."""
    with cfg.tenant() as c:
        emit_table(cfg, c.list_functions(), FUNCTION_COLUMNS)


@functions.command("get")
@click.argument("name", shell_complete=complete_functions)
@pass_config
def get_function(cfg: Config, name: str) -> None:
    """Show a function and its versions."""
    with cfg.tenant() as c:
        emit(c.get_function(name))


@functions.command("delete")
@click.argument("name", shell_complete=complete_functions)
@pass_config
def delete_function(cfg: Config, name: str) -> None:
    """Delete a function with all its versions."""
    with cfg.tenant() as c:
        c.delete_function(name)
    status(f"deleted function {name}")


functions.add_command(put_files)
