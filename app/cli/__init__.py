"""The `tensorwasm` command line.

`serve`, `migrate`, `openapi` and `bench` act on this node. Every other command calls the HTTP API
through `app.client` (never the database): `admin` with the admin token, `deploy`, `invoke`,
`functions`, `invocations`, `kernels`, `logs`, `callbacks` and `usage` with a tenant's API key;
`new` and `build` make a guest here. Configured by
TENSORWASM_URL, TENSORWASM_ADMIN_TOKEN and TENSORWASM_API_KEY, or the matching flags.
"""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

import click

from app.cli.admin import admin
from app.cli.completion import COMPLETE_VAR, PROG, completion
from app.cli.context import Config, fail, unexpected
from app.cli.functions import deploy, functions, invoke
from app.cli.invocations import invocations
from app.cli.kernels import kernels
from app.cli.local import bench, migrate, openapi, serve
from app.cli.logs import callbacks, logs
from app.cli.scaffold import build, new
from app.cli.secrets import secrets
from app.cli.usage import usage
from app.cli.versions import list_versions, rollback  # noqa: F401  (`functions versions|rollback`)
from app.client import DEFAULT_URL, TensorWasmError


class _Root(click.Group):
    """Every failure ends a command the same way: one line on stderr saying what went wrong and
    what to do, exit status 1 (2 for a usage error); the traceback only with --debug."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click's own: usage errors and CliError print themselves
        except TensorWasmError as exc:
            if ctx.params.get("debug"):
                traceback.print_exc()
            ctx.exit(fail(exc))
        except BrokenPipeError:  # the reader of our output went away (`... | head`): nothing to say
            sys.stderr.close()
            ctx.exit(1)
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            ctx.exit(unexpected(exc))


@click.group(cls=_Root, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--url", envvar="TENSORWASM_URL", default=DEFAULT_URL, show_default=True, help="the server (TENSORWASM_URL)")
@click.option("--admin-token", envvar="TENSORWASM_ADMIN_TOKEN", help="admin token (TENSORWASM_ADMIN_TOKEN; a local server's data dir file otherwise)")
@click.option("--api-key", envvar="TENSORWASM_API_KEY", help="tenant API key (TENSORWASM_API_KEY)")
@click.option("--json", "as_json", is_flag=True, help="print lists as JSON records instead of tables")
@click.option("--debug", is_flag=True, envvar="TENSORWASM_DEBUG", help="print the traceback of a failure (TENSORWASM_DEBUG)")
@click.version_option(package_name="tensorwasm", prog_name=PROG)
@click.pass_context
def cli(ctx: click.Context, url: str, admin_token: str | None, api_key: str | None, as_json: bool, debug: bool) -> None:
    """TensorWasm: WebAssembly functions over HTTP with guest-launched GPU kernels."""
    ctx.obj = Config(url=url, admin_token=admin_token, api_key=api_key, as_json=as_json)


for command in (
    serve, migrate, openapi, bench, admin, new, build, deploy, invoke, functions, invocations, kernels, secrets, logs, callbacks, usage,
    completion,
):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the command line and exit: 0 done, 1 a failure (one line on stderr: the server's
    message, or what went wrong here), 2 a usage error."""
    cli.main(args=argv, prog_name=PROG, complete_var=COMPLETE_VAR)
    sys.exit(0)  # click's standalone mode exits itself; this line is never reached


__all__ = ["cli", "main"]

if __name__ == "__main__":  # pragma: no cover
    main()
