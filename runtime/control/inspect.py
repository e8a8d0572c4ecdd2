"""What the client knows of its run now, for ``elastic status`` and ``elastic stacks`` in another terminal.

The client's server (the one its workers register with: its address is in
the run directory's ``client.json``) also serves the ``Inspector`` service,
authenticated by the run secret like every call of the run. :class:`Inspector`
answers from facts the client already owns: each live worker's own answer to
``Progress`` (its step, phase, seconds in it, resident memory), when the health
monitor last heard from it, and, when asked, every thread's Python stack of the
client and of each host of each worker (``Stacks``). It changes nothing: no
event is written, no worker is fenced or declared dead for not answering.

:func:`inspect_run` is the other terminal's side: one call, plain values back
(nothing above the runtime sees protocol buffers).
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc

from runtime._proto import elastic_pb2 as pb
from runtime._proto import elastic_pb2_grpc as pb_grpc
from runtime.core.errors import ElasticError
from runtime.wire import rpc

__all__ = ["DEFAULT_SECONDS", "Inspector", "inspect_run", "process_dicts"]

#: How long each worker may take to answer an inspection (a hung one does not hold the answer up longer).
DEFAULT_SECONDS = 2.0
#: The stacks' share of an answer (the client's server sends at most 1 MiB), split evenly among the processes.
_REPLY_CHARS = 900 * 1024


class Inspector(pb_grpc.InspectorServicer):
    """The ``Inspector`` service of a run's client, over its :class:`~runtime.control.worker_group.WorkerGroup`.
    Called on the client's gRPC threads, while the run goes on; reads, never waits past the request's bound."""

    def __init__(self, group):
        self.group = group

    def Inspect(self, request, context):
        timeout = request.timeout_seconds if 0 < request.timeout_seconds <= 30 else DEFAULT_SECONDS
        g = self.group
        dead = g.ledger.state.dead
        live = [w for w in g.calls.workers() if w not in dead]
        with futures.ThreadPoolExecutor(max_workers=max(len(live), 1)) as pool:
            replies = dict(zip(live, pool.map(lambda w: g.calls.progress(w, timeout), live)))
            stacks = pool.submit(g.all_stacks, timeout) if request.stacks else None
            now = time.monotonic()
            out = pb.InspectReply(run_id=g.run_id, generation=g.generation, epoch=g.epoch)
            for w, r in replies.items():
                heard = [g.monitor.heard_seconds(h, now) for h in _host_ids(g, w)]
                entry = out.workers.add(worker_id=w, answered=r is not None,
                                        heard_seconds=max(heard) if None not in heard else -1.0)
                if r is not None:
                    entry.step, entry.phase, entry.seconds, entry.rss_bytes = r.step, r.phase, r.seconds, r.rss_bytes
            if stacks is not None:
                processes = stacks.result()
                share = _REPLY_CHARS // max(len(processes), 1)   # the client's server answers at most 1 MiB
                for p in processes:
                    p.text = p.text if len(p.text) <= share else p.text[:share] + "\n... cut\n"
                out.stacks.extend(processes)
        return out


def _host_ids(group, worker_id: str) -> list[str]:
    """The ids the health monitor watches ``worker_id`` by: each host of its slice's, or its own."""
    info = group.registry.workers.get(worker_id)
    return [h.worker_id for h in info.slice_hosts] if info is not None else [worker_id]


def inspect_run(address: str, secret: str, *, stacks: bool = False, timeout: float = DEFAULT_SECONDS,
                tls=None) -> dict:
    """Asks the run's client at ``address`` (its ``client.json``'s ``controller``) what it knows now, with the run
    ``secret`` (and ``tls``: a ``TlsFiles``, for a run over mutual TLS). Returns ``{"run_id", "generation",
    "epoch", "workers": {worker: {"answered", "step", "phase", "seconds", "rss_bytes", "heard_seconds"}},
    "stacks": [{"name", "host", "pid", "text", "error"}]}`` (``heard_seconds`` None when unknown).

    Waits at most ``timeout`` per worker plus a few seconds. ``ElasticError`` (a one-line reason) when the
    client does not answer or refuses the secret.
    """
    with rpc.channel(address, secret, tls) as ch:
        try:
            r = pb_grpc.InspectorStub(ch).Inspect(pb.InspectRequest(stacks=stacks, timeout_seconds=timeout),
                                                  timeout=2 * timeout + 5)
        except grpc.RpcError as e:
            why = ("it refused the run secret" if e.code() == grpc.StatusCode.UNAUTHENTICATED else
                   "it is not running (or not listening there)" if e.code() == grpc.StatusCode.UNAVAILABLE else
                   f"{e.code().name}: {e.details()}")
            raise ElasticError(f"the run's client at {address} did not answer: {why}") from None
    return {"run_id": r.run_id, "generation": r.generation, "epoch": r.epoch,
            "workers": {w.worker_id: {"answered": w.answered, "step": w.step, "phase": w.phase, "seconds": w.seconds,
                                      "rss_bytes": w.rss_bytes,
                                      "heard_seconds": w.heard_seconds if w.heard_seconds >= 0 else None}
                        for w in r.workers},
            "stacks": process_dicts(r.stacks)}


def process_dicts(processes) -> list[dict]:
    """``ProcessStacks`` messages as plain values (what :func:`~runtime.core.stacks.stacks_text` reads)."""
    return [{"name": p.name, "host": p.host, "pid": p.pid, "text": p.text, "error": p.error} for p in processes]
