"""`tensorwasm kernels`: the tenant's private CUDA kernel modules (API key)."""

from __future__ import annotations

from pathlib import Path

import click

from app.cli.completion import complete_kernels
from app.cli.context import Config, emit, emit_table, pass_config, status

KERNEL_COLUMNS = ("name", "size", "sha256", "updated_at")


@click.group()
def kernels() -> None:
    """Register, list, show and delete kernel modules for module_get(NAME)."""


@kernels.command("put")
@click.argument("name", shell_complete=complete_kernels)
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@pass_config
def put(cfg: Config, name: str, file: Path) -> None:
    """Register FILE (CUDA C++ source) as kernel module NAME, or replace it."""
    with cfg.tenant() as c:
        emit(c.put_kernel(name, file.read_text()))


@kernels.command("list")
@pass_config
def list_kernels(cfg: Config) -> None:
    """List kernel modules."""
    with cfg.tenant() as c:
        emit_table(cfg, c.list_kernels(), KERNEL_COLUMNS)


@kernels.command("get")
@click.argument("name", shell_complete=complete_kernels)
@pass_config
def get(cfg: Config, name: str) -> None:
    """Show a kernel module with its source."""
    with cfg.tenant() as c:
        emit(c.get_kernel(name))


@kernels.command("delete")
@click.argument("name", shell_complete=complete_kernels)
@pass_config
def delete(cfg: Config, name: str) -> None:
    """Delete a kernel module."""
    with cfg.tenant() as c:
        c.delete_kernel(name)
    status(f"deleted kernel {name}")
