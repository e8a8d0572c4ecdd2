"""The controller program: the client side of a run. The loop (``controller``), what a run is given and
answers (``controller_options``), its start (``startup``), its state as a fold of the event log
(``run_state``, kept current by its ``RunLedger``), where each slice runs (``placement``), every membership
change planned once (``plan``, ``stage_plan``, ``tiers``) and carried out (``plan_executor``, ``state_copies``),
the backups it orders (``checkpointing``, ``snapshotting``, ``shadows``), health and the
watchdog, and the worker group that makes every call (``worker_group``, its calls to the adopted workers
``worker_calls``, the stream each worker's steps go on, ``step_stream``, a slice of several hosts called as
one, ``slice_calls``, and the futures both settle, ``settled``; the ``group`` protocol, ``registry``,
``calls``).

May import: ``runtime.core``, ``runtime.wire``, ``runtime.state``, ``runtime.launch``. Never
``runtime.worker``: the controller reaches workers only through their calls.
"""
