"""Commands that act on this node directly: serve, migrate, openapi, bench."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import click

from app.cli.context import CliError
from app.settings import get_settings


@click.command()
@click.option("--host", help="address to bind (default TENSORWASM_HOST)")
@click.option("--port", type=int, help="port (default TENSORWASM_PORT)")
def serve(host: str | None, port: int | None) -> None:
    """Migrate the database and serve the API (TENSORWASM_PROCESSES fronts on one port)."""
    from app.db.migrate import upgrade
    from app.node.serve import CannotListen, listener
    from app.node.serve import serve as serve_node
    from app.observability.logging import configure_logging

    settings = get_settings()
    host, port = host or settings.host, port or settings.port
    try:
        listener(host, port).close()  # a taken port is said in one line, before anything starts
        configure_logging(settings)
        settings.ensure_data_dir()
        upgrade(settings.resolved_database_url)
        code = serve_node(settings, host, port)
    except CannotListen as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        code = 0  # uvicorn shut down cleanly on Ctrl-C, then raised the signal again for us
    raise SystemExit(code)


@click.command()
@click.option("--down", is_flag=True, help="downgrade instead (default to base)")
@click.option("--revision", help="target revision (default head, or base with --down)")
def migrate(down: bool, revision: str | None) -> None:
    """Run the database migrations (TENSORWASM_DATABASE_URL, or SQLite in the data dir)."""
    from app.db.migrate import downgrade, upgrade

    settings = get_settings()
    settings.ensure_data_dir()
    target = revision or ("base" if down else "head")
    (downgrade if down else upgrade)(settings.resolved_database_url, target)
    click.echo(f"database is at {target}")


@click.command()
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("openapi.json"),
    show_default=True, help="file to write (or to compare with --check)",
)
@click.option("--check", is_flag=True, help="fail if the file differs from the app's document")
def openapi(output: Path, check: bool) -> None:
    """Write the OpenAPI document of the API (to ./openapi.json by default)."""
    from app.main import create_app

    text = json.dumps(create_app().openapi(), indent=2, sort_keys=False) + "\n"
    if check:
        if not output.exists() or output.read_text() != text:
            click.echo(f"{output} is stale: run `tensorwasm openapi -o {output}`", err=True)
            raise SystemExit(1)
        return
    output.write_text(text)
    click.echo(f"wrote {output}")


@click.group()
def bench() -> None:
    """Benchmarks against a real local server."""


@bench.command("invoke")
@click.option("--seconds", type=float, default=5.0, show_default=True, help="Length of each wrk run.")
@click.option("--processes", type=int, default=0, help="Node and baseline processes (default: min(cores, 8)).")
@click.option("--workers", type=int, default=8, show_default=True, help="The node's TENSORWASM_MAX_WORKERS.")
@click.option("--quota-concurrency", type=int, default=8, show_default=True, help="max_concurrency of the tenant that floods.")
@click.option(
    "--flood-runs", type=click.IntRange(min=1), default=1, show_default=True,
    help="Times the flood and the other tenant beside it run (judged on the worst).",
)
@click.option("--json", "as_json", is_flag=True, help="Also print every wrk result and the fronts' phases as JSON.")
def bench_invoke(seconds: float, processes: int, workers: int, quota_concurrency: int, flood_runs: int, as_json: bool) -> None:
    """Invoke latency, throughput and goodput under wrk, against a bare FastAPI echo app."""
    from app.bench.invoke import bench_invoke as run

    args = Namespace(
        seconds=seconds, processes=processes, workers=workers, quota_concurrency=quota_concurrency, flood_runs=flood_runs, json=as_json,
    )
    raise SystemExit(run(args))


@bench.command("fairness")
@click.option("--workers", type=int, default=4, show_default=True, help="TENSORWASM_MAX_WORKERS of the server")
@click.option("--flood", type=int, default=32, show_default=True, help="calls the flooding tenant keeps in flight")
@click.option("--call-ms", type=int, default=5000, show_default=True, help="length of one flood call")
@click.option("--seconds", type=float, default=30, show_default=True, help="how long the flood lasts")
@click.option("--gap-ms", type=int, default=200, show_default=True, help="pause between the quiet tenant's calls")
@click.option("--server-root", help="serve the code of this checkout instead (a baseline)")
def bench_fairness(workers: int, flood: int, call_ms: int, seconds: float, gap_ms: int, server_root: str | None) -> None:
    """A quiet tenant's latency while another tenant floods the node."""
    from app.bench.fairness import bench_fairness as run

    args = Namespace(workers=workers, flood=flood, call_ms=call_ms, seconds=seconds, gap_ms=gap_ms, server_root=server_root)
    raise SystemExit(run(args))


