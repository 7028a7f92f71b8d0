"""`tensorwasm completion SHELL`: the shell completion script (click's completion), and the
completion of names the server knows: functions and kernels (with the API key), tenants (with the
admin token), fetched with the configured URL and credentials; nothing is offered, and nothing
printed, when the server cannot be asked."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import click
from click.shell_completion import CompletionItem, get_completion_class

from app.cli.context import Config
from app.client import DEFAULT_URL, AdminClient, TensorWasmClient

PROG = "tensorwasm"
COMPLETE_VAR = "_TENSORWASM_COMPLETE"
# a completion waits on the server at most this long: a TAB must not hang the shell
COMPLETION_TIMEOUT_S = 2.0

Complete = Callable[[click.Context, click.Parameter, str], list[CompletionItem]]


def _names(fetch: Callable[[click.Context], Iterable[str]]) -> Complete:
    def complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        try:
            names = sorted(set(fetch(ctx)))
        except Exception:  # unreachable, no credentials, refused: offer nothing, say nothing
            return []
        return [CompletionItem(n) for n in names if n.startswith(incomplete)]

    return complete


def _config(ctx: click.Context) -> Config:
    """The global options as given on the line or in the environment (completion parses the
    line without running the commands' callbacks, so the root has not made its Config yet)."""
    params = ctx.find_root().params
    url, token, key = params.get("url"), params.get("admin_token"), params.get("api_key")
    return Config(
        url=str(url or DEFAULT_URL), admin_token=str(token) if token else None, api_key=str(key) if key else None, as_json=False
    )


def _tenant_client(ctx: click.Context) -> TensorWasmClient:
    return _config(ctx).tenant(timeout=COMPLETION_TIMEOUT_S)


def _admin_client(ctx: click.Context) -> AdminClient:
    return _config(ctx).admin(timeout=COMPLETION_TIMEOUT_S)


def _function_names(ctx: click.Context) -> list[str]:
    with _tenant_client(ctx) as c:
        return [f.name for f in c.list_functions()]


def _kernel_names(ctx: click.Context) -> list[str]:
    with _tenant_client(ctx) as c:
        return [k.name for k in c.list_kernels()]


def _tenant_names(ctx: click.Context) -> list[str]:
    with _admin_client(ctx) as c:
        return [t.name for t in c.list_tenants()]


complete_functions = _names(_function_names)
complete_kernels = _names(_kernel_names)
complete_tenants = _names(_tenant_names)


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script (bash, zsh or fish).

    E.g. `eval "$(tensorwasm completion bash)"` in ~/.bashrc. Commands and flags complete, and so
    do the names of functions, kernels (with TENSORWASM_API_KEY) and tenants (with the admin
    token), asked of the server at TENSORWASM_URL.
    """
    cls = get_completion_class(shell)
    assert cls is not None  # the choices are click's built-in shells
    root = ctx.find_root().command
    click.echo(cls(root, {}, PROG, COMPLETE_VAR).source())
