#!/usr/bin/env bash
# gpulet's container images, with podman (or docker where a Docker engine runs).
#
#   scripts/image.sh build          the gpulet image ($IMAGE) and the NATS sidecar image
#                                   ($NATS_IMAGE), both from the one Dockerfile
#   scripts/image.sh base           prints the base image the build uses (making it first
#                                   when it is the Debian one below)
#   scripts/image.sh env            prints the environment podman needs here (KEY=VALUE
#                                   lines; the pod test reads them)
#   scripts/image.sh podman ARGS    runs podman with that environment
#
# `make image` runs `build`; tests/image/test_image_pod.py runs `build`, `env` and podman
# with the same settings, so what the test plays is what `make image` built.
#
# The base image (build argument BASE_IMAGE): python:3.11-slim by default. Where no
# container registry can be reached, the build makes a Debian bookworm base itself,
# from Debian's own packages, with debootstrap (`--variant=minbase`, plus python3 and
# python3-venv: Debian's Python 3.11), imports it as $DEBIAN_BASE and keeps it: later
# builds on the same machine reuse it. Either base gives the same layout (Dockerfile).
#   BASE_IMAGE=auto (default)  python:3.11-slim when the engine has it or can pull it,
#                              else the Debian base (reused once made)
#   BASE_IMAGE=debootstrap     the Debian base, whatever the registries
#   BASE_IMAGE=<image>         that image (a Debian-like one with python3 and venv)
#
# podman settings, in a containers.conf the script writes under build/podman/ and names
# by CONTAINERS_CONF (nothing in /etc changes):
#   [containers] default_ulimits = []   a container may not be given RLIMIT_NOFILE on
#                                       every machine (not here: "operation not permitted")
#   [engine] cgroup_manager = "cgroupfs"   no systemd to manage cgroups
#   [engine] runtime = "runc"           when runc is installed (crun refuses a hybrid
#                                       cgroup layout)
# and `--network host` for builds (a build's RUN steps reach the package registries
# the way the host does).
#
# The host's CA bundle for pip goes into the build only when the host's pip configures
# one ($PIP_CERT, or `cert` in pip's configuration files): as the build secret
# `pip-ca`, never as a layer. Machines whose TLS to the registries passes through a
# custom CA need it; elsewhere the build runs without.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${IMAGE:-gpulet:dev}
NATS_IMAGE=${NATS_IMAGE:-gpulet-nats:dev}
BASE_IMAGE=${BASE_IMAGE:-auto}
DEFAULT_BASE=python:3.11-slim
DEBIAN_BASE=${DEBIAN_BASE:-localhost/gpulet-debian-base:bookworm}
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PULL_TIMEOUT_S=${PULL_TIMEOUT_S:-120}
STATE_DIR="$ROOT/build/podman"

