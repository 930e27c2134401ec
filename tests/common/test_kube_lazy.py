"""gpulet_common.kube_lazy: kubernetes-asyncio without its generated models, and the
library's ordinary API still whole for whoever asks for it."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import gpulet_common.kubeapi
loaded = {m: m in sys.modules for m in (
    "kubernetes_asyncio.client.models.v1_pod", "kubernetes_asyncio.client.api.core_v1_api",
    "kubernetes_asyncio.watch", "kubernetes_asyncio.config.kube_config",
    "kubernetes_asyncio.client.api_client")}
modules_before = len(sys.modules)
# The ordinary API, asked for by name: the package's own __init__ runs then.
import kubernetes_asyncio
from kubernetes_asyncio import client, config
ordinary = [
    client.CoreV1Api.__name__, client.V1Pod.__name__, config.load_kube_config.__name__,
    kubernetes_asyncio.watch.Watch.__name__,
    client.ApiClient is sys.modules["kubernetes_asyncio.client.api_client"].ApiClient,
]
modules_after = len(sys.modules)
print(json.dumps({"loaded": loaded, "ordinary": ordinary,
                  "kept_out": modules_after - modules_before}))
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
    # What the lazy import kept out, loaded on demand here: the ~700 generated models and
    # APIs (about 36 MB of RSS; bench/pod_footprint.py measures the processes).
    assert out["kept_out"] > 700, out
