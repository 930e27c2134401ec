"""bench/dra.py's fake kubelet and scheduler, in a process of their own (as on a node).

Run by ``bench/dra.py`` (the default ``--topology node``), not by hand. It registers
the DRA plugin over its real sockets (:func:`support.fake_dra_kubelet.registered`),
then for each call does what the scheduler and kubelet would: creates a
ResourceClaim in the API server its kubeconfig names (a POST, with gpulet's own
client), writes its allocation (a PUT of the claim's ``status`` subresource, one whole
GPU), times ``NodePrepareResources`` (the clock
started right before the call and stopped at its answer), then unprepares the claim
and deletes it. With ``--handshake`` (the plugin reads claims from its watch cache)
it writes ``wait`` after the allocation and ``gone`` after the delete on stdout and
reads a line from stdin before going on: the bench's process answers once its cache
has (or has dropped) the claim, as it has by the time kubelet prepares a pod's claim.
Last, it writes one JSON line: ``{"timings": [seconds, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gpulet_common.kube import from_kubeconfig
from gpulet_common.kubeapi import KubeClient
from support.fake_dra_kubelet import FakeDraKubelet, registered

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
TIMEOUT_S = 10.0
SPEC = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}}


async def allocate(api: KubeClient, name: str, result: dict[str, str]) -> str:
    """The claim created, then allocated through ``/status``: its UID."""
    body = {"metadata": {"name": name}, "spec": SPEC}
    claim = await api.create(CLAIMS, body, timeout_s=TIMEOUT_S)
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    await api.replace(f"{CLAIMS}/{name}/status", claim, timeout_s=TIMEOUT_S)
    return str(claim["metadata"]["uid"])


async def prepare_once(kubelet: FakeDraKubelet, uid: str, name: str) -> float:
    """One timed ``NodePrepareResources`` of claim ``default/<name>`` (the clock started
    right before the call, stopped at its answer), then its Unprepare (not timed)."""
    started = time.perf_counter()
    answer = await kubelet.prepare(("default", uid, name))
    took = time.perf_counter() - started
    if answer.claims[uid].error:
        raise SystemExit(f"prepare failed: {answer.claims[uid].error}")
    await kubelet.unprepare(("default", uid, name))
    return took


async def handshake(stdin: anyio.AsyncFile[str], word: str) -> None:
    print(word, flush=True)
    with anyio.fail_after(10):
        if not await stdin.readline():
            raise SystemExit("the bench closed stdin")


async def run(args: argparse.Namespace) -> None:
    names = args.names.split(",")
    stdin = anyio.wrap_file(sys.stdin)
    timings: list[float] = []
    async with (
        KubeClient(await from_kubeconfig(args.kubeconfig)) as api,
        registered(Path(args.registry), args.driver) as kubelet,
    ):
        for i in range(args.calls):
            name = f"c{i}"
            result = {
                "request": "gpu",
                "driver": args.driver,
                "pool": args.pool,
                "device": names[i % len(names)],
            }
            uid = await allocate(api, name, result)
            if args.handshake:
                await handshake(stdin, "wait")
            timings.append(await prepare_once(kubelet, uid, name))
            await api.delete(f"{CLAIMS}/{name}", timeout_s=TIMEOUT_S)
            if args.handshake:
                await handshake(stdin, "gone")
    print(json.dumps({"timings": timings}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", required=True, help="kubelet's plugins_registry dir")
    parser.add_argument("--kubeconfig", required=True, help="the API server's kubeconfig")
    parser.add_argument("--driver", required=True)
    parser.add_argument("--pool", required=True)
    parser.add_argument("--names", required=True, help="device names, comma-separated")
    parser.add_argument("--calls", type=int, required=True)
    parser.add_argument("--handshake", action="store_true")
    anyio.run(run, parser.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
