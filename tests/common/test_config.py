from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest

from gpulet_common import config
from gpulet_common.config import ConfigError
from gpulet_common.settings import Settings


def test_defaults_need_no_file() -> None:
    settings = config.load(env={"NODE_NAME": "n1"})
    assert settings.node_name == "n1"
    assert settings.collector.sample_period_s == 1.0
    assert settings.telemetry.http_port == 5678
    assert settings.state_dir


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "gpulet.toml"
    path.write_text(
        'node_name = "from-file"\n[collector]\nsample_period_s = 2.0\nworker_threads = 3\n'
        '[nats]\nurl = "nats://file:4222"\n'
    )
    env = {"GPULET_COLLECTOR__SAMPLE_PERIOD_S": "0.5", "GPULET_NATS__URL": "nats://env:4222"}
    settings = config.load(path, env=env, overrides={"nats": {"url": "nats://flag:4222"}})
    assert settings.node_name == "from-file"  # only the file sets it
    assert settings.collector.worker_threads == 3  # file beats default
    assert settings.collector.sample_period_s == 0.5  # env beats file
    assert settings.nats.url == "nats://flag:4222"  # flag beats env


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"collector": {"worker_threads": 7}}')
    settings = config.load(env={"GPULET_CONFIG": str(path)})
    assert settings.collector.worker_threads == 7


@pytest.mark.parametrize(
    ("env", "setting", "problem"),
    [
        ({"GPULET_COLLECTOR__SAMPLE_PERIOD_S": "soon"}, "collector.sample_period_s", "float"),
        ({"GPULET_COLLECTOR__SAMPLE_PERIOD_S": "0"}, "collector.sample_period_s", ">= 0.01"),
        ({"GPULET_COLLECTOR__SAMPLE_PERIODS": "1"}, "collector.sample_periods", "unknown setting"),
        ({"GPULET_NVML__BACKEND": "cuda"}, "nvml.backend", "enum"),
        ({"GPULET_TELEMETRY__HTTP_PORT": "70000"}, "telemetry.http_port", "<= 65535"),
    ],
)
def test_invalid_values_name_the_setting(env: dict[str, str], setting: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.load(env=env)
    assert info.value.setting == setting
    assert problem in info.value.problem


def test_broken_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[collector\n")
    with pytest.raises(ConfigError, match=r"bad\.toml is not valid"):
        config.load(path, env={})


def test_override_pairs_parse_types() -> None:
    tree = config.overrides_layer(["collector.sample_period_s=0.25", "nats.url=nats://x:1"])
    settings = config.build([tree])
    assert settings.collector.sample_period_s == 0.25
    with pytest.raises(ConfigError, match=r"expected section\.key=value"):
        config.overrides_layer(["collector.sample_period_s"])


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        " ",
        "_INBOX.>",
        "_INBOX.*",
        "_INBOX.*.x",
        "my inbox",
        "_INBOX.",
        ".x",
        "a..b",
        "_INBOX.a\tb",
        ">",
    ],
)
def test_inbox_prefix_must_be_plain_subject_tokens(prefix: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.load(env={"GPULET_NATS__INBOX_PREFIX": prefix})
    assert info.value.setting == "nats.inbox_prefix"


def test_inbox_prefix_default_and_per_user_values() -> None:
    assert config.load(env={}).nats.inbox_prefix == "_INBOX"
    for prefix in ("_INBOX.device-plugin", "_INBOX_health", "replies.node-1.alerts"):
        settings = config.load(env={"GPULET_NATS__INBOX_PREFIX": prefix})
        assert settings.nats.inbox_prefix == prefix


def _literal_settings(hint: Any = Settings, path: str = "") -> Iterator[tuple[str, list[str]]]:
    """Every setting whose type is a Literal, with its values (walking the sections)."""
    for field in msgspec.structs.fields(hint):
        dotted = f"{path}{field.name}"
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            yield from _literal_settings(field.type, dotted + ".")
        elif typing.get_origin(field.type) is Literal:
            yield dotted, [str(v) for v in typing.get_args(field.type)]


def test_every_enum_setting_error_names_the_allowed_values() -> None:
    found = dict(_literal_settings())
    assert "nvml.mock_latency" in found  # the walk sees nested sections
    for dotted, values in found.items():
        with pytest.raises(ConfigError) as exc:
            config.load(env={}, overrides=config.overrides_layer([f"{dotted}=bogus"]))
        assert exc.value.setting == dotted
        assert exc.value.problem.endswith(f"(one of: {', '.join(values)})"), exc.value
