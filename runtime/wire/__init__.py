"""What crosses a process boundary: gRPC plumbing and credentials (``rpc``, ``auth``), tensor parts and
the step requests, the peer channels, and the TCP data plane (server, client, framing).

May import: ``runtime.core`` and the generated ``runtime._proto``.
"""
