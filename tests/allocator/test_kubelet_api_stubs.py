"""The committed kubelet API stubs are what scripts/gen-protos makes of the protos."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2

from gpulet_allocator.kubelet_api.deviceplugin.v1beta1 import api_pb2 as dp
from gpulet_common.kubelet_api.podresources.v1 import api_pb2 as pr

ROOT = Path(__file__).resolve().parents[2]
# (include root, kubelet_api package) of each generated tree, as in scripts/gen-protos.
TREES = (
    (ROOT / "services" / "allocator", Path("gpulet_allocator") / "kubelet_api"),
    (ROOT / "libs" / "common", Path("gpulet_common") / "kubelet_api"),
)
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def committed_stubs() -> dict[Path, Path]:
    """Path relative to its include root -> the committed file."""
    return {
        p.relative_to(root): p
        for root, api in TREES
        for p in (root / api).rglob("*_pb2*")
        if p.name.endswith(STUB_SUFFIXES)
    }


def generated_with() -> dict[str, str]:
    recorded: dict[str, str] = {}
    for root, api in TREES:
        lines = (root / api / "GENERATED_WITH").read_text().splitlines()
        for line in lines:
            if line.strip():
                name, _, installed = line.partition(" ")
                recorded[name] = installed
    return recorded


def test_wire_names_are_kubelets() -> None:
    assert dp.DESCRIPTOR.package == "v1beta1"
    assert {s.full_name for s in dp.DESCRIPTOR.services_by_name.values()} == {
        "v1beta1.Registration",
        "v1beta1.DevicePlugin",
    }
    assert [m.name for m in dp.DESCRIPTOR.services_by_name["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    assert pr.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    pytest.importorskip("mypy_protobuf", reason="mypy-protobuf generates api_pb2_grpc.pyi")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-protos"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert all((tmp_path / api / "GENERATED_WITH").exists() for _, api in TREES)
    committed = committed_stubs()
    assert set(committed) == {
        p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*") if p.name.endswith(STUB_SUFFIXES)
    }

    # What matters on the wire: the descriptors compiled from the protos.
    for module in (dp, pr):
        fresh = (tmp_path / module.DESCRIPTOR.name).with_name("api_pb2.py")
        serialized = _serialized_descriptor(fresh.read_text())
        assert descriptor_pb2.FileDescriptorProto.FromString(serialized) == _proto(module)

    # Byte for byte when the same generators made them; other versions format the
    # files differently, and the descriptor check above still guards the protos.
    recorded = generated_with()
    installed = {name: version(name) for name in recorded}
    if installed != recorded:
        pytest.skip(f"stubs made by {recorded}, installed generators are {installed}")
    stale = [
        str(rel) for rel, p in committed.items() if p.read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert not stale, f"stale stubs, run scripts/gen-protos: {stale}"


def _proto(module: ModuleType) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


def _serialized_descriptor(source: str) -> bytes:
    # The generated module registers its file in the default pool, which already
    # holds the committed one; read the serialized bytes instead of importing it.
    marker = "AddSerializedFile("
    start = source.index(marker) + len(marker)
    end = source.index(")\n", start)
    value = ast.literal_eval(source[start:end])
    assert isinstance(value, bytes)
    return value
