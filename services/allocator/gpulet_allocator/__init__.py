"""gpulet allocator service."""
