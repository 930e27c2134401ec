"""Depth is hostile input: every reader of an outside document, fed one 10,000 levels
deep, answers with its own refusal -- never a ``RecursionError`` (a ``RuntimeError``
that the readers' ``except ValueError`` let through, ending a service).

One test per entry point; the DRA claim cache's watch and the time-slicing configs
file have theirs next to their other tests (tests/dra/test_dra_claim_cache.py,
tests/allocator/test_time_slicing.py).
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from gpulet_allocator.decide.koordinator import InvalidDecision, parse_decision
from gpulet_allocator.service.remediate.kube import outcome_of
from gpulet_common import config
from gpulet_common.config import ConfigError
from gpulet_common.embedded_nats import _read_port
from gpulet_common.fleet import jwt
from gpulet_common.fleet.identity import IdentityError, IdentityStore
from gpulet_common.mock_nvml.scenario import ScenarioError, load_scenario, scenario_from_toml
from gpulet_common.settings.reporter import ReporterSettings
from gpulet_health.buffer import DiskBuffer
from gpulet_health.known import KnownGpus
from gpulet_reporter.offline import OfflineSink

DEPTH = 10_000
DEEP = "[" * DEPTH + "]" * DEPTH
DEEP_OBJECT = '{"a":' * DEPTH + "1" + "}" * DEPTH


def test_a_settings_file_json_or_toml(tmp_path: Path) -> None:
    as_json = tmp_path / "gpulet.json"
    as_json.write_text(f'{{"node_name": {DEEP}}}')
    with pytest.raises(ConfigError, match="nesting deeper"):
        config.load(as_json, env={})
    as_toml = tmp_path / "gpulet.toml"
    as_toml.write_text(f"node_name = {DEEP}\n")
    with pytest.raises(ConfigError, match="too deep"):
        config.load(as_toml, env={})


def test_a_settings_value_from_the_environment() -> None:
    with pytest.raises(ConfigError, match="nesting deeper"):
        config.load(env={"GPULET_ALLOCATOR__RESOURCE_NAMES": DEEP})


def test_a_mock_scenario_file_or_text(tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(f"gpus = {DEEP}\n")
    with pytest.raises(ScenarioError, match="too deep"):
        load_scenario(path)
    with pytest.raises(ScenarioError, match="too deep"):
        scenario_from_toml(f"gpus = {DEEP}\n")


def test_the_offline_reporters_files(tmp_path: Path) -> None:
    """A device or labels file that is deep is as good as absent (the reporter writes
    it again), as an unreadable one was."""
    for name in ("device-n.json", "node-labels-n.json"):
        (tmp_path / name).write_text(DEEP_OBJECT)
    sink = OfflineSink(tmp_path, "n", ReporterSettings())
    assert (sink.device, sink.labels) == (None, None)


def test_the_health_buffers_cursor_and_overflow_files(tmp_path: Path) -> None:
    directory = tmp_path / "buffer"
    directory.mkdir()
    (directory / "cursor.json").write_text(DEEP_OBJECT)
    (directory / "overflow.json").write_text(DEEP)
    buffer = DiskBuffer(directory, max_bytes=1 << 20, max_events=100, segment_bytes=600)
    buffer.open()  # ignored as unreadable, logged: the buffer opens
    assert buffer.pending == 0


def test_an_eviction_answer() -> None:
    outcome = outcome_of(500, DEEP.encode())
    assert outcome.result == "failed"
    assert outcome.detail.startswith("[[[[")


def test_a_koordinator_annotation() -> None:
    decision = parse_decision(DEEP_OBJECT)  # 60 KB: under the size bound
    assert isinstance(decision, InvalidDecision)
    assert "not JSON" in decision.problem


def test_a_jwt_whose_claims_nest_deep() -> None:
    def b64(text: str) -> str:
        return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()

    header = f'{{"typ": "JWT", "alg": "{jwt.ALGORITHM}"}}'
    token = f"{b64(header)}.{b64(DEEP_OBJECT)}.{b64('sig')}"
    with pytest.raises(jwt.JwtError, match="malformed JWT"):
        jwt.decode(token, jwt.UserClaims)
    deep_header = header[:-1] + f', "x": {DEEP}}}'
    header_deep = f"{b64(deep_header)}.{b64('{}')}.{b64('sig')}"
    with pytest.raises(jwt.JwtError, match="malformed JWT"):
        jwt.decode(header_deep, jwt.UserClaims)


def test_the_fleet_identity_ledger(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path / "identity")
    (tmp_path / "identity").mkdir()
    (tmp_path / "identity" / "ledger.json").write_text(f'{{"unknown": {DEEP}}}')
    with pytest.raises(IdentityError, match="corrupt"):
        store.ledger()


def test_a_nats_server_ports_file(tmp_path: Path) -> None:
    ports = tmp_path / "nats.ports"
    ports.write_text(DEEP_OBJECT)
    assert _read_port(ports) is None
    ports.write_text('{"nats": ["nats://127.0.0.1:4222"]}')
    assert _read_port(ports) == 4222


def test_the_health_buffers_files_of_the_wrong_shape(tmp_path: Path) -> None:
    """Shallow but wrong: values of another type are read as absent, not a TypeError
    that stops the buffer from opening."""
    directory = tmp_path / "buffer"
    directory.mkdir()
    (directory / "cursor.json").write_text('{"segment": 0, "offset": [], "consumed": "x"}')
    (directory / "overflow.json").write_text('{"dropped": {}, "first_at": [], "last_at": 1}')
    buffer = DiskBuffer(directory, max_bytes=1 << 20, max_events=100, segment_bytes=600)
    buffer.open()
    assert buffer.pending == 0


def test_the_health_services_file_of_known_gpus(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(f'{{"version": 1, "extra": {DEEP}}}')
    loaded = KnownGpus(path, "n").load()
    assert loaded.gpus == []
    assert "nesting deeper" in loaded.detail
