"""The one PCI bus-id parser and its two written forms (gpulet_common.pci)."""

from __future__ import annotations

import pytest

from gpulet_common.pci import nvml_bus_id, split_bus_id, sysfs_bus_id


@pytest.mark.parametrize(
    ("given", "nvml", "sysfs"),
    [
        ("00000000:3B:00.0", "00000000:3B:00.0", "0000:3b:00.0"),
        ("0000:3b:00.0", "00000000:3B:00.0", "0000:3b:00.0"),
        ("3b:00.0", "00000000:3B:00.0", "0000:3b:00.0"),
        (" 00000001:DB:00.0 ", "00000001:DB:00.0", "0001:db:00.0"),
    ],
)
def test_every_form_reads_and_writes_both_ways(given: str, nvml: str, sysfs: str) -> None:
    assert nvml_bus_id(given) == nvml
    assert sysfs_bus_id(given) == sysfs


@pytest.mark.parametrize("junk", ["", "3b", "zz:3b:00.0", "a:b:c:d", "GPU-1234"])
def test_what_is_not_a_bus_id_is_none(junk: str) -> None:
    assert split_bus_id(junk) is None
    assert nvml_bus_id(junk) is None
    assert sysfs_bus_id(junk) is None