@bench.command("compile")
@click.option("--locals", "n_locals", type=int, default=5000, show_default=True, help="i64 locals of the bomb's function")
@click.option("--blocks", type=int, default=50000, show_default=True, help="`if` blocks of the bomb's function")
@click.option("--small", type=int, default=10, show_default=True, help="small deploys of another tenant, before and during")
def bench_compile(n_locals: int, blocks: int, small: int) -> None:
    """A compile bomb against a server with the default compile limits."""
    from app.bench.compile import bench_compile as run

    raise SystemExit(run(Namespace(locals=n_locals, blocks=blocks, small=small)))


@bench.command("workers")
@click.option("--backend", type=click.Choice(["cpu", "cuda", "auto"]), default="auto", show_default=True)
@click.option("--serial", type=int, default=4, show_default=True, help="workers started one at a time")
@click.option("--parallel", default="8,16", show_default=True, help="sizes of the batches started at once")
@click.option("--devices", default="", help="CUDA_VISIBLE_DEVICES entries to spread each batch over, e.g. 0,1 (default: not pinned)")
@click.option("--fork-only", is_flag=True, help="skip the fresh-interpreter baseline")
def bench_workers(backend: str, serial: int, parallel: str, devices: str, fork_only: bool) -> None:
    """Worker starts: forked from the fork server against fresh interpreters (per second, PSS)."""
    from app.bench.workers import bench_workers as run

    raise SystemExit(run(Namespace(backend=backend, serial=serial, parallel=parallel, devices=devices, fork_only=fork_only)))


@bench.command("guest-call")
@click.option("--backends", default="auto", show_default=True, help="comma-separated: cpu, cuda; auto: cpu, and cuda where a GPU is")
@click.option("--calls", type=click.IntRange(min=10), default=3000, show_default=True, help="calls timed per figure")
@click.option("--json", "as_json", is_flag=True, help="Also print the figures as JSON.")
def bench_guest_call(backends: str, calls: int, as_json: bool) -> None:
    """One guest call inside a worker, piece by piece, against plain wasmtime-py."""
    from app.bench.guest_call import bench_guest_call as run

    raise SystemExit(run(Namespace(backends=backends, calls=calls, json=as_json)))


