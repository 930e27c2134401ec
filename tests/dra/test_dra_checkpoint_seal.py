"""The DRA plugin's checkpoint is sealed as the ledger's is: damage is never read as
fewer (or other) prepared claims, a deep file never stops the plugin, and an older
gpulet's unsealed file still loads.

A checkpoint that fails its seal is kept aside and the plugin starts empty: kubelet's
next Prepare of each claim re-reads it and the ledger answers by its UID (the
rebuild; tests/dra/test_dra_kubelet_plugin.py drives that path).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from gpulet_allocator.kubelet.dra.checkpoint import (
    CheckpointFile,
    PreparedClaim,
    PreparedDevice,
    decode_claims,
)


def claims() -> dict[str, PreparedClaim]:
    out = {}
    for n in range(3):
        uid = f"0b8e3c1e-0000-4000-8000-00000000000{n}"
        out[uid] = PreparedClaim(
            uid=uid,
            namespace="default",
            name=f"c{n}",
            allocation=uid,
            devices=[
                PreparedDevice(
                    requests=["gpu"],
                    pool="node-a",
                    device=f"gpu-{n}",
                    cdi_ids=[f"k8s.gpu.gpulet.io/claim={uid}-gpu-{n}"],
                )
            ],
        )
    return out


def written(tmp_path: Path) -> CheckpointFile:
    store = CheckpointFile(tmp_path / "dra-checkpoint.json")
    for claim in claims().values():
        store.remember(claim)
    assert store.flush()
    return store


def test_every_bit_flipped_and_every_cut_is_exact_or_refused(tmp_path: Path) -> None:
    """Each case decodes to the claims as written or is refused (the file kept aside,
    the plugin empty: the next test shows that part on disk)."""
    data = written(tmp_path).path.read_bytes()
    wrong: list[str] = []
    cases = [data[:n] for n in range(len(data))]
    damaged = bytearray(data)
    for bit in range(len(data) * 8):
        damaged[bit // 8] ^= 1 << (bit % 8)
        cases.append(bytes(damaged))
        damaged[bit // 8] ^= 1 << (bit % 8)
    for case in cases:
        try:
            loaded = decode_claims(case)
        except ValueError:
            continue
        if loaded != claims():
            wrong.append(f"{len(loaded)} claims from {case[:60]!r}")
    assert wrong == []


def test_a_damaged_file_is_kept_aside_and_the_plugin_starts_empty(tmp_path: Path) -> None:
    store = written(tmp_path)
    data = bytearray(store.path.read_bytes())
    at = data.index(b'"c1"') + 2
    data[at] ^= 0x01  # "c1" -> "c0": a name changed, the JSON still valid
    store.path.write_bytes(bytes(data))
    again = CheckpointFile(store.path)
    again.load()
    assert again.claims == {}
    [kept] = tmp_path.glob("dra-checkpoint.json.corrupt-*")
    assert kept.read_bytes() == bytes(data)


def test_a_deep_file_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    path = tmp_path / "dra-checkpoint.json"
    path.write_text('{"claims": {}, "x": ' + "[" * 10_000 + "]" * 10_000 + "}")
    store = CheckpointFile(path)
    store.load()
    assert store.claims == {}
    assert list(tmp_path.glob("dra-checkpoint.json.corrupt-*"))


def test_an_older_unsealed_file_loads_and_the_next_write_seals_it(tmp_path: Path) -> None:
    path = tmp_path / "dra-checkpoint.json"
    old = msgspec.json.encode({"schema_version": 1, "claims": msgspec.to_builtins(claims())})
    path.write_bytes(old)
    store = CheckpointFile(path)
    store.load()
    assert store.claims == claims()
    store.forget(next(iter(claims())))
    assert store.flush()
    assert b'"checksum":"' in path.read_bytes()
    again = CheckpointFile(path)
    again.load()
    assert len(again.claims) == 2
