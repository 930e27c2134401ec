"""kv_keys lists a KV bucket's keys from the stream's subject list (no consumer).

nats-py's ``KeyValue.keys()`` can answer ``NoKeysError`` for a bucket that holds keys
when the machine is loaded (its ordered consumer ends the listing before its callback
ran); the health service read its previous state that way. See bus/jetstream.py.
"""

from __future__ import annotations

import nats.js.errors
import pytest

from gpulet_common.bus import Bus, kv_keys
from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.settings.nats import NatsSettings

pytestmark = pytest.mark.anyio

BUCKET = "kv_keys_test"


async def test_keys_by_prefix_with_deleted_ones_named(nats_server: EmbeddedNats) -> None:
    async with Bus.connect(NatsSettings(url=nats_server.url)) as bus:
        kv = await bus.key_value(BUCKET)
        assert await kv_keys(bus.jetstream, BUCKET) == []
        for key in ("node-a.GPU-1", "node-a.GPU-2", "node-ab.GPU-3", "node-b.GPU-4"):
            await kv.put(key, b"{}")
        await kv.put("node-a.GPU-1", b'{"v": 2}')  # a second revision: still one key
        await kv.delete("node-a.GPU-2")
        assert await kv_keys(bus.jetstream, BUCKET) == [
            "node-a.GPU-1",
            "node-a.GPU-2",
            "node-ab.GPU-3",
            "node-b.GPU-4",
        ]
        # A whole-token prefix: node-a's keys, not node-ab's.
        mine = await kv_keys(bus.jetstream, BUCKET, "node-a.")
        assert mine == ["node-a.GPU-1", "node-a.GPU-2"]
        # The deleted key is named; its get says so (the callers skip it).
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("node-a.GPU-2")
        assert (await kv.get("node-a.GPU-1")).value == b'{"v": 2}'
