"""XIDs from the kernel log: a second source beside NVML events.

Why
---
NVML's event wait only sees XIDs that happen while the agent waits. The NVIDIA driver
also writes every XID to the kernel log (``NVRM: Xid (PCI:0000:3b:00): 79, pid=...,
GPU has fallen off the bus.``), and the kernel keeps a ring buffer of it: reading
``/dev/kmsg`` from its start gives back XIDs from while the agent was down (a restart,
a pod replacement, a crash loop). GPUd reads XIDs only this way.

Design
------
* :func:`parse_record` turns one ``/dev/kmsg`` record (``prio,seq,usec,flags;text``
  plus continuation lines) into a :class:`KmsgXid`, or None for anything else. It is
  total: a malformed, huge or binary record is None, never an exception.
* :class:`KmsgReader` reads records on a worker thread (``/dev/kmsg`` is opened
  non-blocking; at the end of the buffer it waits ``poll_s`` and reads on). A plain
  file works too (tests write a fake kmsg): it is read line by line from where the
  last read stopped. A record that was overwritten before we read it (``EPIPE``) is
  skipped, as ``dmesg`` does.
* **Reported once.** The kernel's record sequence numbers order the log; the highest
  one handed on is kept in the state directory with the boot id
  (``/proc/sys/kernel/random/boot_id``). After a restart in the same boot, records up to
  it are skipped, so an XID from the ring buffer is reported once, not once per start;
  after a reboot the buffer is new and everything in it counts.
* **De-duplicated against NVML.** The same XID on the same GPU usually arrives from
  both sources within milliseconds. :class:`CrossSourceDedup` lets the first source
  through and drops the other source's copy within ``dedup_window_s``; repeats from
  one source are real repeats and pass.
* The GPU is found by its PCI address (domain, bus, device) in the inventory. A record
  for a PCI address the node does not know is counted and dropped.
* Without access (no ``/dev/kmsg`` in the container, or ``dmesg_restrict`` without
  CAP_SYSLOG) the check runs degraded: the status board's ``health.kmsg`` component says
  why, and NVML events remain the source of XIDs.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from gpulet_common.logutil import RateLimitedLog
from gpulet_common.safefile import write_atomic

log = logging.getLogger("gpulet.health.kmsg")
# Once per kmsg record handed on while the cursor cannot be saved: rate-limited.
_cursor_log = RateLimitedLog(log, per_minute=2)

MAX_RECORD_BYTES = 8192  # the kernel's own limit for one /dev/kmsg record
_HEADER = re.compile(r"^(\d{1,3}),(\d{1,20}),(\d{1,20}),[^;]{0,64};")
_XID = re.compile(
    r"NVRM: Xid \(PCI:(?:([0-9A-Fa-f]{1,8}):)?([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})"
    r"(?:\.[0-7])?\): (\d{1,5})\b,?\s?(.{0,400})"
)


@dataclass(frozen=True, slots=True)
class KmsgXid:
    seq: int
    # Microseconds since boot (CLOCK_MONOTONIC) when the kernel logged it.
    usec: int
    pci: tuple[int, int, int]
    xid: int
    detail: str


def pci_key(bus_id: str) -> tuple[int, int, int] | None:
    """``00000000:3B:00.0`` (NVML) or ``0000:3b:00`` (kernel) to (domain, bus, device)."""
    parts = bus_id.strip().split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        return None
    try:
        return int(parts[0], 16), int(parts[1], 16), int(parts[2].split(".")[0], 16)
    except ValueError:
        return None


def parse_record(record: str) -> KmsgXid | None:
    """One kmsg record to an XID, or None when it is not an XID record (never raises)."""
    if len(record) > MAX_RECORD_BYTES:
        return None
    header = _HEADER.match(record)
    if header is None:
        return None
    text = record[header.end() :].split("\n", 1)[0]
    found = _XID.search(text)
    if found is None:
        return None
    domain, bus, device, xid, detail = found.groups()
    try:
        pci = (int(domain or "0", 16), int(bus, 16), int(device, 16))
        return KmsgXid(
            seq=int(header.group(2)),
            usec=int(header.group(3)),
            pci=pci,
            xid=int(xid),
            detail=detail.strip(),
        )
    except ValueError:
        return None


class CrossSourceDedup:
    """Drops the second source's copy of one (GPU, XID) seen within ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._seen: dict[tuple[str, int], tuple[str, float]] = {}

    def admit(self, source: str, uuid: str, xid: int, now: float) -> bool:
        key = (uuid, xid)
        last = self._seen.get(key)
        if last is not None and last[0] != source and now - last[1] <= self._window_s:
            return False
        self._seen[key] = (source, now)
        if len(self._seen) > 4096:
            cutoff = now - self._window_s
            self._seen = {k: v for k, v in self._seen.items() if v[1] >= cutoff}
        return True


