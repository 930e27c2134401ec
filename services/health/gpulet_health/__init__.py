"""gpulet health service."""
