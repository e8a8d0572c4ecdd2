"""Starting worker processes: the local launcher (subprocesses, standbys, the zygote they fork from), the
Ray launcher, the child environment.

May import: ``runtime.core``, ``runtime.wire`` and ``runtime.worker`` (the entry point it starts).
"""
