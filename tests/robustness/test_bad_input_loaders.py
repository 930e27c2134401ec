"""The config and scenario loaders against hostile input: a clear error, never a crash.

Config: arbitrary trees of settings (real section and key names with arbitrary
values, plus unknown keys), arbitrary ``GPULET_*`` environments and ``--set`` pairs
either load or raise :class:`ConfigError` naming a setting. Scenarios: arbitrary TOML
text and mutated versions of a shipped scenario either load or raise
:class:`ScenarioError` naming the file. 10,000 cases each.
"""

from __future__ import annotations

import random
import tomllib
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulet_common import config
from gpulet_common.config import ConfigError
from gpulet_common.mock_nvml.scenario import SCENARIO_DIR, ScenarioError, scenario_from_toml
from gpulet_common.settings import Settings
from robustness.strategies import json_values

CASES = 10_000
BATCH = 20


def _setting_paths() -> list[str]:
    paths: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for field in msgspec.structs.fields(cls):
            if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
                walk(field.type, f"{prefix}{field.name}.")
            else:
                paths.append(f"{prefix}{field.name}")

    walk(Settings, "")
    return paths


PATHS = _setting_paths()
FUZZ = settings(
    max_examples=CASES // BATCH,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
path_names = st.one_of(st.sampled_from(PATHS), st.text(min_size=1, max_size=15))
raw_strings = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", "0", "-1", "1e999", "nan", "true", "[1,", "{}", "[]", "a,b", "null"]),
)


def _tree(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dotted, value in pairs:
        try:
            config._set_path(tree, dotted, value)
        except ConfigError:
            continue
    return tree


_ODD: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    1e308,
    -0.5,
    "",
    "x",
    "0",
    "1e999",
    "nan",
    "true",
    [],
    [1, "a"],
    {},
    {"k": 1},
    "nats://",
    "[1,",
    "a,b",
    "\x00",
    "mock:nope",
    "\r",
    "=",
]


def _variants(pairs: list[tuple[str, Any]], seed: int) -> list[list[tuple[str, Any]]]:
    """BATCH deterministic variants of ``pairs``: paths and values swapped for odd ones."""
    rng = random.Random(seed)
    out = [pairs]
    while len(out) < BATCH:
        variant = list(rng.choice(out))
        if variant and rng.random() < 0.5:
            i = rng.randrange(len(variant))
            variant[i] = (variant[i][0], rng.choice(_ODD))
        else:
            variant.append((rng.choice(PATHS), rng.choice(_ODD)))
        out.append(variant)
    return out


def _names_the_setting(exc: ConfigError) -> None:
    assert exc.setting
    assert exc.problem


@FUZZ
@given(st.lists(st.tuples(path_names, json_values), max_size=3), st.integers(0, 2**32))
def test_config_trees_load_or_name_the_setting(pairs: list[tuple[str, Any]], seed: int) -> None:
    for variant in _variants(pairs, seed):
        try:
            loaded = config.build([_tree(variant)])
        except ConfigError as exc:
            _names_the_setting(exc)
            continue
        assert isinstance(loaded, Settings)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


@FUZZ
@given(st.dictionaries(path_names, raw_strings, max_size=3), st.integers(0, 2**32))
def test_environment_and_flags_load_or_name_the_setting(values: dict[str, str], seed: int) -> None:
    for variant in _variants(list(values.items()), seed):
        env = {"GPULET_" + k.upper().replace(".", "__"): _as_text(v) for k, v in variant}
        try:
            config.load(env=env)
        except ConfigError as exc:
            _names_the_setting(exc)
        try:
            config.build([config.overrides_layer([f"{k}={_as_text(v)}" for k, v in variant])])
        except ConfigError as exc:
            _names_the_setting(exc)


SHIPPED = tomllib.loads((SCENARIO_DIR / "pcie-7gpu.toml").read_text())
SCENARIO_KEYS = [*sorted(SHIPPED), "base", "timeline", "bogus"]
GPU_KEYS = [*sorted(SHIPPED["gpu_defaults"]), "uuid", "minor", "nvswitch_links"]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else "0.5"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        items = ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items() if v is not None)
        return "{" + items + "}"
    return '""'


scenario_texts = st.one_of(
    st.text(max_size=200),
    st.lists(st.tuples(st.sampled_from(GPU_KEYS), json_values), max_size=4).map(
        lambda kv: (
            "[gpu_defaults]\n"
            + "\n".join(f"{k} = {_toml_value(v)}" for k, v in kv)
            + "\n[[gpus]]\n[[gpus]]\n"
        )
    ),
    st.tuples(st.sampled_from(SCENARIO_KEYS), json_values).map(
        lambda kv: f'base = "pcie-7gpu"\n{kv[0]} = {_toml_value(kv[1])}\n'
    ),
    st.lists(
        st.fixed_dictionaries(
            {
                "at": json_values,
                "fault": st.one_of(
                    st.sampled_from(["xid", "hang", "temperature", "meltdown"]), st.text(max_size=8)
                ),
                "gpu": json_values,
                "value": json_values,
            }
        ),
        max_size=3,
    ).map(
        lambda entries: (
            'base = "dgx-h100"\n'
            + "".join(
                "[[timeline]]\n"
                + "\n".join(f"{k} = {_toml_value(v)}" for k, v in e.items() if v is not None)
                + "\n"
                for e in entries
            )
        )
    ),
)


@FUZZ
@given(st.lists(scenario_texts, min_size=BATCH, max_size=BATCH))
def test_scenarios_load_or_name_the_problem(texts: list[str]) -> None:
    for text in texts:
        try:
            scenario_from_toml(text, source="fuzz.toml")
        except ScenarioError as exc:
            _names_the_file(exc)


def _names_the_file(exc: ScenarioError) -> None:
    assert "fuzz.toml" in str(exc)
