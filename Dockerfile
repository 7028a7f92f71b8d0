# TensorWasm api + worker image.
#   CPU image:   docker build -t tensorwasm:cpu .             (the default target; docker-compose.yml)
#   CUDA image:  docker build --target cuda -t tensorwasm:cuda .   (deploy/k8s names tensorwasm:cuda)
# Workers run in the same container as the api process (they are its child processes).

# ---- the application source, shared by both images ---------------------------------------------
FROM scratch AS src
COPY pyproject.toml setup.py uv.lock README.md alembic.ini /app/
COPY app /app/app
COPY kernels /app/kernels
COPY migrations /app/migrations
COPY examples /app/examples

# ---- CPU --------------------------------------------------------------------------------------
FROM python:3.12-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    TENSORWASM_HOST=0.0.0.0 TENSORWASM_PORT=8080 TENSORWASM_DATA_DIR=/var/lib/tensorwasm
WORKDIR /app
COPY --from=src /app /app
# dependencies exactly as locked in uv.lock (hash-checked), then the app itself as a wheel
RUN pip install --no-cache-dir uv && uv export --frozen --no-emit-project -o /tmp/requirements.txt \
    && pip install --no-cache-dir --require-hashes -r /tmp/requirements.txt && pip install --no-cache-dir --no-deps . \
    && pip uninstall -y uv && useradd --system --uid 10001 tensorwasm \
    && mkdir -p /var/lib/tensorwasm && chown tensorwasm /var/lib/tensorwasm
USER tensorwasm
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz')"
CMD ["tensorwasm", "serve"]

# ---- CUDA: the same app on the CUDA runtime with CuPy ---------------------------------------
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04 AS cuda
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    TENSORWASM_HOST=0.0.0.0 TENSORWASM_PORT=8080 TENSORWASM_DATA_DIR=/var/lib/tensorwasm \
    TENSORWASM_BACKEND=cuda PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
WORKDIR /app
COPY --from=src /app /app
RUN pip install --no-cache-dir uv && uv export --frozen --no-emit-project --extra gpu -o /tmp/requirements.txt \
    && pip install --no-cache-dir --require-hashes -r /tmp/requirements.txt && pip install --no-cache-dir --no-deps . \
    && pip uninstall -y uv && useradd --system --uid 10001 tensorwasm \
    && mkdir -p /var/lib/tensorwasm && chown tensorwasm /var/lib/tensorwasm
USER tensorwasm
EXPOSE 8080
CMD ["tensorwasm", "serve"]

# the default target (last stage): the CPU image
FROM base AS cpu
