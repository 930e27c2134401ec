#!/bin/sh
# Build the Go kubelet stand-in: bench/kubelet_load/build.sh OUTPUT
# Needs Go and grpc-go from Debian: apt-get install -y golang-go golang-google-grpc-dev
# (GOPATH mode against /usr/share/gocode; no go.mod, no network).
set -eu
out=${1:?usage: build.sh OUTPUT}
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "${GOCACHE:-}" ] && [ -z "${HOME:-}" ] && [ -z "${XDG_CACHE_HOME:-}" ]; then
  export GOCACHE=/tmp/gpulet-bench-go-build
fi
GO111MODULE=off GOPATH=/usr/share/gocode CGO_ENABLED=0 \
  exec go build -trimpath -o "$out" "$here/main.go"
