"""Run every benchmark in turn and print their tables (``make bench``).

The soak (``bench/soak.py``, 10 minutes) is left out; run it on its own.
Pass ``--quick`` for shorter runs (smaller samples, same code paths).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

BENCHES: list[tuple[str, list[str], list[str]]] = [
    # name, full arguments, quick arguments
    ("collector_cost.py", [], ["--periods", "500", "--steady", "5", "--messages", "5000"]),
    ("pod_footprint.py", [], ["--settle", "15", "--idle", "5"]),
    ("health_latency.py", [], ["--faults", "50"]),
    ("listandwatch_latency.py", [], ["--faults", "10"]),
    ("remediation_latency.py", ["--faults", "200"], ["--faults", "10"]),
    ("health_storm.py", [], ["--seconds", "5", "--idle", "2"]),
    ("allocation_quality.py", [], []),
    ("inventory_scale.py", [], ["--repeat", "3"]),
    ("nats_restart.py", ["--rounds", "10"], ["--rounds", "3"]),
    ("allocate_roundtrip.py", [], ["--quick"]),
    ("dra.py", [], ["--quick"]),
    (
        "reporter_fleet.py",
        ["--nodes", "1000", "--duration", "60"],
        ["--nodes", "100", "--duration", "10"],
    ),
    (
        "fleet.py",
        ["--leaves", "300", "--active", "10", "--events", "3000", "--rate", "300"],
        ["--leaves", "20", "--active", "10", "--events", "500", "--rate", "28"],
    ),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    args = parser.parse_args()
    failed = []
    for name, full, quick in BENCHES:
        print(f"\n=== bench/{name} ===", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, str(HERE / name), *(quick if args.quick else full)])
        print(f"(bench/{name}: exit {code}, {time.monotonic() - started:.0f} s)", flush=True)
        if code:
            failed.append(name)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
