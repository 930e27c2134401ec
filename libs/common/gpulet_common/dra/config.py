"""The DRA configuration API: opaque parameters of driver ``gpu.gpulet.io``.

A claim (or its DeviceClass) may carry, for some or all of its requests,

.. code-block:: yaml

    config:
    - requests: [gpu]            # empty: every request
      opaque:
        driver: gpu.gpulet.io
        parameters:
          apiVersion: gpu.gpulet.io/v1alpha1
          kind: GpuConfig        # or MigDeviceConfig, for MIG devices
          sharing:
            strategy: MPS        # Exclusive (default) | TimeSlicing | MPS
            mpsConfig:
              defaultActiveThreadPercentage: 50
              defaultPinnedDeviceMemoryLimit: 10Gi

The field names are those of NVIDIA's ``resource.nvidia.com/v1beta1`` ``GpuConfig`` /
``MigDeviceConfig`` (``sharing.strategy``, ``timeSlicingConfig.interval``,
``mpsConfig.defaultActiveThreadPercentage``, ``defaultPinnedDeviceMemoryLimit``,
``defaultPerDevicePinnedMemoryLimit``), so a claim moves across by changing its
``apiVersion`` and driver; ``Exclusive`` is gpulet's name for "no sharing".

Decoding is strict and total (:func:`decode`): an unknown ``kind`` or field, a wrong
type, a value out of range, a strategy's config beside another strategy, or an
``apiVersion`` other than :data:`API_VERSION` is a :class:`ConfigError` whose message
names the field (``sharing.strategy: Invalid enum value 'Bogus'``). Prepare refuses that
claim with it; a ValidatingAdmissionPolicy (``deploy/``) refuses most of the same at
``kubectl apply``.

:func:`resolve` picks the configuration of each request: the allocation's configs in
order (the class's first, then the claim's, as the API server lists them), the last one
that names the request, or names none, wins (NVIDIA's rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Final, Literal

import msgspec

from gpulet_common.quantity import parse_whole

GROUP: Final = "gpu.gpulet.io"
API_VERSION: Final = f"{GROUP}/v1alpha1"
KINDS: Final = ("GpuConfig", "MigDeviceConfig")
STRATEGIES: Final = ("Exclusive", "TimeSlicing", "MPS")
INTERVALS: Final = ("Default", "Short", "Medium", "Long")
MAX_CONFIGS: Final = 32


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field."""


class TimeSlicingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    interval: Literal["Default", "Short", "Medium", "Long"] = "Default"


class MpsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    default_active_thread_percentage: Annotated[int, msgspec.Meta(ge=1, le=100)] | None = None
    # A quantity (``10Gi``); checked after decoding (:func:`_check`).
    default_pinned_device_memory_limit: str | None = None
    # Device ordinal (as a string) -> quantity.
    default_per_device_pinned_memory_limit: (
        Annotated[dict[str, str], msgspec.Meta(max_length=64)] | None
    ) = None


class Sharing(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    strategy: Literal["Exclusive", "TimeSlicing", "MPS"] = "Exclusive"
    time_slicing_config: TimeSlicingConfig | None = None
    mps_config: MpsConfig | None = None


class GpuConfig(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="GpuConfig", tag_field="kind"
):
    api_version: str = msgspec.field(name="apiVersion", default="")
    sharing: Sharing | None = None


class MigDeviceConfig(
    msgspec.Struct,
    frozen=True,
    forbid_unknown_fields=True,
    tag="MigDeviceConfig",
    tag_field="kind",
):
    api_version: str = msgspec.field(name="apiVersion", default="")
    sharing: Sharing | None = None


Config = GpuConfig | MigDeviceConfig


def _field(path: str) -> str:
    """msgspec's ``$.sharing.mpsConfig`` as ``sharing.mpsConfig``."""
    return path.removeprefix("$").removeprefix(".")


def decode(parameters: Any) -> Config:
    """The configuration in ``parameters`` (a decoded JSON object), or ConfigError."""
    if not isinstance(parameters, dict):
        raise ConfigError("parameters: not an object")
    kind = parameters.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"kind: {str(kind)[:64]!r} is not one of {', '.join(KINDS)}")
    try:
        config: Config = msgspec.convert(parameters, Config)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).rpartition(" - at `")
        if not message:
            raise ConfigError(str(exc)[:300]) from None
        field = _field(where.rstrip("`"))
        # An unknown field is named in the message itself: say where it is.
        raise ConfigError(f"{field or kind}: {message}"[:300]) from None
    _check(config)
    return config


def _quantity(value: str, field: str) -> int:
    parsed = parse_whole(value)
    if parsed is None or parsed <= 0:
        raise ConfigError(f"{field}: {value[:64]!r} is not a positive quantity")
    return parsed


def _check(config: Config) -> None:
    if config.api_version != API_VERSION:
        raise ConfigError(f"apiVersion: {config.api_version[:64]!r} is not {API_VERSION}")
    sharing = config.sharing
    if sharing is None:
        return
    if sharing.time_slicing_config is not None and sharing.strategy != "TimeSlicing":
        raise ConfigError("sharing.timeSlicingConfig: only with strategy TimeSlicing")
    if sharing.mps_config is not None and sharing.strategy != "MPS":
        raise ConfigError("sharing.mpsConfig: only with strategy MPS")
    mps = sharing.mps_config
    if mps is None:
        return
    if mps.default_pinned_device_memory_limit is not None:
        _quantity(
            mps.default_pinned_device_memory_limit,
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        )
    for ordinal, limit in (mps.default_per_device_pinned_memory_limit or {}).items():
        field = f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{ordinal[:16]!r}]"
        if not ordinal.isdigit():
            raise ConfigError(f"{field}: the key is not a device ordinal")
        _quantity(limit, field)


def mps_limits(config: Config | None) -> tuple[int | None, int | None]:
    """(active-thread percentage, pinned memory in bytes) of an MPS config; (None,
    None) for any other strategy or none."""
    sharing = config.sharing if config is not None else None
    if sharing is None or sharing.strategy != "MPS" or sharing.mps_config is None:
        return None, None
    mps = sharing.mps_config
    memory = (
        parse_whole(mps.default_pinned_device_memory_limit)
        if mps.default_pinned_device_memory_limit is not None
        else None
    )
    return mps.default_active_thread_percentage, memory


def strategy(config: Config | None) -> str:
    sharing = config.sharing if config is not None else None
    return sharing.strategy if sharing is not None else "Exclusive"


def resolve(
    configs: Any, driver: str, requests: Sequence[str]
) -> tuple[dict[str, Config], list[str]]:
    """Each request's configuration from an allocation's ``devices.config`` list, and
    the errors of our driver's configs (``config[i]: <field>: <why>``): a claim with
    any error must not be prepared. Other drivers' configs are theirs."""
    chosen: dict[str, Config] = {}
    errors: list[str] = []
    if configs is None:
        return chosen, errors
    if not isinstance(configs, list) or len(configs) > MAX_CONFIGS:
        return chosen, ["config: malformed"]
    for i, entry in enumerate(configs):
        entry = entry if isinstance(entry, Mapping) else {}
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        try:
            config = decode(opaque.get("parameters"))
        except ConfigError as exc:
            errors.append(f"config[{i}] ({driver}): {exc}")
            continue
        named = entry.get("requests")
        names = [n for n in named if isinstance(n, str)] if isinstance(named, list) else []
        for request in requests:
            if not names or request in names:
                chosen[request] = config
    return chosen, errors
