"""``elastic pool serve`` and ``elastic pool status``: a shared pool of hosts for many runs (docs/pool.md).

``serve DIRECTORY`` runs the pool (:func:`runtime.serve_pool`) with its record
in DIRECTORY; ``--local-hosts N`` also starts N hosts on this machine,
``--ray-hosts N`` N hosts as Ray actors. A
directory that served before is served again: same port, same secret and
tokens, the leases its log holds. ``status`` asks a pool what it shows to the
caller's credential: with the pool's directory, everything (its secret); with
an address and ``$ELASTIC_POOL_TOKEN``, that client's runs and the free
capacity. ``--json`` prints the same as one JSON object.

:func:`render` is pure (the status in, lines out).
"""

from __future__ import annotations

import json
import os
import sys
import time

__all__ = ["register", "render"]


def _pool_of(where: str) -> tuple[str, str]:
    """(address, credential) for a pool directory (its secret) or an address (``$ELASTIC_POOL_TOKEN``)."""
    if os.path.isdir(where):
        record = os.path.join(where, "pool.json")
        if not os.path.exists(record):
            raise ValueError(f"{where} is not a pool's directory (no pool.json: has `elastic pool serve {where}` "
                             "run?)")
        with open(record) as f:
            address = json.load(f)["address"]
        from runtime import pool_secret

        return address, pool_secret(where)
    host, sep, port = where.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{where!r} is neither a pool's directory nor HOST:PORT")
    from runtime import POOL_TOKEN_ENV

    token = os.environ.get(POOL_TOKEN_ENV, "")
    if not token:
        raise ValueError(f"set the pool's client token in ${POOL_TOKEN_ENV} (or give the pool's directory)")
    return where, token


def render(status: dict, now: float | None = None) -> list[str]:
    """The status as lines: capacity, each host, each run, the queue."""
    now = time.time() if now is None else now
    lines = [f"pool: {status['hosts']} host(s), {status['free']} free ({status['free_devices']} device(s))"
             + (f"; {status['unheard']} more not heard since the pool started (gone, or about to poll)"
                if status.get("unheard") else "")]
    for w in status.get("workers", []):
        lease = f" -> run {w['run']} as {w['worker']} ({w['lease']})" if w.get("run") else ""
        heard = "" if w.get("heard_seconds") is None or w["heard_seconds"] < 2 else \
            f" (not heard for {w['heard_seconds']:.0f} s)"
        if w.get("heard_seconds", 0) is None:
            heard = " (not heard since the pool started)"
        lines.append(f"  host {w['host']:<12} {w['devices']} {w['platform']} device(s)  {w['state']}{lease}{heard}")
    for r in status["runs"]:
        wait = (f", waiting {now - r['waiting_since']:.0f} s" if r.get("waiting_since") else "")
        lines.append(f"  run {r['run']} ({r['name'] or 'unnamed'}): priority {r['priority']}, holds "
                     f"{len(r['held'])} ({', '.join(r['held']) or 'none'}), minimum {r['min_hosts']}{wait}")
        lines.append(f"      {r['status']}")
    if status["queue"]:
        lines.append(f"  queue: {', '.join(status['queue'])}")
    if status.get("refused"):
        lines.append("  refused calls: " + ", ".join(f"{n} ({why})" for why, n in sorted(status["refused"].items())))
    return lines


def _cmd_serve(args) -> int:
    import logging

    from runtime import serve_pool

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag, value in (("--local-hosts", args.local_hosts), ("--ray-hosts", args.ray_hosts)):
        if value < 0:
            print(f"elastic: error: {flag} must be 0 or more, got {value}", file=sys.stderr)
            return 2
    if args.devices < 1:
        print(f"elastic: error: --devices must be 1 or more, got {args.devices}", file=sys.stderr)
        return 2
    ready = lambda address: print(f"elastic pool: serving on {address} ({args.directory})", flush=True)
    try:
        return serve_pool(os.path.abspath(args.directory), host=args.host, port=args.port,
                          local_hosts=args.local_hosts, devices=args.devices, platform=args.platform, ready=ready,
                          ray_hosts=args.ray_hosts, ray_address=args.ray_address)
    except (OSError, ValueError) as e:   # the directory is another pool's, the port is taken, no token...
        print(f"elastic: error: {e}", file=sys.stderr)
        return 1


def _cmd_status(args) -> int:
    import grpc

    from runtime import pool_status

    try:
        address, credential = _pool_of(args.pool)
    except (ValueError, OSError) as e:
        print(f"elastic: error: {e}", file=sys.stderr)
        return 2
    try:
        status = pool_status(address, credential, timeout=args.timeout)
    except grpc.RpcError as e:
        if e.code() is grpc.StatusCode.UNAUTHENTICATED:   # it answered: not with what this credential may see
            print(f"elastic: error: the pool at {address} refused this credential ({e.details()}): the pool's "
                  "directory has its secret in 'secret' and the client tokens in 'tokens'", file=sys.stderr)
        else:
            print(f"elastic: error: the pool at {address} did not answer: {e.code().name} {e.details()}",
                  file=sys.stderr)
        return 1
    print(json.dumps(status, indent=1, sort_keys=True) if args.json else "\n".join(render(status)))
    return 0


def register(sub) -> None:
    from elastic.cli_support import OneLineParser

    pool = sub.add_parser("pool", help="a shared pool of hosts serving many runs (docs/pool.md)")
    cmds = pool.add_subparsers(dest="pool_command", required=True, parser_class=OneLineParser)
    serve = cmds.add_parser("serve", help="serve a pool (its record in DIRECTORY)")
    serve.add_argument("directory", help="the pool's directory: its log, secret, tokens, address")
    serve.add_argument("--host", default="127.0.0.1", help="the address it listens on (default: loopback)")
    serve.add_argument("--port", type=int, default=0, help="default: the port it had, else any free one")
    serve.add_argument("--local-hosts", type=int, default=0, metavar="N", help="start N hosts on this machine")
    serve.add_argument("--devices", type=int, default=1, metavar="N", help="simulated CPU devices per local host")
    serve.add_argument("--ray-hosts", type=int, default=0, metavar="N",
                       help="start N hosts as Ray actors (pip install 'jax-elastic[ray]'), on --ray-address")
    serve.add_argument("--ray-address", default="", help="the Ray cluster of --ray-hosts (default: $RAY_ADDRESS)")
    serve.add_argument("--platform", default="cpu", help="the hosts' JAX platform")
    serve.set_defaults(handler=_cmd_serve)
    status = cmds.add_parser("status", help="hosts, runs and the queue of a pool")
    status.add_argument("pool", help="the pool's directory (everything) or HOST:PORT (with $ELASTIC_POOL_TOKEN: "
                                     "your runs and the free capacity)")
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(handler=_cmd_status)
