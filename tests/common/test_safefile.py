"""The one safe writer, and every file gpulet writes going through it.

A symlink planted at a path that gpulet writes -- the file itself, or the fixed
temporary name an earlier version used (``<name>.tmp``) -- must never make gpulet write
into the link's target (issue 23, finding 1). Each writer below is driven the way its
service drives it, with a link planted first; the link's target is then checked byte
for byte.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from gpulet_common.embedded_nats import EmbeddedNats, EmbeddedNatsError
from gpulet_common.messages import GpuInfo, HealthEvent
from gpulet_common.safefile import (
    UnsafePathError,
    ensure_dir,
    open_append,
    open_update,
    write_atomic,
)

PRECIOUS = b"precious: not gpulet's to write\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_bytes(PRECIOUS)
    return victim


def _plant(link: Path, victim: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)


# --- the writer itself --------------------------------------------------------------


def test_write_atomic_writes_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "d" / "state.json"
    write_atomic(target, b"one")
    write_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in target.parent.iterdir()] == ["state.json"]  # no temp left


def test_write_atomic_refuses_a_symlink_target(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    target = tmp_path / "state.json"
    _plant(target, victim)
    with pytest.raises(UnsafePathError, match="symlink"):
        write_atomic(target, b"evil")
    assert victim.read_bytes() == PRECIOUS
    assert target.is_symlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_write_atomic_refuses_a_symlinked_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "state").symlink_to(real)
    with pytest.raises(UnsafePathError, match="symlink"):
        write_atomic(tmp_path / "state" / "x.json", b"evil")
    assert list(real.iterdir()) == []
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UnsafePathError, match="symlink"):
        open_append(tmp_path / "dangling" / "x.log")
    assert not (tmp_path / "nowhere").exists()


def test_write_atomic_refuses_a_directory_target(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    with pytest.raises(UnsafePathError, match="regular file"):
        write_atomic(tmp_path / "x", b"evil")


def test_secret_mode_is_exact_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_atomic(tmp_path / "secret", b"s", mode=0o600)
        write_atomic(tmp_path / "plain", b"p", mode=0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o644


def test_open_append_refuses_a_symlink_and_a_fifo(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    link = tmp_path / "log"
    _plant(link, victim)
    with pytest.raises(UnsafePathError, match="symlink"):
        open_append(link)
    with pytest.raises(UnsafePathError, match="symlink"):
        open_update(link)
    assert victim.read_bytes() == PRECIOUS
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UnsafePathError, match="regular file"):  # and does not block
        open_append(fifo)
    with open_append(tmp_path / "new.log") as f:
        f.write(b"a")
    with open_append(tmp_path / "new.log") as f:
        f.write(b"b")
    assert (tmp_path / "new.log").read_bytes() == b"ab"


# --- every writer in gpulet -----------------------------------------------------------


def _event(i: int) -> HealthEvent:
    return HealthEvent(
        event_id=f"id-{i}",
        node="n1",
        gpu_uuid="GPU-0",
        kind="xid",
        severity="critical",
        healthy=False,
        reason=f"event {i}",
        observed_at=1000.0 + i,
    )


def _kmsg_cursor(state: Path) -> None:
    from gpulet_health.kmsg import Cursor

    Cursor(state / "kmsg.cursor", "boot-1").advance(7)


def _buffer_segment(state: Path) -> None:
    from gpulet_health.buffer import DiskBuffer

    b = DiskBuffer(state, max_bytes=1 << 20, max_events=100, segment_bytes=1 << 16)
    b.open()
    b.append(_event(1))
    b.close()


def _buffer_cursor(state: Path) -> None:
    from gpulet_health.buffer import DiskBuffer

    # Small segments, so a commit leaves segments behind and writes cursor.json.
    b = DiskBuffer(state, max_bytes=1 << 20, max_events=100, segment_bytes=200)
    b.open()
    for i in range(6):
        assert b.append(_event(i))
    batch = b.peek(1)
    b.commit(batch[-1][1])
    b.close()


def _buffer_overflow(state: Path) -> None:
    from gpulet_health.buffer import DiskBuffer

    b = DiskBuffer(state, max_bytes=1 << 20, max_events=0, segment_bytes=1 << 16)
    b.open()
    assert not b.append(_event(1))  # full: the drop goes to overflow.json
    b.close()


def _known_gpus(state: Path) -> None:
    from gpulet_health.known import KnownGpus

    gpu = GpuInfo(index=0, uuid="GPU-0", name="H100", pci_bus_id="00000000:3B:00.0")
    KnownGpus(state / "gpus.json", "n1").save([gpu])


def _event_id_key(state: Path) -> None:
    from gpulet_health.dedup import load_id_key

    assert len(load_id_key(state / "event-id.key")) == 32  # a random key when refused


def _identity(state: Path) -> None:
    from gpulet_common.fleet.identity import IdentityStore

    IdentityStore(state).init()


def _cli_creds_out(state: Path) -> None:
    from gpulet import fleet as fleet_cli

    fleet_cli._write_out("-----BEGIN NATS USER JWT-----\n", str(state / "node.creds"))


def _reporter_offline(state: Path) -> None:
    from gpulet_reporter import offline

    offline._write_atomic(state / "device-n1.json", "{}\n")


def _allocator_checkpoint(state: Path) -> None:
    from gpulet_allocator.state.checkpoint import CheckpointFile

    CheckpointFile(state / "allocations.json").write(b'{"version": 1}')


# (writer, the file it writes, the fixed temporary name an earlier version used)
WRITERS: list[tuple[Callable[[Path], None], str, str | None]] = [
    (_kmsg_cursor, "kmsg.cursor", "kmsg.tmp"),
    (_buffer_segment, "seg-000000000001.jsonl", None),
    (_buffer_cursor, "cursor.json", "cursor.tmp"),
    (_buffer_overflow, "overflow.json", "overflow.tmp"),
    (_known_gpus, "gpus.json", None),
    (_event_id_key, "event-id.key", None),
    (_identity, "operator.seed", "operator.seed.tmp"),
    (_identity, "ledger.json", "ledger.json.tmp"),
    (_cli_creds_out, "node.creds", None),
    (_reporter_offline, "device-n1.json", None),
    (_allocator_checkpoint, "allocations.json", None),
]
IDS = [f"{w.__name__.lstrip('_')}:{name}" for w, name, _ in WRITERS]


def _run(writer: Callable[[Path], None], state: Path) -> None:
    # A refusal may surface (the CLI, the identity store) or be handled by the writer's
    # caller (logged, the drop recorded); any other error fails the test.
    with contextlib.suppress(UnsafePathError):
        writer(state)


@pytest.mark.parametrize(("writer", "name", "old_tmp"), WRITERS, ids=IDS)
def test_a_link_at_the_file_is_refused(
    tmp_path: Path, writer: Callable[[Path], None], name: str, old_tmp: str | None
) -> None:
    victim = _victim(tmp_path)
    state = tmp_path / "state"
    _plant(state / name, victim)
    _run(writer, state)
    assert victim.read_bytes() == PRECIOUS
    assert (state / name).is_symlink()  # left alone, not replaced or followed


@pytest.mark.parametrize(("writer", "name", "old_tmp"), WRITERS, ids=IDS)
def test_a_dangling_link_at_the_file_is_refused(
    tmp_path: Path, writer: Callable[[Path], None], name: str, old_tmp: str | None
) -> None:
    # A link to a file that does not exist yet: nothing may create it.
    victim = tmp_path / "elsewhere" / "not-yet"
    state = tmp_path / "state"
    _plant(state / name, victim)
    _run(writer, state)
    assert not victim.exists()
    assert (state / name).is_symlink()


@pytest.mark.parametrize(
    ("writer", "name", "old_tmp"),
    [w for w in WRITERS if w[2]],
    ids=[i for i, w in zip(IDS, WRITERS, strict=True) if w[2]],
)
def test_a_link_at_the_old_temporary_name_is_never_followed(
    tmp_path: Path, writer: Callable[[Path], None], name: str, old_tmp: str
) -> None:
    victim = _victim(tmp_path)
    state = tmp_path / "state"
    _plant(state / old_tmp, victim)
    writer(state)
    assert victim.read_bytes() == PRECIOUS
    written = state / name
    assert written.exists()
    assert not written.is_symlink()  # the link was never renamed into place
    assert (state / old_tmp).is_symlink()


def test_the_fleet_creds_and_seeds_are_private(tmp_path: Path) -> None:
    _identity(tmp_path)
    _cli_creds_out(tmp_path)
    _event_id_key(tmp_path)
    secrets = ("operator.seed", "ledger.json", "node.creds", "event-id.key")
    for path in (tmp_path / name for name in secrets):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


@pytest.mark.anyio
async def test_the_embedded_nats_log_is_never_followed(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    server = EmbeddedNats(state_dir=tmp_path / "nats", port=0)
    _plant(server.log_path, victim)
    with pytest.raises(EmbeddedNatsError, match="symlink"):
        await server.start()
    assert victim.read_bytes() == PRECIOUS


def test_ensure_dir_sets_exact_modes_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ensure_dir(tmp_path / "a" / "b", 0o750)
        existing = tmp_path / "kept"
        existing.mkdir(mode=0o711)
        ensure_dir(existing / "c", 0o755)
    finally:
        os.umask(old)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o750
    assert existing.stat().st_mode & 0o777 == 0o711  # not made here: left as it is
    assert (existing / "c").stat().st_mode & 0o777 == 0o755
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UnsafePathError):
        ensure_dir(tmp_path / "link", 0o750)
