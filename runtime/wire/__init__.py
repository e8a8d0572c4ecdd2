"""What crosses a process boundary: gRPC plumbing and credentials (``rpc``, ``auth``), tensor parts and
the step requests, the peer channels, the TCP data plane (server, client, framing), and same-host copies
out of another process's memory (``cross_memory``).

May import: ``runtime.core`` and the generated ``runtime._proto``.
"""
