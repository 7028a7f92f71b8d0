"""`tensorwasm deploy | invoke | functions`: a tenant's functions over HTTP (API key)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from app.cli.context import Config, emit, emit_table, pass_config, status, stdin_bytes

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
    """Bytes sent while the module uploads, then 'compiling…' until the server answers."""

    def __init__(self, label: str, quiet: bool) -> None:
        self.label = label
        self.quiet = quiet
        self.tty = sys.stderr.isatty()

    def __call__(self, sent: int, total: int) -> None:
        if self.quiet:
            return
        if self.tty:
            click.echo(f"\ruploading {self.label}: {sent}/{total} bytes", err=True, nl=sent == total)
        elif sent == total:
            status(f"uploaded {self.label}: {total} bytes")
        if sent == total:
            status("compiling…")


@click.command()
@click.argument("name")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="environment variable of the guest (repeatable; replaces all)")
@click.option("--content-type", help="Content-Type of the function's responses")
@click.option("--timeout-ms", type=int, help="per-call limit (at most the tenant's quota)")
@click.option("-q", "--quiet", is_flag=True, help="no progress on stderr")
@pass_config
def deploy(cfg: Config, name: str, file: Path, env: tuple[str, ...], content_type: str | None, timeout_ms: int | None, quiet: bool) -> None:
    """Upload FILE (a .wasm module, or WAT text) as function NAME, or as its new version."""
    module = file.read_bytes()
    with cfg.tenant() as c:
        result = c.deploy(
            name, module, env=dict(_pairs(env, "--env")), content_type=content_type, timeout_ms=timeout_ms,
            progress=_UploadProgress(file.name, quiet),
        )
    fn = result.function
    if not quiet:
        status(f"deployed {fn.name} version {fn.version}" + (" (new function)" if result.created else ""))
    emit(fn)


@click.command()
@click.argument("name")
@click.option("-d", "--data", help="stdin for the guest (default: this command's stdin)")
@click.option("--query", "query", multiple=True, metavar="KEY=VALUE", help="query parameter passed to the guest (repeatable)")
@click.option("--stream", is_flag=True, help="write the guest's output as it is produced")
@click.option("--async", "run_async", is_flag=True, help="queue the invocation and print its id")
@click.option("--wait", is_flag=True, help="with --async: wait for the end and write the output")
@click.option("--idempotency-key", help="with --async: the same key within 24 h returns the same invocation")
@pass_config
def invoke(
    cfg: Config, name: str, data: str | None, query: tuple[str, ...], stream: bool, run_async: bool, wait: bool, idempotency_key: str | None
) -> None:
    """Run function NAME: stdin goes to the guest, its stdout comes back on stdout."""
    if (wait or idempotency_key) and not run_async:
        raise click.UsageError("--wait and --idempotency-key go with --async")
    body = data.encode() if data is not None else stdin_bytes()
    params = _pairs(query, "--query")
    out = sys.stdout.buffer
    with cfg.tenant() as c:
        if run_async:
            record = c.submit(name, body, query=params, idempotency_key=idempotency_key)
            if not wait:
                click.echo(record.id)
                return
            status(f"queued invocation {record.id}")
            record = c.wait(record.id, on_status=lambda r: status(str(r.status)))
            _ended(record.id, record.status, record.error, c.invocation_output(record.id))
        elif stream:
            for event in c.invoke_events(name, body, query=params):
                if event.event == "output":
                    out.write(event.data.encode())
                    out.flush()
                elif event.outcome is not None:
                    end = event.outcome
                    _ended(str(end.get("invocation_id")), str(end.get("status")), end.get("error"), b"")
        else:
            out.write(c.invoke(name, body, query=params).output)
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
@click.argument("name")
@pass_config
def get_function(cfg: Config, name: str) -> None:
    """Show a function and its versions."""
    with cfg.tenant() as c:
        emit(c.get_function(name))


@functions.command("delete")
@click.argument("name")
@pass_config
def delete_function(cfg: Config, name: str) -> None:
    """Delete a function with all its versions."""
    with cfg.tenant() as c:
        c.delete_function(name)
    status(f"deleted function {name}")
