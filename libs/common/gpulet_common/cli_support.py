"""What a package needs to add its own subcommands to ``gpulet``.

The ``gpulet`` CLI imports each service's ``cli`` module and calls its
``add_commands(subparsers, add_flags, load_settings)``. ``add_flags`` adds the flags of
a client of a running agent (``--config``, ``--set``, ``--node``, ``--nats``; with
``serves=True`` also ``--metrics-port`` and ``--log-level``); the server's flags
(``--nvml``, ``--state-dir``) belong to ``gpulet run`` and ``gpulet serve`` only. The
types of those arguments, the way a tool reaches the node's NATS and the glue between
argparse and a command live here once, so every service's tools behave alike: a tool
connects with :func:`tool_bus`, and a one-question tool asks with :func:`ask_agent`,
which says on stderr, the same way for every service, why no answer came.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol, TypeVar
from urllib.parse import urlsplit

import anyio
import msgspec

from gpulet_common.refusal import BusError, NatsUnreachable, Refused, RequestTimeout
from gpulet_common.settings import Settings
from gpulet_common.settings.nats import NatsSettings

if TYPE_CHECKING:
    from gpulet_common.bus import Bus
    from gpulet_common.codec import Codec

T = TypeVar("T")
R = TypeVar("R")

# The node-local NATS a tool talks to when no URL is configured: the NATS sidecar of
# the pod, or the embedded server of `gpulet run`.
LOCAL_NATS_URL = "nats://127.0.0.1:4222"


class AddFlags(Protocol):
    def __call__(self, parser: argparse.ArgumentParser, *, serves: bool = False) -> object: ...


LoadSettings = Callable[[argparse.Namespace], Settings]
Command = Callable[[argparse.Namespace, LoadSettings], int]


GPU_METAVAR = "UUID|INDEX"


def add_gpu_flag(parser: argparse.ArgumentParser, help: str, *, required: bool = False) -> None:
    """``--gpu``: the one way every command names a GPU, by its UUID or its index."""
    parser.add_argument(
        "--gpu", metavar=GPU_METAVAR, required=required, type=_gpu, default=None, help=help
    )


def _gpu(value: str) -> str:
    value = value.strip()
    if not value:
        raise argparse.ArgumentTypeError("a GPU's UUID or index, e.g. --gpu 0 or --gpu GPU-...")
    return value


def gpu_index(value: str) -> int | None:
    """The index that ``--gpu`` names, or None when it names a UUID."""
    return int(value) if value.isdecimal() else None


def tool_nats(settings: Settings) -> NatsSettings:
    """The NATS settings a tool connects with: the configured URL, else the local one."""
    if settings.nats.url:
        return settings.nats
    return msgspec.structs.replace(settings.nats, url=LOCAL_NATS_URL)


# What a tool adds when the node-local NATS (no URL configured) does not answer.
NOT_RUNNING_HINT = "is gpulet running? `make run` starts it"


@asynccontextmanager
async def tool_bus(settings: Settings, name: str) -> AsyncIterator[Bus]:
    """A tool's connection to the node's NATS (:func:`tool_nats`): three quiet tries,
    then one :class:`NatsUnreachable` (with :data:`NOT_RUNNING_HINT` when the server is
    on this host). ``name`` is the client name the server lists."""
    from gpulet_common.bus import Bus  # nats-py: only once a tool talks to the agent

    try:
        async with Bus.connect(
            tool_nats(settings),
            name=name,
            max_initial_attempts=3,
            limits=settings.limits,
            quiet_connect=True,
        ) as bus:
            yield bus
    except NatsUnreachable as exc:
        if not is_local(tool_nats(settings).url):
            raise
        raise NatsUnreachable(f"{exc.message}: {NOT_RUNNING_HINT}") from None


LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def is_local(url: str) -> bool:
    """Whether every server of the NATS ``url`` (comma-separated) is on this host: the
    one a local agent (`gpulet run`, `make run`) would serve."""
    hosts = [
        urlsplit(u.strip() if "://" in u else f"nats://{u.strip()}").hostname
        for u in url.split(",")
        if u.strip()
    ]
    return bool(hosts) and all(h in LOCAL_HOSTS for h in hosts)


def ask_agent(
    settings: Settings,
    *,
    tool: str,
    service: str,
    subject: str,
    value: T,
    request: Codec[T],
    reply: Codec[R],
    timeout_s: float,
) -> R | None:
    """Ask the node's ``service`` one question as the command ``tool`` (``gpulet health
    state``); its reply, or None once why there is none is on stderr."""

    async def ask() -> R:
        async with tool_bus(settings, tool.replace(" ", "-")) as bus:
            return await bus.request(subject, value, request, reply, timeout_s=timeout_s)

    try:
        return anyio.run(ask)
    except RequestTimeout:
        print(
            f"{tool}: no {service} answered for node {settings.node_name!r} "
            f"(is the {service} running? is --node right?)",
            file=sys.stderr,
        )
    except Refused as exc:
        print(f"{tool}: refused: {exc.code}: {exc.message}", file=sys.stderr)
    except BusError as exc:
        print(f"{tool}: {exc}", file=sys.stderr)
    return None


def print_answer(
    answer: R | None,
    as_json: bool,
    show: Callable[[R], str],
    builtins: Callable[[R], object] = msgspec.to_builtins,
) -> int:
    """Print a tool's answer (indented JSON with ``--json``, else ``show(answer)``);
    the exit status: 1 when there is none (:func:`ask_agent` said why)."""
    if answer is None:
        return 1
    print(json.dumps(builtins(answer), indent=2) if as_json else show(answer))
    return 0


def usage_error(tool: str, message: str) -> int:
    """Say on stderr why ``tool`` will not run as called; its exit status (2)."""
    print(f"{tool}: {message}", file=sys.stderr)
    return 2


def bind(command: Command, load: LoadSettings) -> Callable[[argparse.Namespace], int]:
    """An argparse ``func`` that runs ``command`` with the settings loader."""
    return lambda args: command(args, load)
