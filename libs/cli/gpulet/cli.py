"""The ``gpulet`` command line.

``gpulet run`` starts every service in one process (with an embedded nats-server
unless ``--nats`` is given); ``gpulet <service>`` starts one service, the way each
sidecar container of the DaemonSet does. The tools (``watch``, ``schema``, ``mock``,
``config``) talk to a running agent over NATS or print what they know.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import Any

import anyio

from gpulet import services, tools
from gpulet_common import config
from gpulet_common.config import ConfigError
from gpulet_common.logutil import setup_logging
from gpulet_common.settings import Settings

DEFAULT_SIDECAR_NATS = "nats://127.0.0.1:4222"


def _settings_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("settings (override file and environment)")
    group.add_argument("--config", "-c", help="config file (TOML or JSON); also $GPULET_CONFIG")
    group.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any setting, e.g. --set collector.sample_period_s=0.5",
    )
    group.add_argument("--node", help="node name (default: $NODE_NAME, then the host name)")
    group.add_argument("--nats", help="NATS server URL(s), comma-separated")
    group.add_argument(
        "--nvml",
        metavar="auto|nvml|mock[:SCENARIO]",
        help="NVML backend; mock runs against a scenario (default dgx-h100)",
    )
    group.add_argument("--state-dir", help="directory for state (checkpoints, buffers, NATS)")
    group.add_argument("--metrics-port", type=int, help="port of /metrics, /healthz, /readyz")
    group.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    tree = config.overrides_layer(list(args.overrides or []))
    flat: dict[str, Any] = {}
    if getattr(args, "node", None):
        flat["node_name"] = args.node
    if getattr(args, "state_dir", None):
        flat["state_dir"] = args.state_dir
    if getattr(args, "nats", None):
        flat["nats.url"] = args.nats
    if getattr(args, "metrics_port", None) is not None:
        flat["telemetry.http_port"] = args.metrics_port
    if getattr(args, "log_level", None):
        flat["telemetry.log_level"] = args.log_level
    nvml = getattr(args, "nvml", None)
    if nvml:
        backend, _, scenario = nvml.partition(":")
        flat["nvml.backend"] = backend
        if scenario:
            flat["nvml.scenario"] = scenario
    for dotted, value in flat.items():
        config._set_path(tree, dotted, value)
    return tree


def load_settings(args: argparse.Namespace) -> Settings:
    return config.load(getattr(args, "config", None), overrides=_flag_overrides(args))


def _run_services(args: argparse.Namespace, names: list[str], *, sidecar: bool) -> int:
    from gpulet.agent import run_agent
    from gpulet_common.telemetry import Telemetry

    settings = load_settings(args)
    setup_logging(settings.telemetry.log_level, settings.telemetry.log_format)
    embedded = not settings.nats.url
    if embedded and sidecar:
        settings.nats.url = DEFAULT_SIDECAR_NATS
        embedded = False
    telemetry = Telemetry.install(settings.telemetry, "gpulet-" + "-".join(names))
    try:
        anyio.run(lambda: run_agent(settings, names, embedded_nats=embedded))
    except KeyboardInterrupt:
        pass
    finally:
        telemetry.shutdown()
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    names = list(services.RUN_ORDER)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - set(services.REGISTRY))
        if unknown:
            raise ConfigError(
                "--only", f"unknown service(s) {unknown}; known: {sorted(services.REGISTRY)}"
            )
    return _run_services(args, names, sidecar=False)


def _cmd_service(args: argparse.Namespace) -> int:
    return _run_services(args, [args.service], sidecar=True)


def _cmd_config_show(args: argparse.Namespace) -> int:
    settings = load_settings(args)
    print(json.dumps(config.dump(settings), indent=2))
    return 0


def _cmd_config_reference(_args: argparse.Namespace) -> int:
    from gpulet_common.config_reference import markdown

    print(markdown(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpulet", description="GPU node agent for Kubernetes, over NATS."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run every service in one process")
    _settings_flags(run)
    run.add_argument("--only", help="comma-separated subset of services to run")
    run.set_defaults(func=_cmd_run)

    for name in services.REGISTRY:
        p = sub.add_parser(name, help=f"run the {name} service alone (sidecar mode)")
        _settings_flags(p)
        p.set_defaults(func=_cmd_service, service=name)

    cfg = sub.add_parser("config", help="show the effective settings")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", help="print the merged settings as JSON")
    _settings_flags(show)
    show.set_defaults(func=_cmd_config_show)

    reference = cfg_sub.add_parser("reference", help="print the settings reference (Markdown)")
    reference.set_defaults(func=_cmd_config_reference)

    tools.add_commands(sub, _settings_flags, load_settings)
    for module_name in services.COMMAND_MODULES:
        try:
            module = import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_commands(sub, _settings_flags, load_settings)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except ConfigError as exc:
        print(f"gpulet: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)
