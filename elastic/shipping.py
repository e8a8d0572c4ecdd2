"""What a run sends its workers of the user's Python: the data source, pickled.

Contract: :func:`ship` pickles the data source with cloudpickle. Classes and
functions of an importable module travel by reference (the worker imports the
module), except, with ``by_value``, those of the user's own modules: every
module loaded now whose file lies outside the Python installation (its
prefixes and site-packages) and outside jax-elastic's own packages. Those travel
inside the pickle, for workers that cannot import them: a shared pool's hosts,
which serve many users' runs, and workers started elsewhere (by hand, by Ray).
Nothing is registered after it returns. A local launch ships by reference: its
workers have the client's import path.
"""

from __future__ import annotations

import contextlib
import os
import site
import sys

import cloudpickle

__all__ = ["ship", "user_modules"]

_OURS = ("elastic", "runtime", "integrations", "chaos")


def _installed_roots() -> tuple[str, ...]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages()}
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        roots.add(site.getusersitepackages())
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


def user_modules() -> list:
    """The modules loaded now that are the user's own (see the module's contract)."""
    installed = _installed_roots()
    found = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name == "__main__" or name.split(".")[0] in _OURS:
            continue
        if not os.path.realpath(path).startswith(installed):
            found.append(module)
    return found


def ship(data, by_value: bool) -> bytes:
    """``data`` pickled for the workers (see the module's contract)."""
    if not by_value:
        return cloudpickle.dumps(data)
    modules = user_modules()
    with contextlib.ExitStack() as undo:
        for module in modules:
            cloudpickle.register_pickle_by_value(module)
            undo.callback(cloudpickle.unregister_pickle_by_value, module)
        return cloudpickle.dumps(data)
