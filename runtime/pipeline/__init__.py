"""Pipeline stages on virtual slices (MPMD): the central schedule and how a stage runs its part of it.

- :mod:`runtime.pipeline.schedule`: GPipe and 1F1B compiled into one global order and an instruction
  stream per stage worker (pure);
- :mod:`runtime.pipeline.simulate`: runs streams on a model of time: bubble, live activations, deadlock (pure);
- :mod:`runtime.pipeline.bubble`: the bubble, theoretical and measured, one definition for all three (pure);
- :mod:`runtime.pipeline.interpreter`: executes a stage's stream one instruction at a time over any transport.

The stage's programs run in the worker layer (:mod:`runtime.worker.executor`), and so does the one-process
run (:mod:`runtime.worker.reference`): an unpipelined run is the one-stage pipeline there.

May import: ``runtime.core``.
"""
