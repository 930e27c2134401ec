"""Loading settings from a file, the environment and the command line.

Precedence, lowest to highest:

1. built-in defaults (the Structs in :mod:`gpulet_common.settings`);
2. the config file (TOML or JSON), from ``--config`` or ``$GPULET_CONFIG``;
3. environment variables ``GPULET_<SECTION>__<KEY>`` (``GPULET_NODE_NAME`` for
   top-level keys), e.g. ``GPULET_COLLECTOR__SAMPLE_PERIOD_S=0.5``;
4. command-line flags (``--set section.key=value`` and the dedicated flags).

Values from the environment and the command line are strings; they are converted to
the setting's type (``"0.5"`` to a float, ``"true"`` to a bool, ``"[1,2]"`` or
``"1,2"`` to a list). Any invalid value raises :class:`ConfigError` naming the setting
and what is wrong with it.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from gpulet_common.errors import UsageError
from gpulet_common.settings import Settings
from gpulet_common.untrusted import UntrustedDocumentError, json_document, toml_document

ENV_PREFIX = "GPULET_"
# A settings file or value is the operator's, yet read totally (gpulet_common.untrusted).
_MAX_FILE_BYTES = 4 << 20
_PATH_IN_ERROR = re.compile(r" - at `\$\.?([^`]*)`$")


class ConfigError(UsageError, ValueError):
    """An invalid setting: the CLI prints it as one line and exits 2."""

    def __init__(self, setting: str, problem: str) -> None:
        setting = setting.strip() or "(empty)"
        super().__init__(f"invalid setting {setting!r}: {problem}")
        self.setting = setting
        self.problem = problem


def deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``: tables merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(dotted or "(empty)", "empty setting name")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, f"{part!r} is not a section")
    node[parts[-1]] = value


@functools.lru_cache(maxsize=1024)
def _field_type(dotted: str) -> Any:
    """The declared type of a dotted setting, or None if there is no such setting."""
    cls: Any = Settings
    hint: Any = None
    for part in dotted.split("."):
        fields = getattr(cls, "__struct_fields__", None)
        if fields is None or part not in fields:
            return None
        hint = msgspec.structs.fields(cls)[fields.index(part)].type
        cls = hint
    return hint


def _parse_scalar(dotted: str, raw: str) -> Any:
    """Strings from env/CLI: JSON-looking values are parsed, lists may be comma-separated."""
    text = raw.strip()
    hint = _field_type(dotted)
    origin = getattr(hint, "__origin__", None)
    if text and text[0] in "[{":
        try:
            return json_document(text, max_bytes=_MAX_FILE_BYTES, what="the value")
        except UntrustedDocumentError as exc:  # deep or huge, too: one ConfigError
            raise ConfigError(dotted, f"not valid JSON: {exc}") from None
    if origin in (list, tuple, set, frozenset):
        return [item.strip() for item in text.split(",") if item.strip()]
    return raw


def file_layer(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as handle:
            data = handle.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError("config", f"cannot read {p}: {exc.strerror}") from None
    try:
        loaded = (
            json_document(data, max_bytes=_MAX_FILE_BYTES, what=str(p))
            if p.suffix == ".json"
            else toml_document(data, max_bytes=_MAX_FILE_BYTES, what=str(p))
        )
    except UntrustedDocumentError as exc:  # RecursionError of a deep file included
        raise ConfigError("config", f"{p} is not valid: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError("config", f"{p} must hold a table of settings")
    return loaded


def env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key == "GPULET_CONFIG":
            continue
        dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_path(tree, dotted, _parse_scalar(dotted, raw))
    return tree


def overrides_layer(pairs: list[str]) -> dict[str, Any]:
    """``section.key=value`` pairs from ``--set``."""
    tree: dict[str, Any] = {}
    for pair in pairs:
        dotted, sep, raw = pair.partition("=")
        if not sep:
            raise ConfigError(pair, "expected section.key=value")
        dotted = dotted.strip()
        _set_path(tree, dotted, _parse_scalar(dotted, raw))
    return tree


def build(layers: list[Mapping[str, Any]]) -> Settings:
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = deep_merge(merged, layer)
    try:
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        found = _PATH_IN_ERROR.search(text)
        where = found.group(1) if found else ""
        problem = _PATH_IN_ERROR.sub("", text)
        if problem.startswith("Object contains unknown field"):
            unknown = problem.split("`")[1]
            where = f"{where}.{unknown}" if where else unknown
            problem = "unknown setting (check the spelling; see `gpulet config show`)"
        where, problem = _explain(merged, text, where, problem)
        raise ConfigError(where.replace("[", ".").replace("]", "") or "config", problem) from None
    return settings


def _explain(merged: Mapping[str, Any], text: str, where: str, problem: str) -> tuple[str, str]:
    """Name the table key msgspec leaves as ``[...]`` and what a wrong value may be."""
    if " - at `key` in `$." in text:  # a table's key of the wrong type
        where = text.split(" - at `key` in `$.", 1)[1].rstrip("`")
        table = _lookup(merged, where)
        bad = [k for k in table if not str(k).strip().lstrip("-").isdigit()] if table else []
        problem = problem.split(" - at ")[0] + " for a key: the keys are numbers (e.g. 79)"
        if bad:
            problem = f"{bad[0]!r} is not a number (the keys of this table are numbers, e.g. 79)"
    if "[...]" in where:
        head, _, rest = where.partition("[...]")
        table = _lookup(merged, head)
        hint = _field_type(head)
        value_type = getattr(hint, "__args__", (None, None))[-1]
        for key, value in (table or {}).items():
            try:
                msgspec.convert(value, value_type, strict=False)
            except (msgspec.ValidationError, TypeError):
                where = f"{head}.{key}{rest}"
                break
    if problem.startswith("Invalid enum value"):
        allowed = _allowed(where)
        if allowed:
            problem += f" (one of: {', '.join(allowed)})"
    elif problem.startswith("Expected `object`"):
        keys = _struct_keys(where)
        if keys:
            problem += f" (a table with: {', '.join(keys)})"
    return where, problem


def _lookup(merged: Mapping[str, Any], dotted: str) -> Mapping[str, Any] | None:
    node: Any = merged
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


def _allowed(where: str) -> list[str]:
    """The values a Literal setting allows (through tables of Structs), or []."""
    hint = _hint(where)
    args = getattr(hint, "__args__", ())
    return [str(a) for a in args] if getattr(hint, "__origin__", None) is Literal else []


def _struct_keys(where: str) -> list[str]:
    hint = _hint(where)
    is_struct = isinstance(hint, type) and issubclass(hint, msgspec.Struct)
    return list(hint.__struct_fields__) if is_struct else []


def _hint(where: str) -> Any:
    """The declared type at a setting's path, through Structs and tables; None if none."""
    hint: Any = Settings
    for part in where.replace("[", ".").replace("]", "").split("."):
        if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
            names = hint.__struct_fields__
            if part not in names:
                return None
            hint = msgspec.structs.fields(hint)[names.index(part)].type
        elif getattr(hint, "__origin__", None) is dict:
            hint = hint.__args__[1]
        else:
            return None
    return hint


