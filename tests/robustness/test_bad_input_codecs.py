"""Every decoder on the bus against 10,000 hostile payloads each: rejected, never crashing.

A payload either decodes into a valid message or raises msgspec's DecodeError /
ValidationError with a message saying what is wrong; anything else would be a crash in
a service. Through :meth:`Bus.decode` every rejected payload is also counted in
``gpulet.bus.malformed_messages`` (or ``gpulet.bus.rejected_messages`` when it decodes
but its claims do not hold) and logged, and the subscriber keeps going.
"""

from __future__ import annotations

import importlib
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg

from gpulet_common.bus import Bus
from gpulet_common.codec import Codec
from gpulet_common.settings.nats import NatsSettings
from robustness.strategies import bases, mutants
from support.metrics import MetricsProbe

CODEC_MODULES = (
    "gpulet_common.codec",
    "gpulet_allocator.protocol",
)


def _all_codecs() -> list[Codec[Any]]:
    found: dict[type, Codec[Any]] = {}
    for name in CODEC_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        for value in vars(module).values():
            if isinstance(value, Codec):
                found.setdefault(value.type, value)
    return sorted(found.values(), key=lambda c: c.type.__name__)


CODECS = _all_codecs()
CASES = 10_000
# Inputs derived from one hypothesis example (see robustness.strategies).
BATCH = 25


def test_the_catalogue_of_decoders_is_complete() -> None:
    names = {c.type.__name__ for c in CODECS}
    assert {"Inventory", "SampleBatch", "HealthEvent", "HealthState", "MockInjectRequest"} <= names


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.type.__name__)
def test_decoder_rejects_hostile_payloads_cleanly(codec: Codec[Any]) -> None:
    outcomes = {"valid": 0, "rejected": 0}
    problems: set[bool] = set()  # whether each rejection said what is wrong

    @settings(
        max_examples=CASES // BATCH,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(bases(codec.type), st.integers(0, 2**32))
    def check(base: bytes, seed: int) -> None:
        for payload in mutants(base, seed, BATCH):
            try:
                value = codec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                problems.add(bool(str(exc)))
                outcomes["rejected"] += 1
                continue
            assert isinstance(value, codec.type)
            # What decodes must survive a round trip unchanged.
            assert codec.decode(codec.encode(value)) == value
            outcomes["valid"] += 1

    check()
    assert sum(outcomes.values()) >= CASES
    assert outcomes["rejected"] > 0
    assert problems == {True}, "every rejection must say what is wrong"
    assert outcomes["valid"] > 0, "the inputs must also reach the validation of valid shapes"


class _NoClient:
    """Msg wants a client only to ack/respond, which decoding never does."""


def test_bus_counts_every_rejected_payload() -> None:
    probe = MetricsProbe()
    bus = Bus(_NoClient(), NatsSettings(url="nats://127.0.0.1:1"), probe.meter)  # type: ignore[arg-type]
    codecs = [c for c in CODECS if c.type.__name__ in ("SampleBatch", "HealthEvent", "Inventory")]
    counted = {c.type.__name__: 0 for c in codecs}

    @settings(
        max_examples=400,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.sampled_from(codecs).flatmap(lambda c: st.tuples(st.just(c), bases(c.type))))
    def check(case: tuple[Codec[Any], bytes]) -> None:
        codec, base = case
        for payload in mutants(base, len(base), 5):
            msg = Msg(_NoClient(), subject="gpu.test", data=payload)  # type: ignore[arg-type]
            if bus.decode(msg, codec) is None:
                counted[codec.type.__name__] += 1

    check()
    assert all(rejected > 0 for rejected in counted.values())
    for name, rejected in counted.items():
        # Not decodable (malformed) or decodable with claims that do not hold
        # (rejected, e.g. a timestamp decades old): each counted once, in one of two.
        malformed = probe.value("gpulet.bus.malformed_messages", type=name)
        claims = probe.value("gpulet.bus.rejected_messages", type=name)
        assert malformed > 0
        assert malformed + claims == rejected
