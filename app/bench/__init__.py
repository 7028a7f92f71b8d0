"""Benchmarks (`tensorwasm bench ...`). Each figure is printed beside a baseline the project does not
shape (a bare FastAPI app, raw CuPy), measured in the same run, as a ratio."""