say() { printf 'image.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# --- engine ------------------------------------------------------------------------

engine() {
  if [ -n "${ENGINE:-}" ]; then
    echo "$ENGINE"
  elif command -v podman >/dev/null 2>&1; then
    echo podman
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    echo docker
  else
    die "no container engine: install podman (apt-get install podman buildah runc debootstrap) or start Docker"
  fi
}

podman_conf() {
  mkdir -p "$STATE_DIR"
  local conf="$STATE_DIR/containers.conf" tmp
  tmp=$(mktemp "$STATE_DIR/.containers.conf.XXXXXX")
  {
    echo "# Written by scripts/image.sh; see there why."
    echo "[containers]"
    echo "default_ulimits = []"
    echo "[engine]"
    echo 'cgroup_manager = "cgroupfs"'
    if command -v runc >/dev/null 2>&1; then echo 'runtime = "runc"'; fi
  } >"$tmp"
  mv "$tmp" "$conf"
  echo "$conf"
}

# Every engine command below goes through run_engine, with podman's settings.
run_engine() {
  if [ "$ENGINE_BIN" = podman ]; then
    CONTAINERS_CONF=$(podman_conf) podman "$@"
  else
    "$ENGINE_BIN" "$@"
  fi
}

has_image() { run_engine image inspect "$1" >/dev/null 2>&1; }

# --- pip's CA ------------------------------------------------------------------------

pip_ca() {
  # $PIP_CERT first, then `cert` from pip's configuration (global, user, site files).
  local ca=${PIP_CERT:-} pip
  if [ -z "$ca" ]; then
    for pip in "${PYTHON:-python3} -m pip" pip3 pip; do
      if $pip --version >/dev/null 2>&1; then
        ca=$($pip config list 2>/dev/null | sed -n "s/^[^=]*\.cert='\(.*\)'\$/\1/p" | head -n1)
        break
      fi
    done
  fi
  if [ -n "$ca" ] && [ -f "$ca" ]; then echo "$ca"; fi
}

# --- base image ----------------------------------------------------------------------

debian_base() {
  if has_image "$DEBIAN_BASE"; then
    echo "$DEBIAN_BASE"
    return
  fi
  command -v debootstrap >/dev/null 2>&1 \
    || die "debootstrap is missing (apt-get install debootstrap): it makes the Debian base image"
  local sudo="" rootfs
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/gpulet-rootfs.XXXXXX")
  # shellcheck disable=SC2064
  trap "$sudo rm -rf '$rootfs'" EXIT
  say "making $DEBIAN_BASE: debootstrap --variant=minbase $DEBIAN_SUITE (python3, python3-venv) from $DEBIAN_MIRROR"
  local started=$SECONDS
  $sudo debootstrap --variant=minbase --include=python3,python3-venv \
    "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" >"$STATE_DIR/debootstrap.log" 2>&1 \
    || { tail -n 20 "$STATE_DIR/debootstrap.log" >&2; die "debootstrap failed (log: $STATE_DIR/debootstrap.log)"; }
  # What a slim image leaves out: downloaded packages, package lists, documentation.
  $sudo rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/*
  $sudo tar --numeric-owner -C "$rootfs" -c . | run_engine import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase --include=python3,python3-venv $DEBIAN_SUITE" \
    - "$DEBIAN_BASE" >/dev/null
  $sudo rm -rf "$rootfs"
  trap - EXIT
  say "made $DEBIAN_BASE in $((SECONDS - started)) s"
  echo "$DEBIAN_BASE"
}

resolve_base() {
  mkdir -p "$STATE_DIR"
  case "$BASE_IMAGE" in
    debootstrap) debian_base ;;
    auto)
      if has_image "$DEFAULT_BASE"; then
        echo "$DEFAULT_BASE"
      elif has_image "$DEBIAN_BASE"; then
        echo "$DEBIAN_BASE"
      elif timeout "$PULL_TIMEOUT_S" env "CONTAINERS_CONF=$(podman_conf)" "$ENGINE_BIN" \
        pull "$DEFAULT_BASE" >/dev/null 2>&1 \
        && has_image "$DEFAULT_BASE"; then
        echo "$DEFAULT_BASE"
      else
        say "cannot pull $DEFAULT_BASE (no registry reachable?): using a Debian base made with debootstrap"
        debian_base
      fi
      ;;
    *) echo "$BASE_IMAGE" ;;
  esac
}

# --- build ---------------------------------------------------------------------------

build() {
  local e=$ENGINE_BIN base ca started=$SECONDS
  base=$(resolve_base)
  local args=(build --network host --build-arg "BASE_IMAGE=$base" --file "$ROOT/Dockerfile")
  if [ "$e" = podman ] && command -v runc >/dev/null 2>&1; then args+=(--runtime runc); fi
  ca=$(pip_ca)
  if [ -n "$ca" ]; then
    say "pip's CA bundle for the build: $ca"
    args+=(--secret "id=pip-ca,src=$ca")
  fi
  say "building $IMAGE and $NATS_IMAGE with $e from $base"
  run_engine "${args[@]}" --target gpulet --tag "$IMAGE" "$ROOT"
  run_engine "${args[@]}" --target nats --tag "$NATS_IMAGE" "$ROOT"
  say "built $IMAGE and $NATS_IMAGE in $((SECONDS - started)) s"
  # Untagged images a day old (earlier builds' layers): the build cache stays, the
  # disk does not fill up over many builds.
  run_engine image prune --force --filter until=24h >/dev/null 2>&1 || true
  run_engine images --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E "(^|/)(${IMAGE%%:*}|${NATS_IMAGE%%:*}):" >&2 || true
}

ENGINE_BIN=$(engine)
case "${1:-}" in
  build) build ;;
  base) resolve_base ;;
  env) [ "$ENGINE_BIN" != podman ] || echo "CONTAINERS_CONF=$(podman_conf)" ;;
  podman) shift; CONTAINERS_CONF=$(podman_conf) exec podman "$@" ;;
  *) die "usage: $0 build|base|env|podman ARGS..." ;;
esac
