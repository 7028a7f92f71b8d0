"""Benchmarks (`tensorwasm bench ...`). Each figure is printed beside a baseline the project does not
shape (a bare FastAPI app, raw CuPy), measured in the same run, as a ratio."""

from __future__ import annotations

import argparse


def main(args: argparse.Namespace) -> int:
    if args.bench_cmd == "invoke":
        from app.bench.invoke import bench_invoke

        return bench_invoke(args)
    if args.bench_cmd == "parking":
        from app.bench.parking import bench_parking

        return bench_parking(args)
    from app.gpu.bench import bench_gpu

    return bench_gpu(args)
