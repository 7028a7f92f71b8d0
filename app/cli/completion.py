"""`tensorwasm completion SHELL`: the shell completion script (click's completion)."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

PROG = "tensorwasm"
COMPLETE_VAR = "_TENSORWASM_COMPLETE"


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script (bash, zsh or fish).

    E.g. `eval "$(tensorwasm completion bash)"` in ~/.bashrc.
    """
    cls = get_completion_class(shell)
    assert cls is not None  # the choices are click's built-in shells
    root = ctx.find_root().command
    click.echo(cls(root, {}, PROG, COMPLETE_VAR).source())
