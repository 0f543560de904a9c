"""Torch-free CuTe DSL building blocks shared by every architecture package.

Nothing under ``cute_fa.dsl`` imports torch: kernels built from these pieces compile on a machine
without a GPU and without torch's CUDA build.
"""
