"""Total decoding: size, nesting and GPU-count bounds, and the claim checks.

The bounds run before msgspec (:func:`gpulet_common.codec.nesting_problem` must agree
with the real nesting of any JSON document, brackets and escapes inside strings
included); the claim checks (:mod:`gpulet_common.validate`) run after it. Every failure
is a :class:`MalformedMessage` or a :class:`RejectedMessage` with a reason, whatever
went wrong underneath.
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulet_common import codec, subjects, validate
from gpulet_common.codec import InvalidValue, MalformedMessage, nesting_problem
from gpulet_common.messages import GpuInfo, GpuSample, HealthEvent, Inventory, SampleBatch
from gpulet_common.settings.limits import LimitsSettings
from gpulet_common.validate import RejectedMessage

NODE = "gpu-1.example"
NOW = time.time()


def _inventory(n: int = 2, node: str = NODE, **changes: Any) -> Inventory:
    gpus = [GpuInfo(uuid=f"GPU-{i}", index=i) for i in range(n)]
    return Inventory(node=node, gpus=gpus, published_at=NOW, **changes)


def _event(**changes: Any) -> HealthEvent:
    fields: dict[str, Any] = {
        "event_id": "e1",
        "node": NODE,
        "gpu_uuid": "GPU-0",
        "kind": "xid",
        "severity": "fatal",
        "healthy": False,
        "reason": "XID 79",
        "observed_at": NOW,
    }
    return HealthEvent(**{**fields, **changes})


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


# --- nesting -------------------------------------------------------------------------

TRICKY_TEXT = st.text(alphabet='[]{}"\\ab\u00e9', max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY_TEXT, inner, max_size=4),
    max_leaves=60,
)


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(JSON_VALUES, st.integers(0, 12), st.booleans())
def test_the_nesting_check_is_exact_whatever_the_strings_hold(
    value: Any, limit: int, ascii_only: bool
) -> None:
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    problem = nesting_problem(data, max(limit, 1))
    assert (problem is None) == (_depth(value) <= max(limit, 1)), (data, problem)
    if problem is not None:
        assert problem[0] == codec.TOO_DEEP


def test_the_issues_payload_is_too_deep_and_never_reaches_msgspec() -> None:
    payload = b'{"a":' * 1500 + b"1" + b"}" * 1500
    with pytest.raises(MalformedMessage) as info:
        codec.HEALTH_EVENT.decode(payload)
    assert info.value.reason == codec.TOO_DEEP
    assert isinstance(info.value, msgspec.DecodeError)


def test_a_megabyte_of_brackets_is_refused_quickly() -> None:
    for payload in (b"[" * 1_000_000, b"[]" * 500_000, b"[" * 500_000 + b"]" * 500_000):
        started = time.perf_counter()
        with pytest.raises(MalformedMessage) as info:
            codec.SAMPLES.decode(payload)
        # Generous for a loaded 2-core machine; it takes about 1 ms.
        assert time.perf_counter() - started < 0.2
        assert info.value.reason in (codec.TOO_DEEP, codec.INVALID_JSON, codec.SCHEMA)


def test_brackets_inside_strings_do_not_count() -> None:
    event = _event(message="[" * 5000 + '\\"{{{' + "}" * 10)
    assert codec.HEALTH_EVENT.decode(codec.HEALTH_EVENT.encode(event)) == event


def test_unbalanced_brackets_and_unterminated_strings_are_not_json() -> None:
    # Shallow enough not to be too deep, with more brackets than the fast path allows.
    for payload in (b'{"a":[' * 12 + b"1]}" * 11, b'{"a":"' + b"[" * 40, b"]" * 20 + b"[" * 20):
        with pytest.raises(MalformedMessage) as info:
            codec.SAMPLES.decode(payload)
        assert info.value.reason == codec.INVALID_JSON, payload[:20]


def test_any_exception_underneath_is_a_decode_failure() -> None:
    # With the depth bound lifted, msgspec itself runs out of stack: RecursionError.
    lifted = LimitsSettings(max_depth=1_000_000)
    payload = b'{"a":' * 5000 + b"1" + b"}" * 5000
    with pytest.raises(MalformedMessage) as info:
        codec.HEALTH_EVENT.decode(payload, limits=lifted)
    assert info.value.reason == codec.ERROR
    assert "RecursionError" in str(info.value)


def test_invalid_utf8_and_wrong_types_keep_their_families() -> None:
    with pytest.raises(MalformedMessage) as utf8:
        codec.HEALTH_EVENT.decode(codec.HEALTH_EVENT.encode(_event()).replace(b"XID", b"\xff"))
    assert utf8.value.reason == codec.INVALID_UTF8
    with pytest.raises(msgspec.ValidationError) as wrong:
        codec.SAMPLES.decode(b'{"node": "n", "timestamp": "yesterday"}')
    assert isinstance(wrong.value, InvalidValue)
    assert codec.failure_reason(wrong.value) == ("malformed", codec.SCHEMA)


# --- size and count ------------------------------------------------------------------


def test_byte_limits_are_per_type_and_configurable() -> None:
    event = codec.HEALTH_EVENT.encode(_event(message="x" * 70_000))
    with pytest.raises(MalformedMessage) as info:
        codec.HEALTH_EVENT.decode(event)
    assert info.value.reason == codec.TOO_LARGE
    roomy = LimitsSettings(health_event_max_bytes=100_000)
    assert codec.HEALTH_EVENT.decode(event, limits=roomy).message == "x" * 70_000
    # The same size is fine for an inventory, whose limit is larger.
    inventory = _inventory(driver_version="x" * 70_000)
    assert codec.INVENTORY.decode(codec.INVENTORY.encode(inventory)) == inventory


@pytest.mark.parametrize("n", [5, 2000])
def test_more_gpus_than_max_gpus_are_refused(n: int) -> None:
    limits = LimitsSettings(max_gpus=4 if n == 5 else 1024)
    # 5 GPUs take the claim check, 2,000 the counting pass before the full decode.
    with pytest.raises(RejectedMessage) as info:
        codec.INVENTORY.decode(codec.INVENTORY.encode(_inventory(n)), limits=limits)
    assert info.value.reason == validate.TOO_MANY_GPUS
    assert codec.failure_reason(info.value) == ("rejected", validate.TOO_MANY_GPUS)


# --- claims --------------------------------------------------------------------------


def test_the_node_must_be_the_subjects_and_the_consumers() -> None:
    data = codec.INVENTORY.encode(_inventory(node="other-node"))
    with pytest.raises(RejectedMessage) as info:
        codec.INVENTORY.decode(data, subject=subjects.inventory(NODE))
    assert info.value.reason == validate.NODE_MISMATCH
    with pytest.raises(RejectedMessage) as info:
        codec.INVENTORY.decode(data, node=NODE)
    assert info.value.reason == validate.WRONG_NODE
    # Right subject, right consumer; and a subject that names no node checks nothing.
    own = codec.INVENTORY.encode(_inventory())
    assert codec.INVENTORY.decode(own, subject=subjects.inventory(NODE), node=NODE)
    assert codec.INVENTORY.decode(data, subject="_INBOX.abc")
    # Wildcard consumers (gpulet alerts) check each message against its own subject.
    event = codec.HEALTH_EVENT.encode(_event())
    assert codec.HEALTH_EVENT.decode(event, subject=subjects.health(NODE))
    with pytest.raises(RejectedMessage):
        codec.HEALTH_EVENT.decode(event, subject=subjects.health("gpu-2.example"))


@pytest.mark.parametrize(
    ("inventory", "reason"),
    [
        (
            Inventory(
                node=NODE, gpus=[GpuInfo(uuid="GPU-a", index=0), GpuInfo(uuid="GPU-a", index=1)]
            ),
            validate.DUPLICATE_UUID,
        ),
        (
            Inventory(
                node=NODE, gpus=[GpuInfo(uuid="GPU-a", index=0), GpuInfo(uuid="GPU-b", index=0)]
            ),
            validate.DUPLICATE_INDEX,
        ),
        (Inventory(node=NODE, gpus=[GpuInfo(uuid="", index=0)]), validate.EMPTY_UUID),
    ],
)
def test_gpus_are_listed_once_with_a_uuid(inventory: Inventory, reason: str) -> None:
    with pytest.raises(RejectedMessage) as info:
        codec.INVENTORY.decode(codec.INVENTORY.encode(inventory))
    assert info.value.reason == reason


def test_numbers_out_of_range_are_malformed() -> None:
    for payload in (
        b'{"node":"n","timestamp":1,"samples":[{"uuid":"a","index":0,"timestamp":1,"gpu_util_pct":150}]}',
        b'{"node":"n","timestamp":1,"samples":[{"uuid":"a","index":-1,"timestamp":1}]}',
        b'{"node":"n","timestamp":1,"samples":[{"uuid":"a","index":0,"timestamp":1,"power_mw":-1}]}',
    ):
        with pytest.raises(InvalidValue):
            codec.SAMPLES.decode(payload)


@pytest.mark.parametrize(
    ("when", "reason"),
    [
        (NOW + 3600, validate.FUTURE_TIMESTAMP),
        (1e18, validate.FUTURE_TIMESTAMP),
        (1.0, validate.STALE_TIMESTAMP),
        (NOW - 40 * 86400, validate.STALE_TIMESTAMP),
    ],
    # Stable ids (not the clock's values): pytest-xdist's workers must collect alike.
    ids=["an_hour_ahead", "far_future", "epoch", "forty_days_old"],
)
def test_timestamps_are_checked_against_the_receivers_clock(when: float, reason: str) -> None:
    batch = SampleBatch(
        node=NODE, timestamp=when, samples=[GpuSample(uuid="GPU-0", index=0, timestamp=NOW)]
    )
    with pytest.raises(RejectedMessage) as info:
        codec.SAMPLES.decode(codec.SAMPLES.encode(batch), now=NOW)
    assert info.value.reason == reason


def test_an_infinite_timestamp_is_refused() -> None:
    # JSON has no infinity; msgspec refuses the overflow 1e999 as out of range.
    text = codec.SAMPLES.encode(SampleBatch(node=NODE, timestamp=123.5))
    with pytest.raises(InvalidValue):
        codec.SAMPLES.decode(text.replace(b"123.5", b"1e999"), now=NOW)
    # And should a decoder let one through, the claim check refuses it.
    with pytest.raises(RejectedMessage) as info:
        validate.check(
            SampleBatch(node=NODE, timestamp=float("inf")),
            validate.Context(limits=LimitsSettings(), now=NOW),
        )
    assert info.value.reason == validate.BAD_TIMESTAMP


def test_times_within_bounds_pass_and_files_replay_without_a_clock() -> None:
    recent = _event(observed_at=NOW - 6 * 86400, condition_since=NOW - 90 * 86400)
    data = codec.HEALTH_EVENT.encode(recent)
    # A week-old event from the stream and a condition raised months ago are fine.
    assert codec.HEALTH_EVENT.decode(data, now=NOW) == recent
    # Without the receiver's clock (files, tests) times are only required to be finite.
    ancient = codec.HEALTH_EVENT.encode(_event(observed_at=1000.0))
    assert codec.HEALTH_EVENT.decode(ancient).observed_at == 1000.0
    with pytest.raises(RejectedMessage):
        codec.HEALTH_EVENT.decode(
            codec.HEALTH_EVENT.encode(_event(condition_since=NOW + 1e6)), now=NOW
        )
