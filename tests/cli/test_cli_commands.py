"""The shape of the command line: ``--version``, and which command takes which flags.

A client of a running agent (``health state``, ``allocator state``, ``watch``, ``mock
inject``, ``alerts``, ``reporter-preview``, ``fleet status``) shows only the flags it
uses; the server's (``--nvml``, ``--state-dir``) belong to ``run`` and ``serve``. A
command group without a command shows state and never starts a service.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from typing import Any

import pytest

from gpulet import services
from gpulet.cli import build_parser
from gpulet.version import driver_version
from gpulet_common import __version__
from gpulet_common.messages import SCHEMA_VERSION
from support.agent_process import GPULET

SERVER_ONLY = ("--nvml", "--state-dir")
SERVES = ("--metrics-port", "--log-level")
CLIENT = ("--config", "--set", "--node", "--nats")


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.update(_commands(child, (*path, name)))
    if not found and path:
        found[" ".join(path)] = parser
    return found


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_version_names_gpulet_the_schema_and_the_driver() -> None:
    env = {**os.environ, "GPULET_NVML__LIBRARY": "/nonexistent/libnvidia-ml.so.1"}
    result = subprocess.run(
        [*GPULET, "--version"], capture_output=True, text=True, env=env, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"gpulet {__version__}",
        f"message schema {SCHEMA_VERSION}",
        "NVML driver none (/nonexistent/libnvidia-ml.so.1 not found)",
    ]


def test_driver_version_without_nvml_initialises_nothing() -> None:
    # A library that loads but is not NVML: said so, no crash, no hang.
    assert driver_version("libc.so.6").startswith("unknown (")
    assert driver_version("/nonexistent.so").startswith("none (")


def test_client_commands_show_only_client_flags() -> None:
    commands = _commands(build_parser())
    clients = [
        "health state",
        "health clear",
        "allocator state",
        "allocator release",
        "allocator reset",
        "watch",
        "mock inject",
        "alerts",
        "reporter-preview",
        "fleet status",
        "fleet setup",
    ]
    for name in clients:
        flags = _flags(commands[name])
        assert set(CLIENT) <= flags, name
        assert not flags.intersection(SERVER_ONLY), name
        # Only `alerts` keeps running and serves /healthz.
        assert bool(flags.intersection(SERVES)) == (name == "alerts"), name
    for name in ("run", "serve", "config show"):
        assert set(CLIENT + SERVER_ONLY + SERVES) <= _flags(commands[name]), name


def test_every_service_runs_with_serve_and_nothing_else() -> None:
    parser = build_parser()
    for name in services.REGISTRY:
        args = parser.parse_args(["serve", name, "--state-dir", "/tmp/x"])
        assert (args.command, args.service) == ("serve", name)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["health", "--node", "X"], "state"),
        (["health"], "state"),
        (["health", "clear", "--gpu", "GPU-1"], "clear"),
        (["allocator", "--node", "X", "--json"], "state"),
        (["allocator", "release", "a1"], "release"),
    ],
)
def test_a_group_without_a_command_shows_state(argv: list[str], command: str) -> None:
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]
    chosen = args.health_command if argv[0] == "health" else args.allocator_action
    assert chosen == command
    assert getattr(args, "node", None) == ("X" if "--node" in argv else None)


@pytest.mark.parametrize(
    "argv", [["health", "--state-dir", "/tmp/x"], ["watch", "x", "--nvml=mock"]]
)
def test_a_client_refuses_server_flags(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2


def test_each_command_module_adds_the_commands_it_is_listed_for() -> None:
    # The CLI imports only the module of the command it runs: the list must be right.
    everything = set(_commands(build_parser()))
    for module_name, names in services.COMMAND_MODULES.items():
        parser = build_parser(names[0])
        added = {c.split()[0] for c in _commands(parser)} - {"run", "serve", "config"}
        assert added == set(names), module_name
    listed = {n for names in services.COMMAND_MODULES.values() for n in names}
    assert {c.split()[0] for c in everything} == listed | {"run", "serve", "config"}
