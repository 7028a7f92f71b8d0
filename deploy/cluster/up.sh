#!/usr/bin/env bash
# A TensorWasm cluster on this machine: CLUSTER_NODES `tensorwasm serve` nodes sharing one
# PostgreSQL database, behind nginx routing each API key to one node (a consistent hash of the
# Authorization header). Runs in the foreground; Ctrl-C (or SIGTERM) stops nginx and every node.
#
#   TENSORWASM_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/tensorwasm \
#   TENSORWASM_ADMIN_TOKEN=$(openssl rand -hex 24) deploy/cluster/up.sh
#
# Environment:
#   TENSORWASM_DATABASE_URL  required, a PostgreSQL URL (the database must exist; it is migrated here)
#   TENSORWASM_ADMIN_TOKEN   required: every node must share one
#   TENSORWASM_SECRETS_KEY   the key sealing tenants' secrets, which every node must share
#                            (default: one generated once into CLUSTER_DIR/secrets_key, 0600,
#                            and read from there on later runs)
#   CLUSTER_NODES            nodes to start (default 2)
#   CLUSTER_LISTEN           nginx's address (default 127.0.0.1:8080)
#   CLUSTER_NODE_PORTS       the nodes' ports, space-separated (default 8081, 8082, ...), on 127.0.0.1
#   CLUSTER_DIR              state (default ./.cluster): node-N/ (data dir, serve.log), nginx/
#                            (nginx.conf, error.log), `nodes` (one line per node: name port pid)
#                            and `ready` (written once nginx and every node answer)
#   CLUSTER_SERVE            the command that runs tensorwasm (default: tensorwasm)
#   CLUSTER_FAIL_TIMEOUT     seconds nginx skips a node that failed (default 10)
# Every other TENSORWASM_* variable reaches every node (e.g. TENSORWASM_PROCESSES,
# TENSORWASM_MAX_WORKERS). Each node's own: TENSORWASM_PORT, TENSORWASM_HOST=127.0.0.1,
# TENSORWASM_DATA_DIR and TENSORWASM_NODE_ID (node-N).
set -euo pipefail

die() { echo "cluster: $*" >&2; exit 1; }
say() { echo "cluster: $*"; }

: "${TENSORWASM_DATABASE_URL:?set TENSORWASM_DATABASE_URL to a PostgreSQL database the nodes share}"
: "${TENSORWASM_ADMIN_TOKEN:?set TENSORWASM_ADMIN_TOKEN: every node must share one admin token}"
case "$TENSORWASM_DATABASE_URL" in
    postgresql*|postgres:*) ;;
    *) die "TENSORWASM_DATABASE_URL must be PostgreSQL: SQLite serves one node only" ;;
esac
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$NGINX" ] || die "nginx is not installed (Debian/Ubuntu: apt-get install nginx)"

