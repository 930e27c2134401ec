"""The status board logs every change of state, and a detail that changes with every
request only a few times a minute (the log must not repeat every Allocate)."""

from __future__ import annotations

import logging

import pytest

from gpulet_common.telemetry import DETAIL_LOGS_PER_MINUTE, StatusBoard


def test_state_changes_always_log_and_detail_changes_are_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    board = StatusBoard()
    with caplog.at_level(logging.INFO, logger="gpulet.telemetry"):
        board.set("allocator", "starting", "loading the checkpoint")
        for n in range(500):  # one detail per Allocate
            board.set("allocator", "ready", f"8 GPUs, {n} allocations")
        board.set("allocator", "ready", "8 GPUs, 499 allocations")  # unchanged: nothing
        board.set("allocator", "degraded", "checkpoint not writable")
        board.set("allocator", "ready", "8 GPUs, 499 allocations")
    lines = [r.getMessage() for r in caplog.records if r.name == "gpulet.telemetry"]
    assert lines[0] == "allocator: starting (loading the checkpoint)"
    assert lines[1] == "allocator: ready (8 GPUs, 0 allocations)"  # a change of state
    details = [line for line in lines[2:] if "allocations)" in line and "ready" in line]
    assert len(details) <= DETAIL_LOGS_PER_MINUTE + 1  # the last: a change of state
    assert "allocator: degraded (checkpoint not writable)" in lines
    assert lines[-1] == "allocator: ready (8 GPUs, 499 allocations)"
    assert board.get("allocator") is not None
    assert len(lines) < 20
