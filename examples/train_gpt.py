"""Train a small byte-level GPT on the Python stdlib's sources with N CPU processes, switching layouts on a schedule.

    python examples/train_gpt.py fit --config examples/configs/demo.yaml            # what `make demo` runs
    python examples/train_gpt.py fit --config examples/configs/demo.yaml --model.family moe --trainer.max_steps 60
    torchrun --nproc-per-node 4 examples/train_gpt.py fit --config examples/configs/demo.yaml
    fabric run --accelerator cpu --devices 4 examples/train_gpt.py fit --config examples/configs/demo.yaml
    python examples/train_gpt.py --devices 4 --max-steps 10 --layout dp2-tp2-pp1 --schedule 5:dp4-tp1-pp1 --out runs/s

One config schema (LightningCLI: ``fit --help`` lists every key, ``--print_config`` prints a whole
config) holds the Trainer and its precision, the strategy and its starting layout, the schedule of
switches, the model (``family``: gpt, llama or moe, and its size) and the data; the old flags
(``--devices``, ``--layout``, ``--schedule``, ``--model``, ``--precision``, ...) map to its keys
(``lightning_dynatrain/lightning_cli/legacy.py``). Bad values stop the run at start, naming the key
and the rule.

Writes (rank 0) into ``out``: ``metrics.csv`` (step, loss, layout, seconds), ``switches.jsonl`` (one
JSON object per switch: step, src, dst, seconds, moved_bytes, retained_bytes, peak_staging_bytes,
...), ``loss.png`` (loss against step, switches marked with their times), one
``transfers_step{N}.png`` per switch (bytes between every pair of ranks, kept bytes on the
diagonal) and ``config.yaml`` (the run's full config).

The vocabulary (256 bytes) is padded the same way at tp 1, 2, 4 and 8, so every layout trains the
same model (megatron's padded rows take part in the softmax).
"""

from lightning_dynatrain.lightning_cli import main

if __name__ == "__main__":
    main()
