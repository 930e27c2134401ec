"""open_nvml: the real library when it loads, degraded with a reason otherwise, or the mock."""

from __future__ import annotations

import sys

import pynvml
import pytest

from gpulet_common.mock_nvml import MockNvml, ScenarioError
from gpulet_common.nvml import NvmlAdapter, NvmlUnavailable, open_nvml, parse_nvml_flag
from gpulet_common.settings.nvml import NvmlSettings
from support.host import HIDDEN_DRIVER


def test_real_pynvml_without_library_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    # pynvml's own search for libnvidia-ml.so.1 fails, whatever this host has.
    monkeypatch.setattr(pynvml, "nvmlLib", None)

    def no_library(name: str) -> object:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(pynvml, "CDLL", no_library)
    adapter = NvmlAdapter(pynvml, backend="nvml")
    with pytest.raises(NvmlUnavailable) as caught:
        adapter.init()
    assert caught.value.code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert "libnvidia-ml.so.1" in caught.value.reason


# "No NVML" is made by each test, never assumed from the host: HIDDEN_DRIVER does not
# exist on any machine, GPU hosts included.
def test_auto_falls_back_to_degraded_with_a_hint() -> None:
    adapter, reason = open_nvml(NvmlSettings(backend="auto", library=HIDDEN_DRIVER))
    assert adapter is None
    assert reason is not None
    assert "NVML library not found" in reason
    assert HIDDEN_DRIVER in reason
    assert "--nvml mock" in reason


def test_explicit_nvml_backend_is_degraded_too() -> None:
    adapter, reason = open_nvml(NvmlSettings(backend="nvml", library=HIDDEN_DRIVER))
    assert adapter is None
    assert reason is not None
    assert reason.startswith("backend 'nvml' requested")
    assert "--nvml mock" in reason


def test_missing_bindings_are_degraded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    adapter, reason = open_nvml(NvmlSettings(backend="auto"))
    assert adapter is None
    assert reason is not None
    assert "nvidia-ml-py" in reason
    assert "--nvml mock" in reason


def test_mock_backend_plays_the_scenario() -> None:
    adapter, reason = open_nvml(NvmlSettings(backend="mock", scenario="pcie-7gpu"))
    assert reason is None
    assert adapter is not None
    assert adapter.backend == "mock"
    assert isinstance(adapter.module, MockNvml)
    inventory = adapter.inventory("node-1", 1)
    assert inventory.nvml_backend == "mock"
    assert len(inventory.gpus) == 7
    adapter.shutdown()
    assert not adapter.initialized


def test_mock_backend_with_a_bad_scenario_fails_loudly() -> None:
    with pytest.raises(ScenarioError, match="no-such-node"):
        open_nvml(NvmlSettings(backend="mock", scenario="no-such-node"))


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("mock", ("mock", None)),
        ("mock:t4", ("mock", "t4")),
        ("mock:/etc/gpulet/node.toml", ("mock", "/etc/gpulet/node.toml")),
        ("auto", ("auto", None)),
        ("NVML", ("nvml", None)),
    ],
)
def test_parse_nvml_flag(flag: str, expected: tuple[str, str | None]) -> None:
    assert parse_nvml_flag(flag) == expected


@pytest.mark.parametrize("flag", ["cuda", "nvml:t4", ""])
def test_parse_nvml_flag_rejects(flag: str) -> None:
    with pytest.raises(ValueError, match="--nvml"):
        parse_nvml_flag(flag)
