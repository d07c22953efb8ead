"""Baselines the hot switch is measured against (``benchmarks/switch_vs_checkpoint.py``).

Every baseline moves one rank's full megatron training state (params and Adam moments, zero1 shards
included) from layout A to layout B and leaves it in a freshly built megatron model + optimizer:

- ``dcp``: ``torch.distributed.checkpoint`` save of the *logical* boxes (global layer offsets) and a
  resharding load at B, in the same processes; ``restart`` loads it in freshly spawned processes.
- ``megatron_ckpt``: megatron's own ``dist_checkpointing`` (``sharded_state_dict`` of model and
  optimizer, ``fully_reshardable`` distributed-optimizer format).
- ``allgather``: the naive in-memory switch: every rank all-gathers every full tensor, then slices.
- ``floor``: bytes that must cross a process boundary at the measured link speed, plus local copies.

``state`` builds and rebuilds the training state, ``transition.fingerprint`` checks that every method ends
with the same full logical state, ``devices.memory_policy`` says what fits, ``launch`` spawns the ranks and
``pair`` runs all methods for one layout pair.
"""
