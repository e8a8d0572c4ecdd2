"""The unit tests' one worker group as an RL run's sampling (runtime.control.sampling) sees it.

``SamplerGroup`` has the group's sampler-facing methods and nothing else: each call it is asked to start is kept
in ``sent`` as ``(worker, method, request fields, future)``, its :class:`Future` answered by the test; launches
get ids ``s10``, ``s11``, ...; every launched sampler registers at once. Given the run's ``events``, it records
launches and deaths there as the real group does.
"""


class Future:
    """A call in flight, answered by the test (``answer``)."""

    def __init__(self):
        self._result, self._error, self._done = None, None, False

    def done(self):
        return self._done

    def result(self, timeout=None):
        if self._error is not None:
            raise self._error
        return self._result

    def answer(self, result=None, error=None):
        self._result, self._error, self._done = result, error, True


class SamplerGroup:
    def __init__(self, publish_version=0, held=(), events=None):
        self.events = events   # the run's log: launches and deaths are recorded there, as the real group does
        self.sent = []       # (worker, method, fields, future)
        self.launched = []
        self.dead = []
        self.publish_version, self.held = publish_version, tuple(held)

    def _start(self, worker, method, **fields):
        fut = Future()
        self.sent.append((worker, method, fields, fut))
        return fut

    def open(self, method):
        """The calls of ``method`` not answered yet: ``[(worker, fields, future)]``."""
        return [(w, f, fut) for w, m, f, fut in self.sent if m == method and not fut.done()]

    # -- what runtime.control.sampling calls ------------------------------------------------------

    def launch(self, host="", role="trainer", replaces=""):
        assert role == "sampler"
        w = f"s{10 + len(self.launched)}"
        self.launched.append(w)
        if self.events is not None:
            if replaces:
                self.events.emit("worker_relaunched", replaces=replaces, worker=w, host=host, role=role)
            else:
                self.events.emit("worker_launched", worker=w, host=host, role=role)
        return w

    def relaunch(self, launch):
        return self.launch(launch.host, launch.role, launch.replaces)

    def wait_for_samplers(self, workers, timeout):
        return list(workers)

    def load_sampler(self, worker, programs):
        return object()

    def start_sampler_load(self, worker, programs):
        return self._start(worker, "Load")

    def publish_weights(self, trainers, leaves, dtype):
        from runtime._proto import elastic_pb2 as pb

        return {w: pb.PublishWeightsReply(version=self.publish_version, bytes=8, held=list(self.held))
                for w in trainers}

    def start_sync(self, worker, version, sources):
        return self._start(worker, "SyncWeights", version=version, sources=list(sources))

    def start_rollout(self, worker, step, microbatches, version, seed):
        return self._start(worker, "Rollout", step=step, microbatches=list(microbatches), version=version, seed=seed)

    def settle(self, worker, fut):
        pass

    def declare_dead(self, worker, reason, cause=""):
        self.dead.append(worker)
        if self.events is not None:
            self.events.emit("worker_dead", worker=worker, reason=reason, cause=cause or None)

    def attach_samplers(self, known, fingerprint):
        return sorted(known)
