"""What the reporter's Device writer and the DRA ResourceSlice writer share.

Both are debounced write loops against the API server: a kubeconfig to reach it, a
quiet window and a longest delay for bursts, a timeout per request, a doubling
back-off. ``ReporterSettings`` and ``DraSettings`` inherit these fields, so the
config keys stay flat (``reporter.quiet_window_s``, ``dra.quiet_window_s``) and
their meaning is written once. An inherited field comes first in its section
(msgspec's order), and docs/config.md (``gpulet config reference``) follows it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)]


class KubeWriterSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    # Kubeconfig file; empty: the in-cluster config where the pod has a service
    # account, else $KUBECONFIG, then ~/.kube/config.
    kubeconfig: str = ""
    # Kubeconfig context; empty: the file's current-context.
    kube_context: str = ""
    # Quiet window: a change is written once no other change came for this long.
    quiet_window_s: Seconds = 0.5
    # Upper bound on how long a change may wait for the quiet window (bursts).
    max_delay_s: Seconds = 2.0
    # Timeout of one API request.
    api_timeout_s: PositiveSeconds = 10.0
    # First back-off after a failed write; it doubles per retry, with full jitter.
    backoff_base_s: PositiveSeconds = 0.2
    # Longest back-off; also the pace of retries after a 4xx (RBAC, validation), unless
    # a newer desired state comes first (it is written at once).
    backoff_max_s: PositiveSeconds = 30.0
