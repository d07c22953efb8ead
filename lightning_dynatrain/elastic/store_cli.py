"""``dynatrain store``: host an elastic job's store (see ``server.py``) until stopped.

Example::

    $ dynatrain store --port 29400
    DYNATRAIN_STORE=node1:29400
    DYNATRAIN_TOKEN=6f1c...            (generated: give both to every process of the job)
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys

from lightning_dynatrain.elastic.client import STORE_ENV, TOKEN_ENV


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="host an elastic job's store (admission, membership, liveness)",
                       description="Host the store an elastic job's processes find through DYNATRAIN_STORE. "
                       "It admits processes that present the job's token and model, writes each world's "
                       "membership, and records a member that stops answering as failed.")
    p.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: all)")
    p.add_argument("--port", type=int, default=29400, help="TCP port (0: a free one; default 29400)")
    p.add_argument("--token", default=None, help=f"the job's secret (default: ${TOKEN_ENV}, else a new one)")
    p.add_argument("--margin", type=int, default=3,
                   help="a change takes effect this many optimizer steps after it is published (default 3)")
    p.add_argument("--dead-after", type=float, default=10.0,
                   help="seconds without a heartbeat after which a member counts as failed (default 10)")
    p.add_argument("--suspect-after", type=float, default=None,
                   help="seconds without a heartbeat after which a member counts as failed once a member reported "
                        "a failed collective (default min(4, dead-after))")
    p.add_argument("--together", type=float, default=None,
                   help="members silent this many seconds less than --dead-after when one is found dead are "
                        "recorded with it (they died at the same instant; default min(2, dead-after/2))")
    p.add_argument("--launch-wait", type=float, default=60.0,
                   help="seconds a join waits for the other processes of its launch (default 60)")
    p.add_argument("--gather", type=float, default=1.0,
                   help="seconds requests of one kind are gathered into one change (default 1)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from lightning_dynatrain.elastic.server import serve_forever

    token = args.token or os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
    generated = not (args.token or os.environ.get(TOKEN_ENV))

    def ready(port: int) -> None:
        print(f"{STORE_ENV}={socket.gethostname()}:{port}", flush=True)
        if generated:
            print(f"{TOKEN_ENV}={token}", flush=True)
        print("[dynatrain store] serving; stop with Ctrl-C", file=sys.stderr, flush=True)

    try:
        serve_forever(args.host, args.port, token, margin=args.margin, dead_after=args.dead_after,
                      launch_wait=args.launch_wait, gather=args.gather, together=args.together,
                      suspect_after=args.suspect_after, on_ready=ready)
    except KeyboardInterrupt:
        return 0
    return 0


__all__ = ["add_parser"]
