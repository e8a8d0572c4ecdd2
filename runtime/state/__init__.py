"""The training state's copies outside a worker's memory: checkpoints (orbax, local or ``gs://``), the
record beside them, in-memory snapshots, and state copies between workers as streams of parts.

May import: ``runtime.core``, ``runtime.wire``.
"""
