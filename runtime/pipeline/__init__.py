"""Pipeline stages on virtual slices (MPMD): each stage its own programs, one central schedule.

- :mod:`runtime.pipeline.schedule`: GPipe and 1F1B compiled into one global order and an instruction
  stream per stage worker (pure);
- :mod:`runtime.pipeline.simulate`: runs streams on a model of time: bubble, live activations, deadlock (pure);
- :mod:`runtime.pipeline.stage_executor`: one stage's programs on local devices;
- :mod:`runtime.pipeline.local_run`: a pipelined run in one process, the ground truth.

May import: ``runtime.core``, ``runtime.state``, ``runtime.worker.executor``.
"""
