#!/usr/bin/env bash
# Build the CPU image from the project's Dockerfile, run it, and check /readyz, a deploy and an
# invoke, on a machine with no Docker daemon and no container registry.
#
#   sudo deploy/image-smoke.sh            (root: debootstrap and buildah's chroot need it)
#   deploy/image-smoke.sh --print-base    the images from outside the Dockerfile its target needs
#
# How: buildah (chroot isolation, vfs storage, host network) builds the Dockerfile unchanged.
# No registry is reachable, so the Dockerfile's base image is made here: a minimal Debian
# bookworm from Debian's mirror (debootstrap) with Python in a venv on PATH, so `python` and
# `pip` behave as in the official python image, and with this host's CA certificates, so pip
# inside the build reaches PyPI exactly as the host's pip does. The bootstrapped tree is cached
# in $TENSORWASM_SMOKE_CACHE. The image then runs with `buildah run` (no daemon either).
#
# Environment: TENSORWASM_SMOKE_CACHE (default /var/cache/tensorwasm-image-smoke),
# TENSORWASM_SMOKE_STORAGE (buildah storage, default /var/lib/tensorwasm-image-smoke),
# DEBIAN_MIRROR (default http://deb.debian.org/debian), TENSORWASM_SMOKE_KEEP=1 keeps the built
# image, TENSORWASM_SMOKE_TARGET (default: the Dockerfile's default target, the CPU image).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

CACHE=${TENSORWASM_SMOKE_CACHE:-/var/cache/tensorwasm-image-smoke}
STORAGE=${TENSORWASM_SMOKE_STORAGE:-/var/lib/tensorwasm-image-smoke}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
IMAGE=localhost/tensorwasm:image-smoke
TARGET=${TENSORWASM_SMOKE_TARGET:-}
STARTED=$SECONDS

say() { echo "image-smoke: $*"; }
die() { echo "image-smoke: FAILED: $*" >&2; exit 1; }

# A private storage root with the vfs driver: works on any filesystem (no overlay or fuse) and
# never mixes with another buildah or podman configuration on the machine.
BAH=(buildah --root "$STORAGE/root" --runroot "$STORAGE/run" --storage-driver vfs)
bah() { "${BAH[@]}" "$@"; }
# a working container from an image; its ID (names can collide between runs)
new_container() {
    local cid
    cid=$(mktemp)
    bah from --pull=never --cidfile "$cid" "$1" >/dev/null || { rm -f "$cid"; return 1; }
    cat "$cid"
    rm -f "$cid"
}

# ---- which images from outside the Dockerfile its target needs ---------------------------------
# The stages the target (default: the last stage) needs, through FROM and COPY --from, and the
# images they name that are not stages: those would come from a registry.
EXTERNAL=$(python3 - "$ROOT/Dockerfile" "$TARGET" <<'EOF_PY'
import re, sys
stages, order, uses = {}, [], {}
current = None
for line in open(sys.argv[1]):
    if m := re.match(r"\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", line, re.I):
        current = (m.group(2) or str(len(order))).lower()
        stages[current] = m.group(1)
        order.append(current)
        uses[current] = [m.group(1)]
    elif current and (m := re.match(r"\s*COPY\s+.*--from=(\S+)", line, re.I)):
        uses[current].append(m.group(1))
target = (sys.argv[2] or order[-1]).lower()
if target not in stages:
    sys.exit(f"the Dockerfile has no stage {target!r}")
need, todo, external = set(), [target], []
while todo:
    name = todo.pop()
    if name in need:
        continue
    need.add(name)
    for ref in uses[name]:
        if ref.lower() in stages:
            todo.append(ref.lower())
        elif ref != "scratch" and ref not in external:
            external.append(ref)
print("\n".join(external))
EOF_PY
) || die "could not read the Dockerfile's stages"
if [ "${1:-}" = --print-base ]; then
    echo "$EXTERNAL"
    exit 0
fi
BASE=$EXTERNAL
[ -n "$BASE" ] || die "the Dockerfile's target needs no base image; nothing to make"
[ "$(echo "$BASE" | wc -l)" = 1 ] || die "the target needs several images from a registry: $(echo "$BASE" | paste -sd' ' -)"
case "$BASE" in
    python:*) ;;
    *) die "the target needs $BASE from a registry; only a python:* base can be made here" ;;
