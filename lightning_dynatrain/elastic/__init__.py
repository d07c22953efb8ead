"""The Elastic Device Manager: processes join and leave a running job.

``records`` (signed requests and membership records), ``client`` (a trainer's view of the job's
store), ``server`` and ``store_cli`` (the store process, ``dynatrain store``: admission and
membership), ``world`` (the next world's process group built in the background and installed at a
step boundary), ``session`` (one process's membership: entering, per-step polling, the vote,
leaving, failures), ``policy`` (the layout of a new world). The strategy's side is
``strategy/elastic.py``; users add ``callbacks.OnNodeChange``. Design: docs/elastic.md.
"""
