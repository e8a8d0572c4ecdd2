"""The base both programs share: errors, the event log and its schema, microbatch trees, program sets,
a slice's hosts (``hosts``), platforms, timing, fingerprints, the compilation cache, the owner watch, the allocator, the environment of
a child process.

May import: only itself (and the standard library and third-party packages).
"""
