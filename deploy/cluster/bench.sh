#!/usr/bin/env bash
# Throughput of a cluster through nginx: 1 node, then 2 nodes (deploy/cluster/up.sh each time,
# on a fresh PostgreSQL database), the same wrk load with BENCH_TENANTS tenants' keys in turn
# (spread evenly over the nodes: keys are made until nginx's hash puts as many on each), and the
# ratio.
#
#   BENCH_POSTGRES=postgresql://postgres@127.0.0.1:5432/postgres deploy/cluster/bench.sh
#
# Environment: BENCH_POSTGRES (a PostgreSQL URL whose user may create databases; required),
# BENCH_GUEST (a .wat, default tests/guests/sleep_echo.wat: 100 ms per call, so a node's
# capacity is its workers, not this machine's cores), BENCH_TENANTS (8), BENCH_CONNECTIONS (64),
# BENCH_SECONDS (15), BENCH_NODES ("1 2"). Every TENSORWASM_* and CLUSTER_* variable reaches
# up.sh (e.g. TENSORWASM_MAX_WORKERS, default 8 here; CLUSTER_SERVE).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${BENCH_POSTGRES:?set BENCH_POSTGRES to a PostgreSQL URL that may create databases}"
command -v wrk >/dev/null || { echo "bench: wrk is needed (apt-get install wrk)" >&2; exit 1; }
GUEST=${BENCH_GUEST:-tests/guests/sleep_echo.wat}
TENANTS=${BENCH_TENANTS:-8}
CONNECTIONS=${BENCH_CONNECTIONS:-64}
SECONDS_=${BENCH_SECONDS:-15}
export TENSORWASM_MAX_WORKERS=${TENSORWASM_MAX_WORKERS:-8}
export TENSORWASM_ADMIN_TOKEN=${TENSORWASM_ADMIN_TOKEN:-bench-$RANDOM$RANDOM}
export TENSORWASM_ACCESS_LOG=${TENSORWASM_ACCESS_LOG:-false}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tensorwasm-bench.XXXXXX")
up_pid=
cleanup() { [ -n "$up_pid" ] && kill -TERM "$up_pid" 2>/dev/null && wait "$up_pid" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT

db() {  # db create|drop NAME: prints the database's URL on create
    python3 - "$BENCH_POSTGRES" "$@" <<'EOF_PY'
import sys
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
base, action, name = sys.argv[1:]
url = make_url(base).set(drivername="postgresql+psycopg")
engine = create_engine(url, isolation_level="AUTOCOMMIT")
with engine.connect() as c:
    c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    if action == "create":
        c.execute(text(f'CREATE DATABASE "{name}"'))
        print(url.set(database=name).render_as_string(hide_password=False))
EOF_PY
}

cat >"$WORK/rotate.lua" <<'EOF_LUA'
-- each request with the next tenant's key, in turn; replies counted by status
local keys, i = {}, 0
function init(args) keys = args; i = math.random(#keys); ok = 0; other = 0; s429 = 0; s503 = 0 end
function request()
  i = i % #keys + 1
  return wrk.format("POST", nil, {["Authorization"] = "Bearer " .. keys[i]}, "bench")
end
function response(status)
  if status == 200 then ok = ok + 1 else other = other + 1 end
  if status == 429 then s429 = s429 + 1 elseif status == 503 then s503 = s503 + 1 end
end
local threads = {}
function setup(thread) table.insert(threads, thread) end
function done(summary)
  local o, x, a, b = 0, 0, 0, 0
  for _, t in ipairs(threads) do o = o + t:get("ok"); x = x + t:get("other"); a = a + t:get("s429"); b = b + t:get("s503") end
  io.write(string.format("BENCH ok=%d other=%d (429: %d, 503: %d) errors=%d rps=%.1f\n", o, x, a, b,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    o / (summary.duration / 1e6)))
end
EOF_LUA

declare -A rps
for n in ${BENCH_NODES:-1 2}; do
    name=tw_bench_$$_$n
    url=$(db create "$name")
    listen=127.0.0.1:$((18000 + RANDOM % 1000))
    ports=""
    for i in $(seq "$n"); do ports+="$((19000 + RANDOM % 1000 + i * 1000)) "; done
    TENSORWASM_DATABASE_URL=$url CLUSTER_NODES=$n CLUSTER_LISTEN=$listen CLUSTER_NODE_PORTS="$ports" \
        CLUSTER_DIR="$WORK/cluster-$n" deploy/cluster/up.sh >"$WORK/up-$n.log" 2>&1 &
    up_pid=$!
    for _ in $(seq 300); do [ -f "$WORK/cluster-$n/ready" ] && break; sleep 0.2; done
    [ -f "$WORK/cluster-$n/ready" ] || { cat "$WORK/up-$n.log" >&2; exit 1; }
    # tenants spread evenly: keys are made until each node holds TENANTS/n of them (nginx names
    # the node that answered in X-TensorWasm-Node); the rest are not used
    keys=$(python3 - "http://$listen" "$GUEST" "$TENANTS" "$n" <<'EOF_PY'
import collections, os, sys, uuid, httpx, wasmtime
url, guest, want, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
admin = {"Authorization": f"Bearer {os.environ['TENSORWASM_ADMIN_TOKEN']}"}
wasm = bytes(wasmtime.wat2wasm(open(guest).read()))
per_node = -(-want // nodes)
keys, on = [], collections.Counter()
with httpx.Client(base_url=url, timeout=60) as c:
    for _ in range(50 * want):
        if len(keys) == per_node * nodes:
            break
        tid = c.post("/v1/admin/tenants", json={"name": f"b-{uuid.uuid4().hex[:8]}"}, headers=admin).json()["id"]
        key = c.post(f"/v1/admin/tenants/{tid}/api-keys", headers=admin).json()["key"]
        r = c.put("/v1/functions/f", content=wasm, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/wasm"})
        assert r.status_code == 201, r.text
        node = r.headers.get("x-tensorwasm-node", "").split(", ")[-1]
        if on[node] < per_node:
            on[node] += 1
            keys.append(key)
    assert len(keys) == per_node * nodes and len(on) == nodes, f"could not spread {want} tenants over {nodes} nodes: {dict(on)}"
print(" ".join(keys))
EOF_PY
)
    # shellcheck disable=SC2086
    wrk -t2 -c"$CONNECTIONS" -d3s -s "$WORK/rotate.lua" "http://$listen/v1/functions/f/invoke" -- $keys >/dev/null  # warm-up
    # shellcheck disable=SC2086
    out=$(wrk -t2 -c"$CONNECTIONS" -d"${SECONDS_}s" -s "$WORK/rotate.lua" "http://$listen/v1/functions/f/invoke" -- $keys)
    line=$(echo "$out" | grep '^BENCH')
    echo "$n node(s): $line"
    rps[$n]=$(echo "$line" | sed 's/.*rps=//')
    kill -TERM "$up_pid"; wait "$up_pid" 2>/dev/null || true; up_pid=
    db drop "$name" >/dev/null
done
if [ -n "${rps[1]:-}" ] && [ -n "${rps[2]:-}" ]; then
    python3 -c "import sys; print(f'2 nodes / 1 node: {float(sys.argv[2]) / float(sys.argv[1]):.2f}x')" "${rps[1]}" "${rps[2]}"
fi