esac

[ "$(id -u)" = 0 ] || die "run as root (debootstrap and buildah's chroot isolation need it)"

# ---- tools ------------------------------------------------------------------------------------
missing=()
for tool in buildah:buildah debootstrap:debootstrap curl:curl; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them"
    say "installing ${missing[*]}"
    apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "could not install ${missing[*]}"
fi
mkdir -p "$CACHE" "$STORAGE"
say "the Dockerfile's target builds on $BASE, which is made here"

# ---- the base image: debootstrap bookworm + Python in a venv on PATH -----------------------------
# Made again (from the cached tree: seconds) whenever this host's CA bundle has changed.
[ -s /etc/ssl/certs/ca-certificates.crt ] || die "this host has no /etc/ssl/certs/ca-certificates.crt to copy in"
ca_sha=$(sha256sum /etc/ssl/certs/ca-certificates.crt | cut -d' ' -f1)
base_ca=$(bah inspect --type image "localhost/$BASE" 2>/dev/null | python3 -c \
    'import json, sys; print((json.load(sys.stdin)["OCIv1"]["config"].get("Labels") or {}).get("tensorwasm.smoke.ca-sha256", ""))' \
    2>/dev/null || true)
if [ "$base_ca" != "$ca_sha" ]; then
    bah rmi -f "localhost/$BASE" "docker.io/library/$BASE" >/dev/null 2>&1 || true
    rootfs_tar="$CACHE/$SUITE-minbase-python.tar"
    if [ ! -s "$rootfs_tar" ]; then
        say "bootstrapping Debian $SUITE from $MIRROR (cached in $rootfs_tar)"
        tmp=$(mktemp -d "$CACHE/rootfs.XXXXXX")
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            "$SUITE" "$tmp" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
            || { rm -rf "$tmp"; die "debootstrap failed; see $CACHE/debootstrap.log"; }
        rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/*
        tar -C "$tmp" -cf "$rootfs_tar.part" . && mv "$rootfs_tar.part" "$rootfs_tar"
        rm -rf "$tmp"
    fi
    say "committing the base image $BASE"
    ctr=$(new_container scratch)
    mnt=$(bah mount "$ctr")
    tar -C "$mnt" -xf "$rootfs_tar"
    # this host's trust store, so TLS inside the build trusts what the host trusts
    cp /etc/ssl/certs/ca-certificates.crt "$mnt/etc/ssl/certs/ca-certificates.crt"
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$mnt/etc/pip.conf"
    bah umount "$ctr" >/dev/null
    bah config --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
        --label "tensorwasm.smoke.ca-sha256=$ca_sha" --cmd python3 "$ctr"
    bah run --isolation chroot --network host "$ctr" -- /usr/bin/python3 -m venv /opt/python \
        || die "could not create the base image's Python venv"
    bah commit -q "$ctr" "localhost/$BASE" >/dev/null
    bah tag "localhost/$BASE" "docker.io/library/$BASE"
    bah rm "$ctr" >/dev/null
fi

# ---- build the Dockerfile unchanged -----------------------------------------------------------
say "building $IMAGE from the Dockerfile${TARGET:+ (target $TARGET)}"
bah rmi -f "$IMAGE" >/dev/null 2>&1 || true  # a previous run's image (and its containers)
build_log="$CACHE/build.log"
if ! bah build --isolation chroot --network host --pull=never --layers=false \
    ${TARGET:+--target "$TARGET"} -t "$IMAGE" -f Dockerfile . >"$build_log" 2>&1; then
    tail -n 40 "$build_log" >&2
    die "the image build failed (full log: $build_log)"
fi

# ---- run it --------------------------------------------------------------------------------
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
TOKEN="twadmin_smoke_$(python3 -c 'import secrets; print(secrets.token_hex(8))')"
URL="http://127.0.0.1:$PORT"
ctr=$(new_container "$IMAGE") || die "could not create a container from $IMAGE"
server_log="$CACHE/server.log"
server_pid=
cleanup() {
    if [ -n "$server_pid" ]; then
        # the whole process group: buildah, its chroot helper, the server and its workers
        kill -TERM -- "-$server_pid" 2>/dev/null || true
        for _ in $(seq 150); do kill -0 -- "-$server_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    local removed=
    for _ in 1 2 3 4 5; do
        if bah rm "$ctr" >/dev/null 2>&1; then removed=1; break; fi
        sleep 1
    done
    [ -n "$removed" ] || echo "image-smoke: warning: could not remove working container $ctr" >&2
    if [ "${TENSORWASM_SMOKE_KEEP:-0}" != 1 ]; then
        # -f: the build can leave its last stage's working container behind
        bah rmi -f "$IMAGE" >/dev/null 2>&1 || echo "image-smoke: warning: could not remove $IMAGE" >&2
    fi
    bah rmi --prune >/dev/null 2>&1 || true  # untagged leftovers of earlier runs
}
trap cleanup EXIT

# the image's own CMD, run as its own USER, with the listen address and admin token for the test
mapfile -t cmd < <(bah inspect --type image "$IMAGE" \
    | python3 -c 'import json, sys; print("\n".join(json.load(sys.stdin)["OCIv1"]["config"].get("Cmd") or []))')
[ ${#cmd[@]} -gt 0 ] || die "the image has no CMD"
say "starting the image's command (${cmd[*]}) on $URL"
setsid "${BAH[@]}" run --isolation chroot --network host "$ctr" -- \
    env TENSORWASM_HOST=127.0.0.1 TENSORWASM_PORT="$PORT" TENSORWASM_ADMIN_TOKEN="$TOKEN" \
    TENSORWASM_BACKEND=cpu "${cmd[@]}" >"$server_log" 2>&1 &
server_pid=$!

ready=
for _ in $(seq 240); do
    if ! kill -0 "$server_pid" 2>/dev/null; then
        tail -n 40 "$server_log" >&2
        die "the container exited before it was ready (log: $server_log)"
    fi
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/readyz")" = 200 ]; then ready=1; break; fi
    sleep 0.5
done
[ -n "$ready" ] || { tail -n 40 "$server_log" >&2; die "/readyz did not answer 200 within 120 s"; }
say "/readyz: 200"

# the HTTP checks: an operator creates a tenant and a key; the tenant deploys echo and invokes it
api() {  # api METHOD PATH EXPECTED_STATUS [curl args...]: prints the body, fails on another status
    local method=$1 path=$2 want=$3 out code
    shift 3
    out=$(mktemp)
    code=$(curl -s -o "$out" -w '%{http_code}' -X "$method" "$URL$path" "$@") || code=000
    if [ "$code" != "$want" ]; then
        echo "$method $path: HTTP $code, expected $want: $(cat "$out")" >&2
        rm -f "$out"
        tail -n 20 "$server_log" >&2
        die "$method $path answered $code"
    fi
    cat "$out"
    rm -f "$out"
}
field() { python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }

tenant=$(api POST /v1/admin/tenants 201 -H "Authorization: Bearer $TOKEN" \
    -H 'Content-Type: application/json' -d '{"name": "smoke"}' | field id)
key=$(api POST "/v1/admin/tenants/$tenant/api-keys" 201 -H "Authorization: Bearer $TOKEN" | field key)

# examples/echo.wat to wasm with the image's own wasmtime
wasm=$(mktemp)
bah run --isolation chroot "$ctr" -- python -c \
    'import sys, wasmtime; sys.stdout.buffer.write(wasmtime.wat2wasm(sys.stdin.read()))' \
    <"$ROOT/examples/echo.wat" >"$wasm" || die "could not convert examples/echo.wat inside the image"
api PUT /v1/functions/echo 201 -H "Authorization: Bearer $key" -H 'Content-Type: application/wasm' \
    --data-binary "@$wasm" >/dev/null
rm -f "$wasm"
say "deploy: 201"
reply=$(api POST /v1/functions/echo/invoke 200 -H "Authorization: Bearer $key" -d 'hello from the image')
[ "$reply" = 'hello from the image' ] || die "invoke answered '$reply', expected the request body back"
say "invoke: 200, echoed the body"

say "OK: built, ran, /readyz, deploy and invoke in $((SECONDS - STARTED)) s"
