"""`tensorwasm admin`: operator calls over HTTP (admin token). Tenants by name or id."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import click

from app.api.schemas import Quota
from app.cli.completion import complete_tenants
from app.cli.context import Config, FiniteFloat, emit, emit_table, pass_config, status

TENANT_COLUMNS = ("id", "name", "disabled")
KEY_COLUMNS = ("id", "prefix", "created_at", "last_used_at", "revoked_at")
WORKER_COLUMNS = ("id", "pid", "state", "backend", "tenant", "gpu_bytes_in_use", "gpu_bytes_cap", "invocations")
NODE_COLUMNS = ("id", "host", "alive", "started_at", "last_seen")



def quota_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """One flag per quota field, taken from the API's schema so the two never drift."""
    for field, info in reversed(list(Quota.model_fields.items())):
        kind: click.ParamType = FiniteFloat() if info.annotation is float else click.INT
        f = click.option(f"--{field.replace('_', '-')}", field, type=kind, help=info.description)(f)
    return f


def given(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


@click.group()
def admin() -> None:
    """Tenants, quotas, API keys, workers and nodes (needs the admin token)."""


@admin.command("create-tenant")
@click.argument("name")
@quota_options
@pass_config
def create_tenant(cfg: Config, name: str, **quota: Any) -> None:
    """Create a tenant; omitted quota fields take the platform defaults."""
    with cfg.admin() as c:
        emit(c.create_tenant(name, given(quota)))


@admin.command("list")
@pass_config
def list_tenants(cfg: Config) -> None:
    """List tenants."""
    with cfg.admin() as c:
        tenants = c.list_tenants()
    if cfg.as_json:
        emit_table(cfg, tenants, TENANT_COLUMNS)
        return
    flat = [SimpleNamespace(**t.model_dump(exclude={"quota"}), **t.quota.model_dump()) for t in tenants]
    emit_table(cfg, flat, (*TENANT_COLUMNS, "gpu_memory_bytes", "max_concurrency", "timeout_ms"))


@admin.command("get")
@click.argument("tenant", shell_complete=complete_tenants)
@pass_config
def get_tenant(cfg: Config, tenant: str) -> None:
    """Show a tenant and its quota."""
    with cfg.admin() as c:
        emit(c.get_tenant(tenant))


@admin.command("set-quota")
@click.argument("tenant", shell_complete=complete_tenants)
@quota_options
@click.option("--replace", is_flag=True, help="replace the whole quota: omitted fields take the defaults")
@pass_config
def set_quota(cfg: Config, tenant: str, replace: bool, **quota: Any) -> None:
    """Change the given quota fields of a tenant; the others keep their values."""
    fields = given(quota)
    if not fields and not replace:
        raise click.UsageError("give at least one quota field (see --help)")
    with cfg.admin() as c:
        emit(c.replace_quota(tenant, **fields) if replace else c.update_quota(tenant, **fields))


@admin.command("disable")
@click.argument("tenant", shell_complete=complete_tenants)
@pass_config
def disable(cfg: Config, tenant: str) -> None:
    """Disable a tenant: its keys stop working at once, its data stays."""
    with cfg.admin() as c:
        emit(c.disable_tenant(tenant))


@admin.command("enable")
@click.argument("tenant", shell_complete=complete_tenants)
@pass_config
def enable(cfg: Config, tenant: str) -> None:
    """Enable a disabled tenant again."""
    with cfg.admin() as c:
        emit(c.enable_tenant(tenant))


@admin.command("delete")
@click.argument("tenant", shell_complete=complete_tenants)
@click.option("--yes", is_flag=True, help="do not ask")
@pass_config
def delete(cfg: Config, tenant: str, yes: bool) -> None:
    """Delete a tenant with its functions, kernels, keys and records."""
    if not yes:
        click.confirm(f"delete tenant {tenant!r} and everything it owns?", abort=True, err=True)
    with cfg.admin() as c:
        c.delete_tenant(tenant)
    status(f"deleted tenant {tenant}")


@admin.command("create-key")
@click.argument("tenant", shell_complete=complete_tenants)
@pass_config
def create_key(cfg: Config, tenant: str) -> None:
    """Mint an API key; prints the key alone (it is shown only once)."""
    with cfg.admin() as c:
        key = c.create_api_key(tenant)
    if cfg.as_json:
        emit(key)
    else:
        status(f"key {key.id} for {tenant} (shown only now):")
        click.echo(key.key)


@admin.command("list-keys")
@click.argument("tenant", shell_complete=complete_tenants)
@pass_config
def list_keys(cfg: Config, tenant: str) -> None:
    """List a tenant's API keys (prefixes only)."""
    with cfg.admin() as c:
        emit_table(cfg, c.list_api_keys(tenant), KEY_COLUMNS)


@admin.command("revoke-key")
@click.argument("tenant", shell_complete=complete_tenants)
@click.argument("key_id")
@pass_config
def revoke_key(cfg: Config, tenant: str, key_id: str) -> None:
    """Revoke one API key of a tenant."""
    with cfg.admin() as c:
        c.revoke_api_key(tenant, key_id)
    status(f"revoked key {key_id}")


@admin.command("workers")
@pass_config
def workers(cfg: Config) -> None:
    """Every worker of the node: state, bound tenant, GPU bytes in use and cap."""
    with cfg.admin() as c:
        emit_table(cfg, c.list_workers(), WORKER_COLUMNS)


@admin.command("nodes")
@pass_config
def nodes(cfg: Config) -> None:
    """The cluster's nodes sharing the database: host, last start, last heartbeat, alive."""
    with cfg.admin() as c:
        emit_table(cfg, c.list_nodes(), NODE_COLUMNS)
