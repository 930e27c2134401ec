"""The fleet's accounts and user roles (see identity.py for what each may do).

Apart from identity.py so that code that only names them (the CLI's argument parser)
does not need the ``nkeys`` package of the ``fleet`` extra.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["node", "alerts", "viewer", "admin", "sys"]
ROLES: tuple[Role, ...] = ("node", "alerts", "viewer", "admin", "sys")

SYSTEM_ACCOUNT = "SYS"
FLEET_ACCOUNT = "GPULET"
