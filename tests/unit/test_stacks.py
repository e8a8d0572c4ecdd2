"""``elastic stacks``' filters (runtime/core/stacks.py): which process, and which threads wait idle.

Real threads of this process, parked where a run's threads park (a thread
pool's spare worker, a selector, ``accept``) and one waiting in code that
is not a library's (as a step waits for a peer), read back through
``thread_stacks``: the idle ones are counted in one line, the other shown.
"""

import concurrent.futures
import re
import selectors
import socket
import threading

import pytest

from runtime.core.stacks import idle_place, pick_processes, stacks_text, thread_stacks


def _blocks(text: str) -> dict[str, str]:
    return {b.split(" (", 1)[0].removeprefix("Thread "): b for b in text.split("\n\n") if b.startswith("Thread ")}


def test_idle_threads_are_counted_by_place_and_a_wait_in_the_runs_own_code_is_shown():
    release = threading.Event()
    parked = threading.Barrier(4, timeout=60)   # (every wait here is bounded)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spare")
    pool.submit(lambda: None).result()   # its worker now waits for work
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    selector = selectors.DefaultSelector()
    reader, writer = socket.socketpair()
    selector.register(reader, selectors.EVENT_READ)

    def step_waits_for_a_peer():   # code of the run (this file is no library): never idle
        parked.wait()
        release.wait(60)

    def serve():
        parked.wait()
        listener.accept()

    def loop():
        parked.wait()
        selector.select(60)

    threads = [threading.Thread(target=f, name=n, daemon=True)
               for f, n in ((step_waits_for_a_peer, "step"), (serve, "acceptor"), (loop, "event-loop"))]
    try:
        for t in threads:
            t.start()
        parked.wait()
        for _ in range(200):   # until each has reached its wait (they park right after the barrier)
            text = thread_stacks()
            got = _blocks(text)
            if all(k in got for k in ("step", "acceptor", "event-loop")) and "in accept" in got["acceptor"] \
                    and "in select" in got["event-loop"] and "in wait" in got["step"]:
                break
            release.wait(0.01)
        assert idle_place(got["spare_0"]) == "thread-pool workers waiting for work"
        assert idle_place(got["acceptor"]) == "accepting connections"
        assert idle_place(got["event-loop"]) == "event loops in a selector"
        assert idle_place(got["step"]) is None and idle_place(got["MainThread"]) is None
        busy = stacks_text([{"name": "w0", "host": "h", "pid": 3, "text": text}], idle=False)
        shown = _blocks(busy.split("\n", 1)[1])
        assert "step" in shown and "MainThread" in shown and not {"spare_0", "acceptor", "event-loop"} & set(shown)
        # (at least ours: pytest-xdist's own threads in this process may wait in the same places)
        hidden = dict((place, int(n)) for n, place in re.findall(r"(\d+) ([a-z -]+?)(?:,|;)", busy))
        assert "idle threads hidden: " in busy and hidden.get("accepting connections", 0) >= 1, busy
        assert "--all shows them" in busy
        assert stacks_text([{"name": "w0", "text": text}]).count("Thread ") == text.count("Thread ")   # all: as is
    finally:
        release.set()
        writer.send(b"x")
        socket.create_connection(listener.getsockname()).close()
        pool.shutdown()
        for t in threads:
            t.join(5)
        for s in (listener, reader, writer):
            s.close()


def test_a_worker_or_the_client_is_picked_by_name_and_an_unknown_worker_is_named():
    processes = [{"name": n} for n in ("client", "w0", "w1/h0", "w1/h1", "w2")]
    assert pick_processes(processes) == processes
    assert [p["name"] for p in pick_processes(processes, ["w1"])] == ["w1/h0", "w1/h1"]   # a slice's hosts
    assert [p["name"] for p in pick_processes(processes, ["w2"], client=True)] == ["client", "w2"]
    assert [p["name"] for p in pick_processes(processes, client=True)] == ["client"]
    with pytest.raises(ValueError, match=r"no worker 'w9' in this run \(its processes: client, w0, w1/h0"):
        pick_processes(processes, ["w9"])
