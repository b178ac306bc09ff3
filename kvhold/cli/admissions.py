"""`kvhold admissions`: whether a sidecar admits new requests, and reopening them.

    kvhold admissions [--instance NAME] [--reopen] [--json]

A health action that distrusts the GPU (a pool restart required, or a drain) closes
admissions: new requests are refused as retryable, requests in flight finish, /health
turns 503 and the registry entry says "drain". Nothing reopens them on its own. After
checking the GPU, `--reopen` lifts the health closure (the health policy starts afresh,
so the next fault closes them again); a pool restart in progress keeps its own closure.
Sent as `Admissions` on the sidecar's local socket only. Prints whether admissions are
open and, if not, who closed them and why. Exit codes: 0 open; 1 the sidecar is not
reachable; 3 still closed.
"""
from __future__ import annotations

import argparse
import json
import sys

from kvhold.client.client import Client
from kvhold.protocol.errors import KvholdError

EXIT_CLOSED = 3


def add_admissions_parser(sub) -> None:
    from kvhold.sidecar.flags import add_instance_args

    p = sub.add_parser("admissions", help="show whether new requests are admitted; --reopen after "
                       "a health action closed them", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_instance_args(p)
    p.add_argument("--reopen", action="store_true",
                   help="lift the closure of a health action (after checking the GPU)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the sidecar")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_admissions)


def cmd_admissions(args) -> int:
    try:
        with Client.for_instance(args.instance, args.runtime_root, timeout=args.timeout) as client:
            reply = client.admissions(reopen=args.reopen)
    except KvholdError as exc:
        print(f"kvhold admissions: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"open": reply.open, "closed_by": reply.closed_by}))
    elif reply.open:
        print("admissions open")
    else:
        print("admissions closed:")
        for by, reason in reply.closed_by.items():
            print(f"  by {by}: {reason}")
    return 0 if reply.open else EXIT_CLOSED
