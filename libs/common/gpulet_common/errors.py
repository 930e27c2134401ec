"""The failures gpulet explains in one line instead of a traceback.

Why a family
------------
The ``gpulet`` command line maps exceptions to exit codes in exactly one place
(:func:`gpulet.cli.main`): anything derived from :class:`GpuletError` is printed as a
single line on stderr and ends the process with the error's ``exit_code``; anything
else is a bug and keeps its traceback. Raising one of these is how any module (settings,
the embedded nats-server, the mock NVML, a service's tool) says "this is the user's to
fix, and here is how", without knowing about argparse or exit codes.

* :class:`UsageError` (exit 2): a mistake in how gpulet was started: a flag, a
  setting, a config file, a state directory that is a file, a port another process
  holds, a mock scenario that does not exist.
* :class:`GpuletError` (exit 1): gpulet ran and failed in a way it can explain, e.g.
  the embedded nats-server died and could not be brought back.

The message must fit on one line: :func:`one_line` is applied before printing.
"""

from __future__ import annotations

import asyncio


class GpuletError(Exception):
    """A failure gpulet explains in one line; the CLI exits with ``exit_code``."""

    exit_code = 1


class UsageError(GpuletError):
    """A mistake in the command, settings or environment gpulet was started with."""

    exit_code = 2


def one_line(text: str) -> str:
    """``text`` with its line breaks (and runs of blanks) folded into single spaces."""
    return " ".join(text.split())


def explained(exc: BaseException) -> GpuletError | None:
    """The :class:`GpuletError` that explains ``exc``, or None when it is a bug.

    Task groups wrap a failure in exception groups (one level per task group it
    crossed); a group is explained when every failure in it, cancellations aside, is a
    :class:`GpuletError`, and the first one is returned.
    """
    if isinstance(exc, GpuletError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found: list[GpuletError] = []
        for inner in exc.exceptions:
            if _is_cancellation(inner):
                continue
            explanation = explained(inner)
            if explanation is None:
                return None
            found.append(explanation)
        return found[0] if found else None
    return None


def _is_cancellation(exc: BaseException) -> bool:
    # gpulet runs anyio on asyncio only; this is called after the event loop ended,
    # where anyio.get_cancelled_exc_class() cannot be asked.
    return isinstance(exc, asyncio.CancelledError)
