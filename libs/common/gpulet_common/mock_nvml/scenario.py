"""Scenario files of the mock NVML: a node's GPUs, their topology and a fault timeline.

Why scenario files
------------------
Tests, demos and developers without a GPU need realistic nodes -- a DGX H100, a
PCIe box with two switch groups, a T4 without row remapping -- and faults that arrive
at known times. A TOML file per node keeps those facts reviewable and shared between
the test suite and ``gpulet run --nvml mock:<scenario>``.

Format (see ``scenarios/*.toml`` for complete examples)::

    base = "dgx-h100"            # optional: start from another scenario (name or path)
    description = "..."
    seed = 7                     # generated UUIDs/serials and the sample jitter
    jitter = true                # vary utilisation/power/temperature a little

    [system]                     # driver_version, cuda_driver_version (12040), ...
    [gpu_defaults]               # any GPU field; merged under every [[gpus]] entry
    [[gpus]]                     # one table per GPU, in NVML index order
    [topology]                   # default_level, groups, pairs, matrix, nvlinks...
    [[timeline]]                 # fault = "xid", at = 10.0, gpu = 3, value = 79

Merging with ``base``: tables merge key by key, arrays (``gpus``, ``timeline``, ...)
are replaced as a whole.

Layers: TOML text -> dict (``tomllib``) -> base and ``gpu_defaults`` merged ->
:class:`Scenario` (``msgspec.convert``: types and unknown keys checked) -> semantic
checks (indices, levels, links, faults) -> generated fields filled (UUID, bus id,
serial, minor, board id). Every error is a :class:`ScenarioError` naming the file,
the entry and the problem.

The ``[topology]`` table and its resolution live in :mod:`.topology`, the timeline's
faults (kinds, spec, checks) in :mod:`.faultspec`.
"""

from __future__ import annotations

import hashlib
import re
import uuid as uuid_module
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from gpulet_common.config import deep_merge
from gpulet_common.errors import UsageError
from gpulet_common.mock_nvml.faultspec import FaultSpec, check_fault
from gpulet_common.mock_nvml.migspec import MigSpec, check_mig
from gpulet_common.mock_nvml.topology import (
    NVLINK_MAX_LINKS,
    TopologySpec,
    nvlink_matrix,
    parse_level,
)
from gpulet_common.untrusted import UntrustedDocumentError, toml_document

SCENARIO_DIR: Final = Path(__file__).with_name("scenarios")
_MAX_SCENARIO_BYTES: Final = 4 << 20

EVENT_TYPES: Final[dict[str, int]] = {
    "single_bit_ecc": 0x1,
    "double_bit_ecc": 0x2,
    "pstate": 0x4,
    "xid": 0x8,
    "clock": 0x10,
    "gpu_unavailable": 0x4000,
}

EventName = Literal["single_bit_ecc", "double_bit_ecc", "pstate", "xid", "clock", "gpu_unavailable"]


class ScenarioError(UsageError, ValueError):
    """A scenario that cannot be found, parsed or played (the CLI: one line, exit 2)."""

    def __init__(self, source: str, entry: str, problem: str) -> None:
        where = f"scenario {source}"
        if entry:
            where += f": {entry}"
        super().__init__(f"{where}: {problem}")
        self.source = source
        self.entry = entry
        self.problem = problem


class SystemSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    driver_version: str = "550.54.15"
    # NVML's encoding: major * 1000 + minor * 10.
    cuda_driver_version: int = 12040
    nvml_version: str = "12.550.54.15"
    # False plays a driver older than 535: nvmlDeviceGetCurrentClocksEventReasons is
    # missing (FUNCTION_NOT_FOUND) and only the ...ThrottleReasons call works.
    clocks_event_reasons: bool = True
    # Per-call NVML latency the mock spends (see mock_nvml/latency.py): "none", or
    # "h100" for the cost of each call measured on a real H100. The setting
    # nvml.mock_latency overrides it.
    latency_profile: Literal["none", "h100"] = "none"
    # A driver that is not loaded yet (at boot, before the NVIDIA driver's modules):
    # nvmlInit fails with DRIVER_NOT_LOADED this many times, and, when a path is
    # given, for as long as that file does not exist ("until the driver is loaded").
    init_failures: Annotated[int, msgspec.Meta(ge=0)] = 0
    driver_loaded_file: str = ""


class GpuSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One GPU. Identity fields left empty are generated from the seed and the slot."""

    name: str = "NVIDIA H100 80GB HBM3"
    memory_total_mib: int = 81559
    uuid: str = ""
    bus_id: str = ""
    pci_device_id: int = 0
    minor: int | None = None
    serial: str = ""
    board_id: int | None = None
    # None: nvmlDeviceGetModuleId answers NOT_SUPPORTED (PCIe cards, old drivers).
    module_id: int | None = None
    # None: nvmlDeviceGetNumaNodeId answers NOT_SUPPORTED.
    numa_node: int | None = None
    # CPU ids, as a list or a cpulist string ("0-55,112-167").
    cpu_affinity: list[int] | str = []
    compute_capability: tuple[int, int] = (9, 0)
    # None: the GPU has no ECC at all (every ECC call NOT_SUPPORTED).
    ecc_enabled: bool | None = True
    remapped_rows: bool = True
    retired_pages: bool = False
    # Thresholds in degrees C; None answers NOT_SUPPORTED.
    temp_shutdown_c: int | None = None
    temp_slowdown_c: int | None = None
    temp_gpu_max_c: int | None = None
    temp_mem_max_c: int | None = None
    supported_events: list[EventName] = msgspec.field(
        default_factory=lambda: list(EVENT_TYPES)  # type: ignore[arg-type]
    )
    # Links into an NVSwitch fabric (every GPU with such links reaches every other).
    nvswitch_links: int = 0
    # Baseline readings, varied a little when the scenario has jitter.
    temperature_c: int = 35
    power_w: float = 70.0
    gpu_util_pct: int = 0
    mem_util_pct: int = 0
    memory_used_mib: int = 0
    sm_clock_mhz: int = 1980
    mem_clock_mhz: int = 2619
    throttle_reasons: int = 0
    # Memory temperature (nvmlDeviceGetFieldValues NVML_FI_DEV_MEMORY_TEMP); None: not
    # supported.
    memory_temperature_c: int | None = None
    # Tensor-pipe activity in percent, answered by GPM (compute capability 9.0 and
    # later; older GPUs answer GPM as unsupported).
    tensor_util_pct: int = 0
    # Lost before the mock starts (a GPU that fell into GPU_IS_LOST before the agent
    # did). NVML still counts it, as real NVML does. "handle": nvmlDeviceGetHandleByIndex
    # fails with GPU_IS_LOST, so only its index is known. "calls": the handle is given
    # and nvmlDeviceGetPciInfo still answers, every other call on it fails with
    # GPU_IS_LOST. "" : not lost. A ``reset`` fault brings it back.
    lost_at_start: Literal["", "handle", "calls"] = ""
    # MIG (see mock_nvml/migspec.py); None: the GPU has no MIG at all.
    mig: MigSpec | None = None

    @property
    def memory_total_bytes(self) -> int:
        return self.memory_total_mib * 1024 * 1024

    @property
    def event_mask(self) -> int:
        mask = 0
        for name in self.supported_events:
            mask |= EVENT_TYPES[name]
        return mask

    @property
    def cpus(self) -> list[int]:
        """cpu_affinity as a list (the loader has already turned strings into lists)."""
        if isinstance(self.cpu_affinity, str):
            return parse_cpu_list(self.cpu_affinity)
        return list(self.cpu_affinity)


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = ""
    description: str = ""
    seed: int = 0
    jitter: bool = True
    system: SystemSpec = msgspec.field(default_factory=SystemSpec)
    gpus: list[GpuSpec] = []
    topology: TopologySpec = msgspec.field(default_factory=TopologySpec)
    timeline: list[FaultSpec] = []
    # Where it was loaded from, for error messages.
    source: str = ""


_PATH_IN_ERROR: Final = re.compile(r"^(.*) - at `\$\.?([^`]*)`$")


# --- small parsers ---------------------------------------------------------------


def parse_cpu_list(text: str) -> list[int]:
    """Linux cpulist syntax ("0-3,8,10-11") to CPU ids; raises ValueError."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, dash, high = part.partition("-")
        if dash:
            first, last = int(low), int(high)
            if last < first:
                raise ValueError(f"range {part!r} goes backwards")
            cpus.extend(range(first, last + 1))
        else:
            cpus.append(int(part))
    return sorted(set(cpus))


