"""Shared building blocks of gpulet: messages, subjects, bus, config, NVML and telemetry.

Services depend on this package and never on each other's internals.
"""

__version__ = "0.1.0"
