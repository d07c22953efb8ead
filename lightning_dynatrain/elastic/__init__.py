"""The Elastic Device Manager: processes join and leave a running job.

The protocol, free of Lightning and megatron-core: ``records`` (signed requests and membership
records), ``client`` (a trainer's view of the job's store), ``server`` and ``store_cli`` (the store
process, ``dynatrain store``: admission and membership), ``world`` and ``world_cache`` (the next
world's process group built in the background and installed at a step boundary; worlds kept for a
return), ``session`` (one process's membership: entering, per-step polling, the vote, leaving,
failures), ``liveness`` (each member's connection to the store process, whose close says at once
that its process ended), ``failure_watch`` (members that failed, and the watchdog),
``launch_teardown`` (a launcher's teardown told from a notice to leave).

Beside it, ``driver/``: the training side of each change and recovery (``ElasticDriver``), which
the front ends reach through a small protocol; users add ``callbacks.OnNodeChange``. Design:
docs/elastic.md.
"""