def _digest(*parts: object) -> bytes:
    return hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()


def generated_uuid(seed: int, slot: int) -> str:
    return f"GPU-{uuid_module.UUID(bytes=_digest(seed, slot, 'uuid')[:16])}"


def generated_serial(seed: int, slot: int) -> str:
    return "1652" + str(int.from_bytes(_digest(seed, slot, "serial")[:8], "big") % 10**9).zfill(9)


def _bus_candidates() -> list[str]:
    # 16 domains x 15 buses: far more GPUs than any node has.
    return [f"{d:08X}:{b:02X}:00.0" for d in range(16) for b in range(0x10, 0x100, 0x10)]


def fill_identity(
    spec: GpuSpec, *, seed: int, slot: int, used_buses: set[str], minor: int
) -> GpuSpec:
    """The spec with every empty identity field generated (deterministic from the seed)."""
    bus_id = spec.bus_id
    if not bus_id:
        bus_id = next(b for b in _bus_candidates() if b not in used_buses)
    bus_id = _normalize_bus(bus_id)
    used_buses.add(bus_id)
    return msgspec.structs.replace(
        spec,
        uuid=spec.uuid or generated_uuid(seed, slot),
        bus_id=bus_id,
        minor=spec.minor if spec.minor is not None else minor,
        serial=spec.serial or generated_serial(seed, slot),
        board_id=spec.board_id if spec.board_id is not None else int(bus_id.split(":")[1], 16) << 8,
        cpu_affinity=spec.cpus,
    )


def _normalize_bus(bus_id: str) -> str:
    bus = bus_id.strip().upper()
    parts = bus.split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"bus id {bus_id!r} is not DOMAIN:BUS:DEVICE.FUNCTION")
    return f"{int(parts[0], 16):08X}:{int(parts[1], 16):02X}:{parts[2]}"


# --- resolving and loading --------------------------------------------------------


def list_scenarios() -> list[str]:
    """The names of the scenarios shipped with gpulet."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def resolve_scenario(name_or_path: str | Path, *, relative_to: Path | None = None) -> Path:
    """The file of a scenario name ("dgx-h100") or path; raises ScenarioError."""
    text = str(name_or_path)
    candidates: list[Path] = []
    looks_like_path = isinstance(name_or_path, Path) or "/" in text or text.endswith(".toml")
    if looks_like_path:
        path = Path(text).expanduser()
        if not path.is_absolute() and relative_to is not None:
            candidates.append(relative_to / path)
        candidates.append(path)
    else:
        if relative_to is not None:
            candidates.append(relative_to / f"{text}.toml")
        candidates.append(SCENARIO_DIR / f"{text}.toml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ScenarioError(
        text,
        "",
        f"not found (looked at {', '.join(str(c) for c in candidates)}); "
        f"shipped scenarios: {', '.join(list_scenarios())}",
    )


def _read_tree(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The file's TOML tree with its ``base`` chain merged in."""
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(p.name for p in (*chain, resolved))
        raise ScenarioError(str(path), "base", f"circular base chain: {cycle}")
    try:
        tree = toml_document(path.read_bytes(), max_bytes=_MAX_SCENARIO_BYTES, what="TOML")
    except UntrustedDocumentError as exc:  # deep, huge or not UTF-8 too
        raise ScenarioError(str(path), "", f"invalid {exc}") from exc
    except OSError as exc:
        raise ScenarioError(str(path), "", f"cannot read: {exc}") from exc
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ScenarioError(str(path), "base", "must be a scenario name or path (a string)")
    base_path = _resolve_base(base, str(path), path.parent)
    return deep_merge(_read_tree(base_path, (*chain, resolved)), tree)


