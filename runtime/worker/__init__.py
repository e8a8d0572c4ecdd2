"""The worker program: one process per host of a physical slice. Its gRPC service (fencing, steps and the
stream they arrive on, state), the executor of the step programs, the votes of a slice's hosts
(``agreement``), the all-reduce and its mailbox, the background saver, fault injection, the process entry
point, and the reference run (the fault-free loop the chaos harness compares against).

May import: ``runtime.core``, ``runtime.wire``, ``runtime.state``. Never ``runtime.control``: a worker knows
nothing of the controller but its calls.
"""
