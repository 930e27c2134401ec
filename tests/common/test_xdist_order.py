"""The suite's xdist order (tests/support/xdist_order.py): its table names real files,
tests/kube is one unit, and the longest expected unit starts first."""

from __future__ import annotations

from pathlib import Path

from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]

from support import xdist_order

ROOT = Path(__file__).resolve().parents[2]


def test_every_measured_unit_exists() -> None:
    # A renamed or deleted file would leave its entry behind, ordering nothing.
    for unit in xdist_order.SECONDS:
        path = ROOT / unit
        assert path.is_file() or (path.is_dir() and unit in xdist_order.ONE_UNIT), unit


def test_tests_kube_is_one_unit_and_other_files_their_own() -> None:
    assert xdist_order.unit_of("tests/kube/test_dra_real.py") == "tests/kube"
    assert xdist_order.unit_of("tests/kube/sub/test_x.py") == "tests/kube"
    assert xdist_order.unit_of("tests/kubelet/test_x.py") == "tests/kubelet/test_x.py"
    assert xdist_order.unit_of("tests/cli/test_cli_errors.py") == "tests/cli/test_cli_errors.py"


def test_the_longest_expected_unit_starts_first() -> None:
    units = {
        "tests/nvml/test_mock_nvml.py": 48,  # many quick tests: 9.6 s expected
        "tests/faults/test_api_faults.py": 1,  # one test of a minute
        "tests/kube": 42,
        "tests/new/test_huge.py": 1000,  # not measured: a fifth of a second a test
    }
    order = sorted(units, key=lambda u: xdist_order.order_key(u, units[u]))
    assert order == [
        "tests/new/test_huge.py",
        "tests/kube",
        "tests/faults/test_api_faults.py",
        "tests/nvml/test_mock_nvml.py",
    ]


def test_the_scheduler_is_xdists_loadfile() -> None:
    assert issubclass(xdist_order.HeavyFirstScheduling, LoadFileScheduling)
