"""XIDs from the kernel log: parsing, reading, once-only reporting and de-duplication.

The service-level tests write a fake kmsg (a plain file in /dev/kmsg's record format)
and point ``health.kmsg.path`` at it; the mock NVML plays the GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulet_common.embedded_nats import EmbeddedNats
from gpulet_common.messages import HealthEvent
from gpulet_health.kmsg import (
    MAX_RECORD_BYTES,
    CrossSourceDedup,
    Cursor,
    KmsgReader,
    parse_record,
    pci_key,
)
from support.health_harness import HealthNode, health_node, until

# The line a real H100 logged for an XID 31 (shared/reference/real-h100.md).
REAL_31 = (
    "3,1771,912345678,-;NVRM: Xid (PCI:0000:00:06): 31, pid=4242, name=python3, Ch 00000008, "
    "intr 00000000. MMU Fault: ENGINE GRAPHICS GPC1 FAULT_PDE ACCESS_TYPE_VIRT_WRITE"
)


def test_parses_the_driver_s_xid_line() -> None:
    xid = parse_record(REAL_31 + "\n SUBSYSTEM=pci\n DEVICE=+pci:0000:00:06.0\n")
    assert xid is not None
    assert (xid.seq, xid.usec, xid.pci, xid.xid) == (1771, 912345678, (0, 0, 6), 31)
    assert xid.detail.startswith("pid=4242, name=python3")


@pytest.mark.parametrize(
    ("text", "pci", "code"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.", (0, 0x3B, 0), 79),
        ("NVRM: Xid (PCI:00000001:C1:00.0): 48, An uncorrectable DBE", (1, 0xC1, 0), 48),
        ("NVRM: Xid (PCI:18:00): 63, pid=1", (0, 0x18, 0), 63),
    ],
)
def test_parses_driver_variants(text: str, pci: tuple[int, int, int], code: int) -> None:
    xid = parse_record(f"4,7,100,-;{text}")
    assert xid is not None
    assert (xid.pci, xid.xid) == (pci, code)


@pytest.mark.parametrize(
    "record",
    [
        "",
        "garbage",
        "6,1,2,-;nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver",
        "6,1,2,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module",
        "6,1,2,-;NVRM: Xid (PCI:zzzz:3b:00): 79, pid=1",
        "6,1,2,-;NVRM: Xid (PCI:0000:3b:00): notanumber",
        "x,1,2,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1",
        "6,1,2,-;NVRM: Xid (PCI:0000:3b:00): 79, " + "A" * MAX_RECORD_BYTES,
        "6,1,2,-;" + "{" * 5000,
        "\x00\xff\ufffd;NVRM: Xid",
    ],
)
def test_anything_else_is_not_an_xid(record: str) -> None:
    assert parse_record(record) is None


@pytest.mark.parametrize(
    ("bus_id", "key"),
    [
        ("00000000:3B:00.0", (0, 0x3B, 0)),
        ("0000:3b:00", (0, 0x3B, 0)),
        ("3b:00", (0, 0x3B, 0)),
        ("00000002:C1:1F.0", (2, 0xC1, 0x1F)),
        ("nonsense", None),
        ("gg:00:00.0", None),
    ],
)
def test_pci_keys_match_across_nvml_and_kernel_spelling(
    bus_id: str, key: tuple[int, int, int] | None
) -> None:
    assert pci_key(bus_id) == key


def test_dedup_lets_the_first_source_through_and_repeats_of_one_source() -> None:
    dedup = CrossSourceDedup(window_s=30)
    assert dedup.admit("nvml", "GPU-a", 79, 100.0)
    assert not dedup.admit("kmsg", "GPU-a", 79, 100.2)  # the same fault, seen twice
    assert dedup.admit("kmsg", "GPU-b", 79, 100.2)  # another GPU
    assert dedup.admit("kmsg", "GPU-a", 48, 100.3)  # another XID
    assert dedup.admit("nvml", "GPU-a", 79, 101.0)  # a real repeat from one source
    assert dedup.admit("kmsg", "GPU-a", 79, 140.0)  # outside the window: a new fault


def test_reader_follows_a_file_and_resumes_after_its_cursor(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(
        "6,1,10,-;usb 1-1: new device\n"
        "3,2,20,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n"
        " SUBSYSTEM=pci\n"
        "3,3,30,-;NVRM: Xid (PCI:0000:3c:00): 48, pid=2"  # not ended yet
    )
    cursor = Cursor(tmp_path / "cursor", "boot-1")
    reader = KmsgReader(str(log), cursor)
    reader.open()
    try:
        [first] = reader.poll()
        assert (first.seq, first.xid) == (2, 79)
        reader.commit(first.seq)
        with log.open("a") as f:
            f.write(", DBE\n")
        [second] = reader.poll()
        assert (second.seq, second.xid) == (3, 48)
        reader.commit(second.seq)
        assert reader.poll() == []
    finally:
        reader.close()
    # The same boot: a new reader skips what was handed on; another boot reads it all.
    again = KmsgReader(str(log), Cursor(tmp_path / "cursor", "boot-1"))
    again.open()
    assert again.poll() == []
    again.close()
    rebooted = KmsgReader(str(log), Cursor(tmp_path / "cursor", "boot-2"))
    rebooted.open()
    assert [x.seq for x in rebooted.poll()] == [2, 3]
    rebooted.close()


def test_a_corrupt_cursor_reads_the_whole_buffer(tmp_path: Path) -> None:
    (tmp_path / "cursor").write_bytes(b"\xff\x00 garbage \n more")
    assert Cursor(tmp_path / "cursor", "boot-1").seq == -1


# --- through the running health service --------------------------------------------------


def _bus_id(h: HealthNode, slot: int) -> str:
    key = pci_key(h.mock.nvmlDeviceGetPciInfo(h.mock.nvmlDeviceGetHandleByIndex(slot)).busId)
    assert key is not None
    return f"{key[0]:04x}:{key[1]:02x}:{key[2]:02x}"


def _xids(h: HealthNode, code: int) -> list[HealthEvent]:
    return h.log.where(lambda e: e.kind == "xid" and e.xid == code)


@pytest.mark.anyio
async def test_an_xid_logged_before_the_agent_started_is_reported_once(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    overrides = [f"health.kmsg.path={kmsg}", "health.kmsg.poll_s=0.05"]
    async with health_node(nats_server.url, tmp_path, overrides=overrides) as h:
        bus_id = _bus_id(h, 2)
    # Logged while no agent runs (seq 5 after unrelated records).
    kmsg.write_text(
        "6,4,1000,-;eth0: link up\n"
        f"3,5,2000,-;NVRM: Xid (PCI:{bus_id}): 79, pid=77, GPU has fallen off the bus.\n"
        " SUBSYSTEM=pci\n"
    )
    async with health_node(nats_server.url, tmp_path, overrides=overrides) as h:
        [event] = await h.log.wait_for(lambda e: e.kind == "xid" and e.xid == 79, within=10)
        assert event.gpu_uuid == h.uuid(2)
        assert not event.healthy
        assert "kernel log" in event.reason
        status = h.runtime.status.get("health.kmsg")
        assert status is not None
        assert status.state == "ready"
        await until(lambda: (tmp_path / "state" / "health-kmsg.cursor").exists(), within=5)
        # Nothing left for the next start to publish again (at-least-once delivery).
        await until(lambda: h.service.buffer.pending == 0, within=5)
    # Restarted in the same boot: the ring buffer still holds the line; not reported again.
    async with health_node(nats_server.url, tmp_path, overrides=overrides) as h:
        await until(lambda: h.runtime.status.get("health.kmsg") is not None, within=5)
        # A later XID in the log is read, so the reader is past the old one by then.
        with kmsg.open("a") as f:
            f.write(f"3,6,3000,-;NVRM: Xid (PCI:{bus_id}): 94, pid=78, contained ECC\n")
        await h.log.wait_for(lambda e: e.kind == "xid" and e.xid == 94, within=10)
        # The only XID 79 a subscriber may see is the same event again (its event_id),
        # never a second report of the line.
        assert {e.event_id for e in _xids(h, 79)} <= {event.event_id}


@pytest.mark.anyio
async def test_an_xid_seen_by_nvml_and_the_kernel_log_is_one_event(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    overrides = [f"health.kmsg.path={kmsg}", "health.kmsg.poll_s=0.05"]
    async with health_node(nats_server.url, tmp_path, overrides=overrides) as h:
        bus_id = _bus_id(h, 1)
        h.inject("xid", gpu=1, value=48)
        await h.log.wait_for(lambda e: e.kind == "xid" and e.xid == 48)
        with kmsg.open("a") as f:
            f.write(f"3,9,5000,-;NVRM: Xid (PCI:{bus_id}): 48, An uncorrectable DBE\n")
            # A marker after it: once the marker is reported, the line above was read.
            f.write(f"3,10,5001,-;NVRM: Xid (PCI:{bus_id}): 13, pid=9, Graphics Exception\n")
        await h.log.wait_for(lambda e: e.kind == "xid" and e.xid == 13, within=10)
        assert len(_xids(h, 48)) == 1


@pytest.mark.anyio
async def test_without_access_the_check_runs_degraded_and_says_why(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-kmsg"
    async with health_node(
        nats_server.url, tmp_path, overrides=[f"health.kmsg.path={missing}"]
    ) as h:
        await until(lambda: h.runtime.status.get("health.kmsg") is not None, within=5)
        status = h.runtime.status.get("health.kmsg")
        assert status is not None
        assert status.state == "degraded"
        assert str(missing) in status.detail
        assert "NVML events only" in status.detail
        # NVML's XIDs still arrive.
        h.inject("xid", gpu=0, value=79)
        await h.log.wait_for(lambda e: e.kind == "xid" and e.xid == 79)
