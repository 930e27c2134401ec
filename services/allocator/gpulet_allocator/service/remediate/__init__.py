"""Remediation, opt-in and targeted: evict only the pods that hold a failed GPU.

Modules: :mod:`.policy` (which faults remediate, who holds the device: pure),
:mod:`.breaker` (the circuit breaker: pure), :mod:`.kube` (the only API calls: list the
node's pods, evict, create an Event, behind a small protocol), :mod:`.runner` (the
loop). docs/health.md, "Remediation", says what it does and why.
"""