NODES=${CLUSTER_NODES:-2}
LISTEN=${CLUSTER_LISTEN:-127.0.0.1:8080}
DIR=$(mkdir -p "${CLUSTER_DIR:-.cluster}" && cd "${CLUSTER_DIR:-.cluster}" && pwd)
read -r -a SERVE <<<"${CLUSTER_SERVE:-tensorwasm}"
read -r -a PORTS <<<"${CLUSTER_NODE_PORTS:-}"
if [ ${#PORTS[@]} -eq 0 ]; then
    for i in $(seq "$NODES"); do PORTS+=($((8080 + i))); done
fi
[ ${#PORTS[@]} -eq "$NODES" ] || die "CLUSTER_NODE_PORTS names ${#PORTS[@]} ports for $NODES nodes"
if [ -z "${TENSORWASM_SECRETS_KEY:-}" ]; then
    # each node would otherwise generate a key of its own into its data dir, and no node could
    # open the secrets another sealed
    if [ ! -s "$DIR/secrets_key" ] && [ -s "$DIR/node-1/secrets_key" ]; then
        # a cluster dir from before the nodes shared a key: node-1's key goes on opening what
        # node-1 sealed (what another node sealed with its own key stays sealed: set it again)
        (umask 077 && cp "$DIR/node-1/secrets_key" "$DIR/secrets_key")
        say "the nodes now share node-1's secrets key ($DIR/secrets_key)"
    elif [ ! -s "$DIR/secrets_key" ]; then
        (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' >"$DIR/secrets_key")
        say "generated the nodes' secrets key into $DIR/secrets_key (keep it with the database's backups)"
    fi
    TENSORWASM_SECRETS_KEY=$(cat "$DIR/secrets_key")
fi
export TENSORWASM_DATABASE_URL TENSORWASM_ADMIN_TOKEN TENSORWASM_SECRETS_KEY

pids=()
nginx_pid=
stop() {
    trap - INT TERM EXIT
    [ -n "$nginx_pid" ] && kill -TERM "$nginx_pid" 2>/dev/null
    # each node is a process group of its own (setsid): its workers go with it
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
        for _ in $(seq 100); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    [ -n "$nginx_pid" ] && wait "$nginx_pid" 2>/dev/null
    rm -f "$DIR/ready"
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

wait_http() {  # wait_http URL SECONDS WHAT PID: until URL answers 200
    python3 - "$@" <<'EOF_PY'
import os, sys, time, urllib.request
url, limit, what, pid = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(f"cluster: {what} exited during its start")
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.2)
sys.exit(f"cluster: {what} did not answer {url} within {limit:g} s")
EOF_PY
}

rm -f "$DIR/ready" "$DIR/nodes"
say "migrating the database"
"${SERVE[@]}" migrate >"$DIR/migrate.log" 2>&1 || { cat "$DIR/migrate.log" >&2; die "the migration failed"; }

servers=""
for i in $(seq "$NODES"); do
    name=node-$i
    port=${PORTS[$((i - 1))]}
    mkdir -p "$DIR/$name"
    TENSORWASM_NODE_ID=$name TENSORWASM_DATA_DIR="$DIR/$name" TENSORWASM_HOST=127.0.0.1 TENSORWASM_PORT=$port \
        setsid "${SERVE[@]}" serve >"$DIR/$name/serve.log" 2>&1 &
    pids+=($!)
    echo "$name $port $!" >>"$DIR/nodes"
    servers+="        server 127.0.0.1:$port max_fails=1 fail_timeout=${CLUSTER_FAIL_TIMEOUT:-10}s;"$'\n'
done
for i in $(seq "$NODES"); do
    wait_http "http://127.0.0.1:${PORTS[$((i - 1))]}/readyz" 120 "node-$i" "${pids[$((i - 1))]}" \
        || { tail -n 30 "$DIR/node-$i/serve.log" >&2; exit 1; }
    say "node-$i ready on 127.0.0.1:${PORTS[$((i - 1))]} (log: $DIR/node-$i/serve.log)"
done

mkdir -p "$DIR/nginx/tmp"
template="$(dirname "$0")/nginx.conf.template"
python3 - "$template" "$DIR/nginx/nginx.conf" "$DIR/nginx" "$LISTEN" "$servers" <<'EOF_PY'
import sys
template, out, d, listen, servers = sys.argv[1:]
text = open(template).read().replace("@DIR@", d).replace("@LISTEN@", listen).replace("@SERVERS@\n", servers)
open(out, "w").write(text)
EOF_PY
"$NGINX" -t -q -p "$DIR/nginx" -c "$DIR/nginx/nginx.conf" -e "$DIR/nginx/error.log" || die "nginx refused its configuration"
"$NGINX" -p "$DIR/nginx" -c "$DIR/nginx/nginx.conf" -e "$DIR/nginx/error.log" -g 'daemon off;' &
nginx_pid=$!
wait_http "http://$LISTEN/healthz" 30 nginx "$nginx_pid" || { tail -n 20 "$DIR/nginx/error.log" >&2; exit 1; }
touch "$DIR/ready"
say "ready: http://$LISTEN ($NODES nodes; state in $DIR)"
wait "$nginx_pid"
