"""`tensorwasm` command line: serve, migrate, admin tasks, openapi, benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from app.settings import REPO_ROOT, get_settings


def _serve(args: argparse.Namespace) -> int:
    from app.db.migrate import upgrade
    from app.node.serve import serve
    from app.observability.logging import configure_logging

    settings = get_settings()
    configure_logging(settings)
    settings.ensure_data_dir()
    upgrade(settings.resolved_database_url)
    return serve(settings, args.host or settings.host, args.port or settings.port)


def _migrate(args: argparse.Namespace) -> int:
    from app.db.migrate import downgrade, upgrade

    settings = get_settings()
    settings.ensure_data_dir()
    if args.down:
        downgrade(settings.resolved_database_url, args.revision or "base")
    else:
        upgrade(settings.resolved_database_url, args.revision or "head")
    print("database is at", args.revision or ("base" if args.down else "head"))
    return 0


def _openapi(args: argparse.Namespace) -> int:
    from app.main import create_app

    text = json.dumps(create_app().openapi(), indent=2, sort_keys=False) + "\n"
    path = REPO_ROOT / "openapi.json"
    if args.check:
        if not path.exists() or path.read_text() != text:
            print("openapi.json is stale: run `tensorwasm openapi`", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


async def _admin(args: argparse.Namespace) -> int:
    from app.api.errors import ApiError
    from app.api.schemas import QuotaUpdate, TenantCreate
    from app.db.migrate import upgrade
    from app.db.session import create_engine_for, create_sessionmaker
    from app.services.api_keys import ApiKeyService
    from app.services.tenants import TenantService

    settings = get_settings()
    settings.ensure_data_dir()
    upgrade(settings.resolved_database_url)
    engine = create_engine_for(settings.resolved_database_url)
    try:
        async with create_sessionmaker(engine)() as session:
            tenants = TenantService(session, settings)

            async def tenant_id(ref: str) -> str:
                t = await tenants.repo.get(ref) or await tenants.repo.get_by_name(ref)
                if t is None:
                    raise ApiError(404, "not_found", f"no tenant {ref!r}")
                return t.id

            quota = {k: v for k, v in vars(args).items() if k in QuotaUpdate.model_fields and v is not None}
            if args.admin_cmd == "create-tenant":
                t = await tenants.create(TenantCreate(name=args.name, quota=QuotaUpdate(**quota) if quota else None))
                result = {"id": t.id, "name": t.name}
            elif args.admin_cmd == "set-quota":
                t = await tenants.replace_quota(await tenant_id(args.tenant), QuotaUpdate(**quota))
                result = {"id": t.id, "name": t.name, **quota}
            else:
                row, key = await ApiKeyService(session).create(await tenant_id(args.tenant))
                result = {"id": row.id, "key": key}
            await session.commit()
        print(json.dumps(result, indent=2))
        return 0
    except ApiError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await engine.dispose()


def _quota_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory-bytes", dest="gpu_memory_bytes", type=int)
    p.add_argument("--max-concurrency", dest="max_concurrency", type=int)
    p.add_argument("--requests-per-second", dest="requests_per_second", type=float)
    p.add_argument("--max-functions", dest="max_functions", type=int)
    p.add_argument("--max-module-bytes", dest="max_module_bytes", type=int)
    p.add_argument("--wasm-memory-bytes", dest="wasm_memory_bytes", type=int)
    p.add_argument("--timeout-ms", dest="timeout_ms", type=int)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tensorwasm", description="TensorWasm server and tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve", help="migrate the database and serve the API")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p = sub.add_parser("migrate", help="run database migrations")
    p.add_argument("--down", action="store_true", help="downgrade instead (default to base)")
    p.add_argument("--revision")
    p = sub.add_parser("openapi", help="regenerate openapi.json")
    p.add_argument("--check", action="store_true", help="fail if openapi.json is stale")
    adm = sub.add_parser("admin", help="operator tasks without curl").add_subparsers(dest="admin_cmd", required=True)
    p = adm.add_parser("create-tenant")
    p.add_argument("name")
    _quota_flags(p)
    p = adm.add_parser("set-quota", help="replace a tenant's quota (omitted fields take defaults)")
    p.add_argument("tenant", help="tenant id or name")
    _quota_flags(p)
    p = adm.add_parser("create-key")
    p.add_argument("tenant", help="tenant id or name")
    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_cmd", required=True)
    p = b.add_parser("invoke", help="invoke latency, throughput and goodput under wrk, against a bare FastAPI echo app")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each wrk run")
    p.add_argument("--processes", type=int, default=0, help="node and baseline processes (default: min(cores, 8))")
    p.add_argument("--workers", type=int, default=8, help="the node's TENSORWASM_MAX_WORKERS")
    p.add_argument("--quota-concurrency", type=int, default=8, help="max_concurrency of the tenant that floods")
    p.add_argument("--json", action="store_true", help="also print every wrk result as JSON")
    p = b.add_parser("gpu", help="guest GPU paths against raw CuPy (needs a GPU)")
    p = b.add_parser("parking", help="parked CUDA contexts (driver checkpoint) against new forked workers (needs a GPU)")
    p.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    if args.cmd == "serve":
        return _serve(args)
    if args.cmd == "migrate":
        return _migrate(args)
    if args.cmd == "openapi":
        return _openapi(args)
    if args.cmd == "admin":
        return asyncio.run(_admin(args))
    if args.cmd == "bench":
        from app import bench

        return bench.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