class Cursor:
    """The last kmsg sequence number handed on, per boot, kept in the state directory."""

    def __init__(self, path: Path, boot_id: str) -> None:
        self._path = path
        self.boot_id = boot_id
        self.seq = -1
        try:
            saved_boot, saved_seq = path.read_text().split()
            if saved_boot == boot_id:
                self.seq = int(saved_seq)
        except (OSError, ValueError):
            pass  # no cursor yet, another boot's, or unreadable: read the whole buffer

    def advance(self, seq: int) -> None:
        if seq <= self.seq:
            return
        self.seq = seq
        try:
            # Not fsync'd: a cursor lost in a crash costs XIDs reported twice, not lost.
            write_atomic(self._path, f"{self.boot_id} {seq}\n".encode(), durable=False)
        except OSError as exc:
            _cursor_log.warning("cannot save the kmsg cursor %s: %s", self._path, exc)


def boot_wall_time() -> float:
    """Wall-clock time of boot, to turn kmsg's microseconds since boot into a time."""
    return time.time() - time.monotonic()


class KmsgReader:
    """Reads XID records from ``path``; :meth:`poll` is blocking, call it off the loop."""

    def __init__(self, path: str, cursor: Cursor) -> None:
        self.path = path
        self._cursor = cursor
        self._fd: int | None = None
        self._is_device = False
        self._pending = ""
        self.skipped_records = 0  # overwritten before we read them (EPIPE)

    def open(self) -> None:
        """Raises OSError (saying why) when the log cannot be read."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._is_device = stat.S_ISCHR(os.fstat(fd).st_mode)
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def poll(self, limit: int = 256) -> list[KmsgXid]:
        """The XIDs logged since the last call (after the cursor), at most ``limit`` records."""
        if self._fd is None:
            raise OSError(errno.EBADF, "kmsg reader not open")
        out: list[KmsgXid] = []
        for record in self._records(limit):
            xid = parse_record(record)
            if xid is None or xid.seq <= self._cursor.seq:
                continue
            out.append(xid)
        return out

    def commit(self, seq: int) -> None:
        self._cursor.advance(seq)

    def _records(self, limit: int) -> list[str]:
        assert self._fd is not None
        records: list[str] = []
        while len(records) < limit:
            try:
                chunk = os.read(self._fd, MAX_RECORD_BYTES)
            except BlockingIOError:
                break  # the end of the buffer for now
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    self.skipped_records += 1
                    continue
                raise
            if not chunk:
                break  # a plain file at its end
            text = chunk.decode("utf-8", errors="replace")
            if self._is_device:
                records.append(text)  # /dev/kmsg returns exactly one record per read
                continue
            text = self._pending + text
            lines = text.split("\n")
            self._pending = lines.pop()  # a line not ended yet waits for the next read
            if len(self._pending) > MAX_RECORD_BYTES:
                self._pending = ""
            records.extend(line for line in lines if line and not line.startswith(" "))
        return records
