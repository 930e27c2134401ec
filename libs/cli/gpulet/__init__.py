"""The gpulet command line."""
