"""MIG devices through DRA on the real control plane (issue 27).

``gpulet run`` in ``dra.mode=dra`` on the mock's ``a100-mig-mixed`` node (GPUs 0 and 1
MIG-enabled with 7 MIG devices between them, GPU 2 MIG-enabled without instances, GPU 3
MIG disabled) publishes its slices to the real kube-apiserver; deploy/'s DeviceClasses
are applied as they are (``mig.gpulet.io`` among them). The real kube-scheduler
allocates:

* a claim for a ``1g.5gb`` MIG device through ``mig.gpulet.io`` gets one of GPU 0's two,
  and the fake kubelet's Prepare gets a CDI spec with its MIG UUID and its parent's
  device node; a third such claim (there are two) stays unschedulable;
* a claim for a whole GPU gets GPU 3, the only one in the pool; a claim for a whole GPU
  by a MIG-enabled parent's UUID stays unschedulable: a parent is never allocated whole.

Run alone (it starts its own agent and Node): ``pytest tests/kube/test_dra_mig_real.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kube.test_dra_real import (
    DRIVER,
    DraNode,
    Scheduled,
    assert_ours,
    cel,
    claim_template,
    dra_node_on,
    exactly,
    prepare,
    spec_env,
    unprepare,
)

from gpulet_common.dra import cdi
from support.control_plane import ControlPlane
from support.waiting import wait_until

pytestmark = pytest.mark.anyio

# The scenario's pool: 7 MIG devices and GPU 3.
DEVICES = 8


@pytest.fixture(scope="module")
def mig_node(
    kube_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DraNode]:
    with dra_node_on(
        kube_cluster, tmp_path_factory, scenario="a100-mig-mixed", devices=DEVICES
    ) as dra:
        yield dra


def by_profile(profile: str) -> dict[str, Any]:
    return claim_template(
        "mig",
        {
            "requests": [
                exactly(
                    "mig",
                    "mig.gpulet.io",
                    selectors=[cel(f"device.attributes['{DRIVER}'].profile == '{profile}'")],
                )
            ]
        },
    )


async def test_the_pool_has_mig_devices_and_gpu_3_only(mig_node: DraNode) -> None:
    devices = mig_node.devices()
    whole = sorted(n for n, d in devices.items() if d["attributes"]["type"]["string"] == "gpu")
    assert whole == ["gpu-3"]
    migs = [d for d in devices.values() if d["attributes"]["type"]["string"] == "mig"]
    assert len(migs) == 7
    parents = {d["attributes"]["parentUUID"]["string"] for d in migs}
    assert devices["gpu-3"]["attributes"]["uuid"]["string"] not in parents


async def test_a_claim_for_a_profile_gets_a_mig_device_and_prepares_it(mig_node: DraNode) -> None:
    dra = mig_node
    pods = [Scheduled(dra, by_profile("1g.5gb")) for _ in range(3)]
    try:
        first = await pods[0].wait_bound()
        second = await pods[1].wait_bound()
        await wait_until(
            pods[2].unschedulable, timeout_s=60, interval_s=0.1, what="a third 1g.5gb claim"
        )
        names = [assert_ours(dra, c, 1)[0] for c in (first, second)]
        assert sorted(names) == ["gpu-0-mig-1g5gb-3-0", "gpu-0-mig-1g5gb-4-0"]
        device = dra.devices()[names[0]]
        uid = first["metadata"]["uid"]
        assert await prepare(dra, first) == [cdi.device_id(DRIVER, uid, names[0])]
        env = spec_env(dra, first)
        assert env["NVIDIA_VISIBLE_DEVICES"] == device["attributes"]["uuid"]["string"]
        spec = json.loads(cdi.spec_file(dra.cdi_dir, DRIVER, uid).read_text())
        [entry] = spec["devices"]
        assert entry["containerEdits"]["deviceNodes"][0]["path"] == "/dev/nvidia0"
        await unprepare(dra, first)
    finally:
        for pod in pods:
            pod.delete()


async def test_a_mig_enabled_gpu_is_never_allocated_whole(mig_node: DraNode) -> None:
    dra = mig_node
    parent = next(
        d["attributes"]["parentUUID"]["string"]
        for d in dra.devices().values()
        if d["attributes"]["type"]["string"] == "mig"
    )
    on_parent = Scheduled(
        dra,
        claim_template(
            "parent",
            {
                "requests": [
                    exactly(
                        "gpu",
                        "gpu.gpulet.io",
                        selectors=[cel(f"device.attributes['{DRIVER}'].uuid == '{parent}'")],
                    )
                ]
            },
        ),
    )
    any_gpu = Scheduled(dra, claim_template("any", {"requests": [exactly("gpu", "gpu.gpulet.io")]}))
    try:
        claim = await any_gpu.wait_bound()
        assert assert_ours(dra, claim, 1) == ["gpu-3"]
        await wait_until(
            on_parent.unschedulable, timeout_s=60, interval_s=0.1, what="the parent's claim"
        )
    finally:
        on_parent.delete()
        any_gpu.delete()