@bench.command("density")
@click.option("--backend", type=click.Choice(["cpu", "cuda", "auto"]), default="auto", show_default=True)
@click.option("--bound-tenants", type=int, default=64, show_default=True, help="tenants of the bound and burst phases (a worker each)")
@click.option("--tenants", type=int, default=96, show_default=True, help="tenants of the churn phase")
@click.option("--workers", type=int, default=72, show_default=True, help="TENSORWASM_MAX_WORKERS of the churn node")
@click.option("--clients", type=int, default=16, show_default=True, help="callers of the churn phase")
@click.option("--seconds", type=float, default=30, show_default=True, help="length of the churn phase")
@click.option("--ceiling", type=int, default=8, show_default=True, help="TENSORWASM_MAX_CONTEXTS_PER_DEVICE of the ceiling node")
@click.option("--ceiling-tenants", type=int, default=24, show_default=True, help="tenants called at once past the ceiling")
@click.option("--ceiling-rounds", type=int, default=3, show_default=True, help="rounds of those calls")
@click.option("--spares", type=int, default=0, help="TENSORWASM_WARM_SPARES of each node, the room's share off (default: the node's own)")
@click.option(
    "--bound-spares", type=int, default=0,
    help="TENSORWASM_WARM_SPARES of the bound node, whose phase starts once that many are ready (default: --spares)",
)
@click.option("--queue-wait-ms", type=int, default=1000, show_default=True, help="TENSORWASM_QUEUE_WAIT_MS of each node")
@click.option("--timeout-ms", type=int, default=5000, show_default=True, help="every bench tenant's timeout quota")
@click.option("--start-parallel", type=int, default=0, help="workers started at once for the start rate (default: min(clients, workers))")
@click.option("--phases", default="bound,burst,churn,ceiling,memory,devices", show_default=True, help="the phases to run, comma-separated")
@click.option("--url", help="a running node on this host instead of one started per phase (its settings as they are)")
@click.option("--admin-token", default=None, help="that node's admin token (TENSORWASM_ADMIN_TOKEN)", envvar="TENSORWASM_ADMIN_TOKEN")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="also write the results here")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the churn's tenant choice")
def bench_density(json_path: Path | None, phases: str, admin_token: str | None, **opts: Any) -> None:
    """Tenants per node: cold binds, bursts, churn against worker starts, the context ceiling, memory."""
    from app.bench.density import DensityConfig, Phase
    from app.bench.density import bench_density as run
    from app.bench.node import ADMIN

    try:
        chosen = frozenset(Phase(p.strip()) for p in phases.split(",") if p.strip())
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--phases") from None
    token = admin_token if opts["url"] and admin_token else ADMIN
    raise SystemExit(run(DensityConfig(phases=chosen, admin_token=token, **opts), json_path))


@bench.command("gpu")
def bench_gpu() -> None:
    """Guest GPU paths against raw CuPy (needs a GPU and a checkout's examples)."""
    from app.gpu.bench import bench_gpu as run

    raise SystemExit(run(Namespace()))


@bench.command("gpu-share")
@click.option("--seconds", type=float, default=5.0, show_default=True, help="measured length of each phase")
@click.option("--heavy-calls", type=click.IntRange(min=1), default=4, show_default=True, help="calls tenant H keeps in flight")
@click.option("--heavy-ms", type=float, default=20.0, show_default=True, help="length of H's kernel (every SM)")
@click.option("--blocks", type=int, default=0, help="grid of H's kernel (default: 4 blocks per SM)")
@click.option("--victim-bytes", type=int, default=1 << 20, show_default=True, help="buffer of V's saxpy")
@click.option("--victim-repeat", type=int, default=50, show_default=True, help="launches in one call of V")
@click.option("--victim-weight", type=click.IntRange(1, 100), default=3, show_default=True, help="V's gpu_weight in the weighted phases (H: 1)")
@click.option("--device", default="", help="the one CUDA_VISIBLE_DEVICES entry the node gets (default: this shell's first, or 0)")
@click.option("--server-root", help="serve the code of this checkout instead (a baseline)")
@click.option("--baseline/--no-baseline", default=True, show_default=True, help="also run H alone and V beside H on a node with the share off")
@click.option(
    "--h-rounds", type=click.IntRange(min=0), default=3, show_default=True,
    help="rounds of H alone alternated (1:1, weighted, share off), whose medians the H-alone bounds are judged on (0: the single phases)",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="also write the results here")
def bench_gpu_share(json_path: Path | None, **opts: Any) -> None:
    """GPU time per tenant: a small tenant beside one that fills the GPU, weights 1:1 and 3:1 (needs a GPU)."""
    from app.bench.gpu_share import GpuShareConfig
    from app.bench.gpu_share import bench_gpu_share as run

    raise SystemExit(run(GpuShareConfig(**opts), json_path))


@bench.command("parking")
@click.option("--rounds", type=int, default=5, show_default=True)
def bench_parking(rounds: int) -> None:
    """Parked CUDA contexts (driver checkpoint) against new forked workers (needs a GPU)."""
    from app.bench.parking import bench_parking as run

    raise SystemExit(run(Namespace(rounds=rounds)))


@bench.command("async", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench_async(args: tuple[str, ...]) -> None:
    """Async submit-to-start latency, queue throughput and stream delay (--help for its options)."""
    from app.bench.async_queue import main as run

    raise SystemExit(run(list(args)))
