#!/bin/sh
# Give each node its own fleet credential (docs/fleet.md, "Getting each node its
# credential"). For each NODE: issue (or rotate) its credential from the store, put it
# in the Secret gpulet-leaf-<node>, run the Job that copies it onto that node only
# (deploy/fleet/node-creds-job.yaml), wait for it, then delete the Secret.
#
#   deploy/fleet/provision-node-creds.sh --store ./gpulet-fleet NODE...
#   deploy/fleet/provision-node-creds.sh --store ./gpulet-fleet \
#       $(kubectl get nodes -l nvidia.com/gpu.present=true -o name | cut -d/ -f2)
#
# After a rotation run `gpulet fleet push` (the old key is revoked then; the node
# reconnects with the new file).
set -eu
STORE=./gpulet-fleet
if [ "${1:-}" = "--store" ]; then STORE=$2; shift 2; fi
[ $# -gt 0 ] || { echo "usage: $0 [--store DIR] NODE..." >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for NODE in "$@"; do
  # A Kubernetes object name for the node: lower case, dots kept, at most 63 chars.
  NODE_ID=$(printf '%s' "$NODE" | tr 'A-Z_' 'a-z-' | cut -c1-50)
  gpulet fleet creds --store "$STORE" --node "$NODE" --out "$TMP/node.creds"
  kubectl -n gpulet-system delete secret "gpulet-leaf-$NODE_ID" --ignore-not-found
  kubectl -n gpulet-system create secret generic "gpulet-leaf-$NODE_ID" \
    --from-file=node.creds="$TMP/node.creds"
  rm -f "$TMP/node.creds"
  kubectl -n gpulet-system delete job "gpulet-leaf-creds-$NODE_ID" --ignore-not-found
  sed -e "s/NODE_ID/$NODE_ID/g" -e "s/nodeName: NODE/nodeName: $NODE/" \
    "$HERE/node-creds-job.yaml" | kubectl apply -f -
  kubectl -n gpulet-system wait --for=condition=complete --timeout=300s \
    "job/gpulet-leaf-creds-$NODE_ID"
  kubectl -n gpulet-system delete secret "gpulet-leaf-$NODE_ID"
  echo "node $NODE: credential installed"
done
