"""Megatron-core glue: the ``parallel_state`` adapter, GPT building, DDP + optimizer, hot switches.

Everything that knows megatron-core internals lives in this package, but for the patches that run it
on CPU (``devices/host/megatron_patches``); see ``NOTES.md`` for the parameter order and
distributed-optimizer buffer facts the VPS mapping relies on.
"""