def _resolve_base(base: str, source: str, relative_to: Path | None) -> Path:
    try:
        return resolve_scenario(base, relative_to=relative_to)
    except ScenarioError as exc:
        raise ScenarioError(source, "base", f"{base!r} {exc.problem}") from exc


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Find, parse, check and complete a scenario; raises ScenarioError."""
    path = resolve_scenario(name_or_path)
    return scenario_from_tree(_read_tree(path), source=str(path), name=path.stem)


def scenario_from_toml(text: str, *, source: str = "<string>", name: str = "") -> Scenario:
    """A scenario from TOML text (its ``base`` is looked up among shipped scenarios)."""
    try:
        tree = toml_document(text, max_bytes=_MAX_SCENARIO_BYTES, what="TOML")
    except UntrustedDocumentError as exc:
        raise ScenarioError(source, "", f"invalid {exc}") from exc
    base = tree.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ScenarioError(source, "base", "must be a scenario name or path (a string)")
        tree = deep_merge(_read_tree(_resolve_base(base, source, None)), tree)
    return scenario_from_tree(tree, source=source, name=name)


def scenario_from_tree(tree: dict[str, Any], *, source: str, name: str = "") -> Scenario:
    tree = dict(tree)
    defaults = tree.pop("gpu_defaults", {})
    if not isinstance(defaults, dict):
        raise ScenarioError(source, "gpu_defaults", "must be a table")
    gpus = tree.get("gpus", [])
    if not isinstance(gpus, list) or not all(isinstance(g, dict) for g in gpus):
        raise ScenarioError(source, "gpus", "must be an array of tables ([[gpus]])")
    tree["gpus"] = [deep_merge(defaults, g) for g in gpus]
    tree.setdefault("name", name)
    tree["source"] = source
    try:
        scenario = msgspec.convert(tree, Scenario)
    except msgspec.ValidationError as exc:
        match = _PATH_IN_ERROR.match(str(exc))
        if match:
            raise ScenarioError(source, match.group(2), match.group(1)) from exc
        raise ScenarioError(source, "", str(exc)) from exc
    return _complete(scenario)


def _complete(scenario: Scenario) -> Scenario:
    source = scenario.source
    count = len(scenario.gpus)
    # Explicit bus ids first, so that generated ones never collide with a later GPU's.
    used_buses: set[str] = set()
    for slot, spec in enumerate(scenario.gpus):
        if not spec.bus_id:
            continue
        entry = f"gpus[{slot}].bus_id"
        try:
            bus = _normalize_bus(spec.bus_id)
        except ValueError as exc:
            raise ScenarioError(source, entry, str(exc)) from exc
        if bus in used_buses:
            raise ScenarioError(source, entry, f"{bus} is used by another GPU")
        used_buses.add(bus)
    gpus: list[GpuSpec] = []
    for slot, spec in enumerate(scenario.gpus):
        entry = f"gpus[{slot}]"
        try:
            gpus.append(
                fill_identity(
                    spec, seed=scenario.seed, slot=slot, used_buses=used_buses, minor=slot
                )
            )
        except ValueError as exc:
            raise ScenarioError(source, entry, str(exc)) from exc
        if spec.memory_total_mib <= 0 or not 0 <= spec.memory_used_mib <= spec.memory_total_mib:
            raise ScenarioError(source, entry, "memory_used_mib must be within memory_total_mib")
        if spec.nvswitch_links < 0:
            raise ScenarioError(source, f"{entry}.nvswitch_links", "must be >= 0")
        if spec.mig is not None:
            problem = check_mig(spec.mig, spec.memory_total_mib)
            if problem is not None:
                raise ScenarioError(source, f"{entry}.mig", problem)
    uuids = [g.uuid for g in gpus]
    if len(set(uuids)) != len(uuids):
        raise ScenarioError(source, "gpus", "two GPUs have the same uuid")
    _check_topology(scenario.topology, count, gpus, source)
    _check_timeline(scenario, count, source)
    return msgspec.structs.replace(scenario, gpus=gpus)


def _check_pair(gpus: tuple[int, int] | list[int], count: int, source: str, entry: str) -> None:
    a, b = gpus[0], gpus[1]
    for g in (a, b):
        if not 0 <= g < count:
            raise ScenarioError(source, entry, f"GPU {g} out of range (the scenario has {count})")
    if a == b:
        raise ScenarioError(source, entry, f"a GPU cannot be paired with itself ({a})")


def _check_topology(topology: TopologySpec, count: int, gpus: list[GpuSpec], source: str) -> None:
    try:
        parse_level(topology.default_level)
    except ValueError as exc:
        raise ScenarioError(source, "topology.default_level", str(exc)) from exc
    for i, group in enumerate(topology.groups):
        entry = f"topology.groups[{i}]"
        try:
            parse_level(group.level)
        except ValueError as exc:
            raise ScenarioError(source, f"{entry}.level", str(exc)) from exc
        for g in group.gpus:
            if not 0 <= g < count:
                raise ScenarioError(
                    source, entry, f"GPU {g} out of range (the scenario has {count})"
                )
    for i, pair in enumerate(topology.pairs):
        entry = f"topology.pairs[{i}]"
        _check_pair(pair.gpus, count, source, entry)
        try:
            parse_level(pair.level)
        except ValueError as exc:
            raise ScenarioError(source, f"{entry}.level", str(exc)) from exc
    if topology.matrix is not None:
        if len(topology.matrix) != count or any(len(row) != count for row in topology.matrix):
            raise ScenarioError(source, "topology.matrix", f"must be {count} x {count}")
        for a, row in enumerate(topology.matrix):
            for b, cell in enumerate(row):
                if a == b:
                    continue
                entry = f"topology.matrix[{a}][{b}]"
                try:
                    level = parse_level(cell)
                except ValueError as exc:
                    raise ScenarioError(source, entry, str(exc)) from exc
                if level != parse_level(topology.matrix[b][a]):
                    raise ScenarioError(source, entry, f"differs from matrix[{b}][{a}]")
    if topology.nvlinks_default < 0:
        raise ScenarioError(source, "topology.nvlinks_default", "must be >= 0")
    for i, link in enumerate(topology.nvlinks):
        entry = f"topology.nvlinks[{i}]"
        _check_pair(link.gpus, count, source, entry)
        if link.links < 0:
            raise ScenarioError(source, f"{entry}.links", "must be >= 0")
    direct = nvlink_matrix(topology, count)
    for slot in range(count):
        total = sum(direct[slot]) + gpus[slot].nvswitch_links
        if total > NVLINK_MAX_LINKS:
            raise ScenarioError(
                source,
                f"gpus[{slot}]",
                f"{total} NVLinks, more than NVML's maximum of {NVLINK_MAX_LINKS} per GPU",
            )


def _check_timeline(scenario: Scenario, count: int, source: str) -> None:
    order = sorted(range(len(scenario.timeline)), key=lambda i: scenario.timeline[i].at)
    slots = count
    for i in order:
        fault = scenario.timeline[i]
        entry = f"timeline[{i}] ({fault.fault!r} at {fault.at:g}s)"
        problem = check_fault(fault, slots, live=False)
        if problem is not None:
            raise ScenarioError(source, entry, problem)
        if fault.fault == "hot_add" and fault.gpu is None:
            if not scenario.gpus:
                raise ScenarioError(source, entry, "hot_add of a new GPU needs a GPU to copy")
            try:
                hot_add_spec(scenario.gpus[0], fault.spec)
            except ValueError as exc:
                raise ScenarioError(source, f"{entry}.spec", str(exc)) from exc
            slots += 1


def hot_add_spec(template: GpuSpec, overrides: dict[str, Any] | None) -> GpuSpec:
    """A new GPU: a copy of ``template`` without its identity, with ``overrides``."""
    tree = msgspec.to_builtins(template)
    for key in ("uuid", "bus_id", "minor", "serial", "board_id", "module_id", "lost_at_start"):
        tree.pop(key, None)
    tree.update(overrides or {})
    try:
        return msgspec.convert(tree, GpuSpec)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from exc
