"""Megatron-core trainer backend (tensor and data parallel, multi-process).

Importing this package does not import megatron-core; the submodules that need it import it
themselves, so ``astraflow`` works where megatron-core is not installed.
"""