def load(
    config_file: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Load settings with the documented precedence."""
    env = os.environ if env is None else env
    layers: list[Mapping[str, Any]] = []
    path = config_file or env.get("GPULET_CONFIG")
    if path:
        layers.append(file_layer(path))
    layers.append(env_layer(env))
    if overrides:
        layers.append(overrides)
    settings = build(layers)
    if not settings.node_name:
        settings.node_name = env.get("NODE_NAME") or socket.gethostname()
    if not settings.state_dir:
        settings.state_dir = default_state_dir(env)
    return settings


def default_state_dir(env: Mapping[str, str]) -> str:
    system = Path("/var/lib/gpulet")
    if os.access(system if system.exists() else system.parent, os.W_OK):
        return str(system)
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "gpulet")


# Settings whose values are secrets: shown only as "***" by `gpulet config show`.
SECRET_KEYS = frozenset({"password", "token"})


def _mask(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: ("***" if k in SECRET_KEYS and v else _mask(v)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_mask(v) for v in tree]
    if isinstance(tree, str) and "://" in tree and "@" in tree:
        from gpulet_common.bus import describe_servers

        return describe_servers(tree)
    return tree


def dump(settings: Settings, *, mask_secrets: bool = True) -> dict[str, Any]:
    """The settings as plain data; secrets (passwords, tokens, URL credentials) masked."""
    result: dict[str, Any] = msgspec.to_builtins(settings)
    masked: dict[str, Any] = _mask(result) if mask_secrets else result
    return masked
