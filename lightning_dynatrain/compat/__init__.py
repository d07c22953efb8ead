"""Private names of torch, megatron-core and Lightning, each in one place with the versions it was
checked on: ``torch_internals`` (c10d's registry of groups, a default group built outside
``init_process_group``, ``FakeProcessGroup``, the autograd engine, ``ShardedTensor``),
``megatron_internals`` (``parallel_state``'s globals, the distributed optimizer's shard ranges),
``lightning_internals`` (process-group set-up, the launcher, the Trainer's connectors). Public API
that differs between the supported megatron-core releases: ``megatron_versions``. The rest of
the package calls these, never the private name (``tests/test_private_names.py``); the CPU adapter
``devices/host/megatron_patches/`` patches megatron's private functions by design."""
