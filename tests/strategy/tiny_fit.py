"""The tiny GPT and data that the strategy's script jobs train (``launch_script.py``, ``switch_fault_fit.py``).

Those scripts run as ``python tests/strategy/<script>.py``: this module is imported by its bare name
from the scripts' folder.
"""

from __future__ import annotations


def tiny_module_and_data():
    """``(GPTLightningModule, StdlibTextDataModule)``: a 2-layer GPT of width 32 over 32-token
    samples, 8 per global batch, from the first 200 kB of the standard library's sources."""
    from lightning_dynatrain.data import StdlibTextDataModule
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.strategy import GPTLightningModule

    shape = GPTShape(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32,
                     make_vocab_size_divisible_by=128)
    module = GPTLightningModule(shape, lr=3e-3, global_batch_size=8, micro_batch_size=2, seed=1234)
    data = StdlibTextDataModule(seq_length=32, global_batch_size=8, seed=0, max_bytes=200_000)
    return module, data


__all__ = ["tiny_module_and_data"]
