"""The order in which ``pytest -n 2 --dist loadfile`` hands test files to its workers.

xdist's ``loadfile`` keeps a file on one worker and, by default, starts the files with
the most tests first. Test count is a poor guess at duration here: the longest files
hold one test each (the fleet storm, the minute of API faults, the service kills: about
a minute each), so they started last and the run ended with one worker alone on one of
them while the other idled. And tests/kube's files hold a few tests each, but every
worker that runs one of them starts its own real control plane (``kube_api`` and
``kube_cluster`` are session fixtures, and each xdist worker is a session of its own).

So this scheduler, used only with ``--dist loadfile`` (the Makefile's ``PYTEST_ARGS``):

- makes tests/kube ONE unit of work: one control plane per run instead of one per
  worker (etcd, kube-apiserver, kube-scheduler and kube-controller-manager: about
  5 s of CPU to start, about 3% of a core while they idle until the session ends);
- starts the units longest first (:func:`estimate_s`: the measured seconds of the long
  ones in :data:`SECONDS`, a fraction of a second a test for the rest), so that the run
  ends on short files, the two workers finishing close together.

Nothing changes for a run without xdist (``-n 0``, ``PYTEST_ARGS=``), nor for another
``--dist``. The order changes only when files start, never what a test does.
"""

from __future__ import annotations

from typing import Any

import pytest

# Seconds each long unit of work took, measured one directory at a time with
# ``pytest -q -n 0 --junitxml`` on the 2-core development machine under load (the sum of
# a file's test times, setup and teardown included); refresh them when a file's time
# changes much. An order, not a promise: only which unit starts before which matters.
SECONDS: dict[str, float] = {
    "tests/kube": 90.0,  # 70 s measured; other files are being added
    "tests/robustness/test_bad_input_allocator.py": 126.0,
    "tests/robustness/test_bad_input_loaders.py": 91.0,
    "tests/robustness/test_bad_input_codecs.py": 74.0,
    "tests/fleet/test_fleet_faults.py": 64.0,
    "tests/faults/test_api_faults.py": 61.0,
    "tests/cli/test_cli_errors.py": 47.0,
    "tests/faults/test_service_kills.py": 41.0,
    "tests/reporter/test_reporter_service.py": 25.0,
    "tests/robustness/test_hostile_bus.py": 20.0,
    "tests/cli/test_sidecar_imports.py": 21.0,
    "tests/faults/test_pod_replacement.py": 18.0,
    "tests/faults/test_nvml_faults.py": 17.0,
    "tests/allocator/test_koordinator_handshake.py": 16.0,
    "tests/allocator/test_koordinator.py": 15.0,
    "tests/reporter/test_node_condition.py": 14.0,
    "tests/cli/test_agent_process.py": 13.0,
    "tests/common/test_codec_limits.py": 12.0,
    "tests/deploy/test_deploy_sidecars.py": 12.0,
    "tests/health/test_health_service.py": 11.0,
    "tests/cli/test_agent_nvlink.py": 11.0,
    "tests/deploy/test_deploy_prometheus.py": 11.0,
    "tests/cli/test_agent_dra.py": 10.0,
    "tests/deploy/test_dcgm_dashboard.py": 9.0,
}

# The estimate for a unit not in SECONDS: most tests take a fraction of a second.
PER_TEST_S = 0.2

# Files of one of these directories form a single unit of work.
ONE_UNIT: tuple[str, ...] = ("tests/kube",)


def unit_of(file: str) -> str:
    """The unit of work of a test file (its path relative to the rootdir)."""
    for directory in ONE_UNIT:
        if file.startswith(directory + "/"):
            return directory
    return file


def estimate_s(unit: str, tests: int) -> float:
    """How long ``unit`` (of ``tests`` tests) is expected to take."""
    return SECONDS.get(unit, PER_TEST_S * tests)


def order_key(unit: str, tests: int) -> float:
    """Sort key: the longest expected first."""
    return -estimate_s(unit, tests)


try:
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - xdist is in the test extras
    LoadFileScheduling = None


if LoadFileScheduling is not None:

    class HeavyFirstScheduling(LoadFileScheduling):  # type: ignore[misc]
        """``--dist loadfile`` with :func:`unit_of` and :func:`order_key`."""

        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(str(super()._split_scope(nodeid)))

        def _assign_work_unit(self, node: Any) -> None:
            # The base class has filled its queue in collection order (or by test count)
            # by the time it hands out the first unit: order it once, here.
            if not self._ordered:
                self._ordered = True
                units = sorted(self.workqueue.items(), key=lambda u: order_key(u[0], len(u[1])))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if LoadFileScheduling is None or config.getvalue("dist") != "loadfile":
        return None
    return HeavyFirstScheduling(config, log)
