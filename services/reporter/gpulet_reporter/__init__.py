"""gpulet reporter service."""
