"""The ``gpulet`` command line.

``gpulet run`` starts every service in one process (with an embedded nats-server
unless ``--nats`` is given); ``gpulet serve <service>`` starts one service, the way each
sidecar container of the DaemonSet does. Only these two (and ``config show``) take the
server's flags (``--nvml``, ``--state-dir``, ``--metrics-port``, ``--log-level``).
Everything else is a client of a running agent (``health state``, ``allocator state``,
``watch``, ``mock inject``, ``reporter-preview``, ``fleet status``) or prints what it
knows (``schema``, ``config reference``, ``--version``), and takes only the flags that
say where the agent is: ``--config``, ``--set``, ``--node``, ``--nats``. ``gpulet
alerts`` is a client that keeps running, so it adds ``--metrics-port`` and
``--log-level``. A command group without its command (``gpulet health``) is its
``state``; it never starts a service.

Imports
-------
Every sidecar is a ``gpulet`` process, and what it imports stays resident. So ``run``
and ``serve`` build a parser without the client commands (their modules are not
imported; a client command imports only its own module), :mod:`gpulet.services` imports
no service until it is asked for, and a process whose services do not use aiohttp does
not load it (:func:`skip_unused_aiohttp`). tests/cli/test_sidecar_imports.py holds each
sidecar to its service's imports.

Errors
------
:func:`main` is the one place where exceptions become exit codes. A
:class:`~gpulet_common.errors.GpuletError` (whatever raised it, however many task
groups it crossed) is printed as one line, ``gpulet: <what is wrong>``, and exits with
its code: 2 for a :class:`~gpulet_common.errors.UsageError` (a flag, a setting, a
config file, a state directory, a busy port, a missing mock scenario), 1 for a failure
gpulet can explain (the embedded nats-server could not be brought back). argparse's own
errors are one line and exit 2 too. Before a service starts, :func:`preflight` checks
what would otherwise fail deep inside it (state directory, mock scenario, ports), so a
mistake is reported before the first log line. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import Any, NoReturn

import anyio

from gpulet import services
from gpulet.gpu_source import switch_source
from gpulet.version import VersionAction
from gpulet_common import config
from gpulet_common.cli_support import LOCAL_NATS_URL
from gpulet_common.config import ConfigError
from gpulet_common.errors import explained, one_line
from gpulet_common.logutil import setup_logging
from gpulet_common.settings import Settings

DEFAULT_SIDECAR_NATS = LOCAL_NATS_URL


def _client_flags(
    parser: argparse.ArgumentParser, *, serves: bool = False
) -> argparse._ArgumentGroup:
    """What every command that reads settings takes: where the node's NATS is, which node.

    ``serves``: the command keeps running and serves ``/healthz`` (``gpulet alerts``):
    ``--metrics-port`` and ``--log-level`` too.
    """
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
    group.add_argument(
        "--nats",
        help=f"NATS server URL(s), comma-separated (default for tools: {LOCAL_NATS_URL})",
    )
    if serves:
        group.add_argument("--metrics-port", type=int, help="port of /metrics, /healthz, /readyz")
        group.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return group


def _server_flags(parser: argparse.ArgumentParser) -> None:
    """What the commands that run services take besides :func:`_client_flags`."""
    group = _client_flags(parser, serves=True)
    group.add_argument(
        "--nvml",
        metavar="auto|nvml|mock[:SCENARIO]",
        help="NVML backend; mock runs against a scenario (default dgx-h100)",
    )
    group.add_argument("--state-dir", help="directory for state (checkpoints, buffers, NATS)")


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
        from gpulet_common.nvml.loader import parse_nvml_flag

        try:
            backend, scenario = parse_nvml_flag(nvml)
        except ValueError as exc:
            raise ConfigError("--nvml", str(exc).removeprefix(f"--nvml {nvml!r}: ")) from None
        flat["nvml.backend"] = backend
        if scenario:
            flat["nvml.scenario"] = scenario
    for dotted, value in flat.items():
        config._set_path(tree, dotted, value)
    return tree


def load_settings(args: argparse.Namespace) -> Settings:
    return config.load(getattr(args, "config", None), overrides=_flag_overrides(args))


def _check_state_dir(state_dir: str, *, writable: bool) -> bool:
    """Raise unless ``state_dir`` is a usable directory; create it when missing (True:
    it was created, which the caller says once logging is set up)."""
    path = Path(state_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError("state_dir", f"{path} is not a directory")
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("state_dir", f"cannot create {path}: {exc.strerror or exc}") from None
    if not os.access(path, (os.W_OK | os.X_OK) if writable else os.X_OK):
        raise ConfigError("state_dir", f"{path} is not {'writable' if writable else 'usable'}")
    return created


# The likely cause of a taken port, and the way round it, per setting.
BUSY_PORT_GUESS = {
    "nats.embedded_port": (
        "another `gpulet run` or `make run`, still running? stop it, or give this one "
        "another port: --set nats.embedded_port=PORT"
    ),
    "telemetry.http_port": (
        "another gpulet process, still running? stop it, or give this one another "
        "port: --metrics-port PORT"
    ),
}


def _check_listen(host_setting: str, port_setting: str, host: str, port: int) -> None:
    """That ``host:port`` can be listened on now (the server binds it moments later)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(host_setting, f"cannot listen on {host!r}: {exc}") from None
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # What servers set (nats-server, anyio): a port in TIME_WAIT is free to them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    port_setting,
                    f"{host}:{port} is already in use by another process"
                    f" ({BUSY_PORT_GUESS[port_setting]})",
                ) from None
            raise ConfigError(
                host_setting, f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None


def preflight(
    settings: Settings, *, embedded_nats: bool, names: Sequence[str] = services.RUN_ORDER
) -> bool:
    """Raise a :class:`UsageError` for what would stop the services ``names`` starting.
    True when it created the state directory."""
    writes = embedded_nats or bool(services.WRITES_STATE_DIR.intersection(names))
    created = _check_state_dir(settings.state_dir, writable=writes)
    if settings.nvml.backend == "mock":
        from gpulet_common.mock_nvml.scenario import load_scenario

        load_scenario(settings.nvml.scenario)  # a ScenarioError is a usage error
    nats = settings.nats
    if embedded_nats:
        _check_listen(
            "nats.embedded_host", "nats.embedded_port", nats.embedded_host, nats.embedded_port
        )
    telemetry = settings.telemetry
    if embedded_nats and telemetry.http_port and telemetry.http_port == nats.embedded_port:
        raise ConfigError(
            "telemetry.http_port", f"{telemetry.http_port} is nats.embedded_port as well"
        )
    if telemetry.http_port:
        _check_listen(
            "telemetry.http_host", "telemetry.http_port", telemetry.http_host, telemetry.http_port
        )
    return created


def skip_unused_aiohttp(settings: Settings, names: Sequence[str]) -> bool:
    """Keep aiohttp (~25 MB of RSS) out of a process whose services do not use it (the
    collector, the health service and the device plugin; ``ws://`` NATS URLs still
    need it).

    nats-py imports aiohttp for its WebSocket transport only, and carries on without it
    when the import fails; so when no service here uses it (see
    :data:`services.USES_AIOHTTP`) and no NATS URL is a WebSocket one, the import is
    made to fail. True when it was.
    """
    urls = [u.strip().lower() for u in settings.nats.url.split(",")]
    if services.USES_AIOHTTP.intersection(names) or any(u.startswith("ws") for u in urls):
        return False
    if "aiohttp" in sys.modules:
        return sys.modules["aiohttp"] is None
    sys.modules["aiohttp"] = None  # type: ignore[assignment]
    return True


def _run_services(args: argparse.Namespace, names: list[str], *, sidecar: bool) -> int:
    settings = load_settings(args)
    embedded = not settings.nats.url
    if embedded and sidecar:
        settings.nats.url = DEFAULT_SIDECAR_NATS
        embedded = False
    skip_unused_aiohttp(settings, names)
    # kubernetes-asyncio's dynamic client imports kubernetes-validate (and jsonschema
    # under it, ~10 MB) whenever it is installed; gpulet validates nothing with it.
    sys.modules.setdefault("kubernetes_validate", None)  # type: ignore[arg-type]

    from gpulet.agent import run_agent
    from gpulet_common.telemetry import Telemetry

    for name in names:  # now, so that a missing extra (grpcio...) stops it at once
        services.factory(name)
    created = preflight(settings, embedded_nats=embedded, names=names)
    # `gpulet run` with its own server: the state dir is this run's alone.
    switched = switch_source(settings) if embedded else None
    setup_logging(settings.telemetry.log_level, settings.telemetry.log_format)
    log = logging.getLogger("gpulet")
    if created:
        log.info(
            "created the state directory %s (it did not exist; --state-dir chooses another)",
            settings.state_dir,
        )
    if switched:
        log.warning("%s", switched)
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
        if not names:
            raise ConfigError("--only", "names no service")
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


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a mistake reported as one line (and exit 2) instead of the usage.

    A command group may name a ``default_action``: ``gpulet health --node X`` is then
    ``gpulet health state --node X`` (what an operator asking about health means),
    and ``gpulet health --help`` still lists the group's commands.
    """

    default_action: str | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.default_action is not None and args is not None:
            args = self._command_first(list(args), self.default_action)
        return super().parse_known_args(args, namespace)

    def _command_first(self, args: list[str], default: str) -> list[str]:
        """``[--nats URL, state, --gpu 0]`` as ``[state, --nats URL, --gpu 0]``: the
        settings flags may come before the command; no command is ``default``."""
        commands = {
            name: child
            for action in self._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, child in action.choices.items()
        }
        options = commands[default]._option_string_actions
        at = 0
        while at < len(args):
            arg = args[at]
            if arg in HELP:
                return args
            if arg in commands:
                return [arg, *args[:at], *args[at + 1 :]]
            action = options.get(arg)
            at += 2 if action is not None and action.nargs != 0 else 1
        return [default, *args]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")


HELP = ("-h", "--help")


# The commands defined here: their parser imports no other command's module, so a
# sidecar (run, serve) loads only what its service uses.
OWN_COMMANDS = frozenset({"run", "serve", "config"})


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser for ``command`` (the first argument): with the module of that command
    only (none for :data:`OWN_COMMANDS`), or with every command when it names none
    of them (``gpulet --help``, a typo)."""
    parser = OneLineParser(prog="gpulet", description="GPU node agent for Kubernetes, over NATS.")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run every service in one process (embedded nats-server)")
    _server_flags(run)
    run.add_argument("--only", help="comma-separated subset of services to run")
    run.set_defaults(func=_cmd_run)

    serve = sub.add_parser(
        "serve",
        help="run one service alone, as each sidecar container of the DaemonSet does",
        description=(
            "Run one service in this process. It connects to the pod's NATS\n"
            f"(--nats, default {LOCAL_NATS_URL}) instead of starting a server."
        ),
        epilog="services:\n"
        + "\n".join(f"  {name:<14} {line}" for name, line in services.SUMMARIES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "service",
        choices=list(services.REGISTRY),
        metavar="SERVICE",
        help="one of: " + ", ".join(services.REGISTRY),
    )
    _server_flags(serve)
    serve.set_defaults(func=_cmd_service)

    cfg = sub.add_parser("config", help="show the effective settings")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", help="print the merged settings as JSON")
    _server_flags(show)
    show.set_defaults(func=_cmd_config_show)

    reference = cfg_sub.add_parser("reference", help="print the settings reference (Markdown)")
    reference.set_defaults(func=_cmd_config_reference)

    if command in OWN_COMMANDS:
        return parser
    owners = [m for m, names in services.COMMAND_MODULES.items() if command in names]
    for module_name in owners or services.COMMAND_MODULES:
        try:
            module = import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_commands(sub, _client_flags, load_settings)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except Exception as exc:
        error = explained(exc)
        if error is None:
            raise
        print(f"gpulet: {one_line(str(error))}", file=sys.stderr)
        code = error.exit_code
    sys.exit(code)
