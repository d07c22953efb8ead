"""Megatron-core glue: CPU patches, the ``parallel_state`` adapter, GPT building, DDP + optimizer.

Everything that knows megatron-core internals lives in this package; see ``NOTES.md`` for the
parameter order and distributed-optimizer buffer facts the VPS mapping relies on.
"""
