"""The suite runs its test files in a shuffled order, so that no test can lean on one
that ran before it in the same worker (a shared control plane's RBAC, a module's
global state): a dependency shows up as a failure on some seed, and the seed repeats it.

* The order of the *files* is shuffled; the tests inside a file keep their order (a
  file's tests may share a module-scoped fixture by design).
* The seed is printed in the header and again at the end of the run (``-q`` drops the
  header): ``test files shuffled with seed N``. Repeat a run
  with ``--file-order-seed N``, or keep the collection order with
  ``--file-order-seed none``; ``$GPULET_TEST_SEED`` sets the default.
* Under pytest-xdist every worker must collect the same order: the controller draws
  the seed and hands it to each worker (``workerinput``), so ``--dist loadfile`` deals
  the shuffled files out to the workers.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

_KEY = "gpulet_file_order_seed"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--file-order-seed",
        default=os.environ.get("GPULET_TEST_SEED", ""),
        help="seed of the shuffled order of test files ('none': collection order; "
        "default: $GPULET_TEST_SEED, else a new one each run)",
    )


def pytest_configure(config: pytest.Config) -> None:
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None and _KEY in workerinput:
        seed = str(workerinput[_KEY])
    else:
        seed = str(config.getoption("--file-order-seed") or "") or str(random.randrange(1 << 31))
    config.stash[_SEED] = seed


_SEED = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # pytest-xdist's hook, on the controller
    node.workerinput[_KEY] = node.config.stash[_SEED]


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.stash[_SEED]
    if seed == "none":
        return "test files in collection order (--file-order-seed none)"
    return f"test files shuffled with seed {seed} (repeat: --file-order-seed {seed})"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.stash[_SEED]
    if seed == "none":
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(str(item.path), []).append(item)
    order = sorted(files)
    random.Random(seed).shuffle(order)
    items[:] = [item for name in order for item in files[name]]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The seed again at the end, where ``-q`` (which drops the header) still shows it."""
    if hasattr(config, "workerinput"):
        return
    terminalreporter.write_line(pytest_report_header(config))
