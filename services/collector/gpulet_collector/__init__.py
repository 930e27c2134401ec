"""gpulet collector service."""
