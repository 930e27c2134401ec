"""Codecs of the health service's own wire types (one encoder/decoder per type)."""

from __future__ import annotations

from gpulet_common.codec import Codec
from gpulet_common.messages import GpuHealth

# Value of each key of the gpu_health KV bucket.
GPU_HEALTH = Codec(GpuHealth, limit="health_state")
