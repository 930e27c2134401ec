"""``gpulet health remediation`` and ``gpulet health clear --retired`` as an operator
runs them, against a real nats-server holding the node's ``gpulet_heal`` bucket as the
allocator's remediation by reset writes it."""

from __future__ import annotations

import json
import sys

import anyio
import pytest

from gpulet_common.bus import Bus
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.heal import (
    FAULT_HISTORY,
    HEAL_KV_BUCKET,
    HEAL_RECORD,
    FaultHistory,
    HealRecord,
    heal_key,
    history_key,
)
from gpulet_common.settings.nats import NatsSettings

pytestmark = pytest.mark.anyio

NODE = "node-h"
G3 = "GPU-33333333-3333-3333-3333-333333333333"
G5 = "GPU-55555555-5555-5555-5555-555555555555"


async def gpulet(*args: str) -> tuple[int, str, str]:
    result = await anyio.run_process([sys.executable, "-m", "gpulet", *args], check=False)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_machines_shown_and_a_retirement_cleared(nats_server: EmbeddedNats) -> None:
    where = ("--nats", nats_server.url, "--node", NODE)
    # No bucket yet: nothing remediated, said plainly.
    code, out, err = await gpulet("health", "remediation", *where)
    assert code == 0, err
    assert "no GPU has been remediated by reset" in out
    async with Bus.connect(NatsSettings(url=nats_server.url), name="writer") as bus:
        kv = await bus.key_value(HEAL_KV_BUCKET)
        returned = HealRecord(
            gpu_uuid=G3,
            gpu_index=3,
            state="returned",
            cause="xid:79 (XID 79 GPU_HAS_FALLEN_OFF_THE_BUS [RESTART_BM])",
            resets=1,
            steps=["quarantined@1.000: xid:79", "returned@40.000: verified"],
        )
        retired = HealRecord(
            gpu_uuid=G5, gpu_index=5, state="retired", detail="RMA candidate: 2 failed resets"
        )
        await kv.put(heal_key(NODE, G3), HEAL_RECORD.encode(returned))
        await kv.put(heal_key(NODE, G5), HEAL_RECORD.encode(retired))
        history = FaultHistory(
            gpu_uuid=G5, retired=True, retired_reason="RMA candidate: 2 failed resets"
        )
        history.add("fault", 1.0)
        history.add("reset_failed", 2.0)
        history.add("reset_failed", 3.0)
        await kv.put(history_key(NODE, G5), FAULT_HISTORY.encode(history))
        await kv.put(heal_key(NODE, "GPU-bad"), b"{not json")

        code, out, err = await gpulet("health", "remediation", *where)
        assert code == 0, err
        assert f"GPU 3 {G3}: returned" in out
        assert "returned@40.000: verified" in out
        assert f"GPU 5 {G5}: retired" in out
        assert "history: 1 fatal fault(s), 0 reset(s), 2 failed; RETIRED: RMA candidate" in out
        assert "unreadable: node-h.machine.GPU-bad" in out
        code, out, _ = await gpulet("health", "remediation", "--gpu", "5", "--json", *where)
        doc = json.loads(out)
        assert [m["state"] for m in doc["machines"]] == ["returned", "retired"]
        code, out, _ = await gpulet("health", "remediation", "--gpu", "5", *where)
        assert G3 not in out

        code, out, err = await gpulet("health", "clear", "--retired", "--gpu", "5", *where)
        assert code == 0, err
        assert f"GPU {G5}: retirement cleared by operator" in out
        entry = await kv.get(history_key(NODE, G5))
        cleared = FAULT_HISTORY.decode(entry.value or b"")
        assert not cleared.retired
        assert [e.kind for e in cleared.entries][:3] == ["fault", "reset_failed", "reset_failed"]
        # Not retired any more; a GPU never remediated: refused, said.
        code, _, err = await gpulet("health", "clear", "--retired", "--gpu", G5, *where)
        assert code == 1
        assert "is not retired" in err
        code, _, err = await gpulet("health", "clear", "--retired", "--gpu", "7", *where)
        assert code == 1
        assert "no remediation record names GPU 7" in err
