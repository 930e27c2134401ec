"""gpulet_common.kube_lazy: kubernetes-asyncio without its generated models, and the
library's ordinary API still whole for whoever asks for it."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, resource, sys
import gpulet_common.kubeapi
loaded = {m: m in sys.modules for m in (
    "kubernetes_asyncio.client.models.v1_pod", "kubernetes_asyncio.client.api.core_v1_api",
    "kubernetes_asyncio.watch", "kubernetes_asyncio.config.kube_config",
    "kubernetes_asyncio.client.api_client")}
rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
# The ordinary API, asked for by name: the package's own __init__ runs then.
import kubernetes_asyncio
from kubernetes_asyncio import client, config
ordinary = [
    client.CoreV1Api.__name__, client.V1Pod.__name__, config.load_kube_config.__name__,
    kubernetes_asyncio.watch.Watch.__name__,
    client.ApiClient is sys.modules["kubernetes_asyncio.client.api_client"].ApiClient,
]
rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"loaded": loaded, "ordinary": ordinary,
                  "saved_mb": (rss_after - rss_before) / 1024}))
"""


def test_the_models_stay_out_until_asked_for_and_then_all_is_there() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["loaded"] == {
        "kubernetes_asyncio.client.models.v1_pod": False,
        "kubernetes_asyncio.client.api.core_v1_api": False,
        "kubernetes_asyncio.watch": False,
        "kubernetes_asyncio.config.kube_config": True,
        "kubernetes_asyncio.client.api_client": True,
    }
    assert out["ordinary"] == ["CoreV1Api", "V1Pod", "load_kube_config", "Watch", True]
    # What the lazy import kept out, loaded on demand here: tens of MB.
    assert out["saved_mb"] > 20, out
