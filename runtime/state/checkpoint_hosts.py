"""A checkpoint directory that slices of several hosts write: each host's blocks in a store of its own, read back
onto any number of hosts.

A slice of H hosts (:mod:`runtime.core.hosts`) holds its state as blocks,
host ``k`` its own, and no host holds the whole. So each host writes its
blocks (a flat list: a named tree such as MaxText's places whole leaves), with their own record and
digest, as an ordinary checkpoint store
(:class:`runtime.state.checkpoint.CheckpointStore`) in
``<directory>/host<k>-of-<H>`` (:func:`host_directory`); no host gathers the
state. A slice of one host writes into ``<directory>`` itself, as always. A
step is complete for H hosts once every one of the H stores holds it
(:func:`layouts`); a directory may hold the steps of several host counts (a
run resumed with another ``elastic_hosts_per_slice``), and its steps
(:func:`steps`) are all of them.

:func:`restore_for_host` reads for host ``k`` of ``H'``: the newest step at
or before the one asked whose checkpoint reads and verifies, from the stores
of ``H'`` hosts when they hold it (host ``k``'s store alone: its own blocks,
nothing more is read), else from those of another host count: every host's
blocks read (each checked against its own record and digest), joined into
the whole leaves, host ``k``'s blocks taken. So a checkpoint written with
H = 2 restores onto H = 1 and back, to the bit.

Listing imports no JAX or orbax (the controller lists); reading does.
"""

from __future__ import annotations

import re

from runtime.core.hosts import join_blocks, take_blocks
from runtime.state.checkpoint_record import CheckpointCorruptError, Restored, Skipped, newest_valid
from runtime.state.checkpoint_storage import forget_listings
from runtime.state.state_copy import state_digest

__all__ = ["host_directory", "layouts", "restore_for_host", "steps", "stores"]

_HOST_STORE = re.compile(r"host(0|[1-9][0-9]*)-of-([1-9][0-9]*)")


def host_directory(directory: str, host: int, hosts: int) -> str:
    """Where host ``host`` of a slice of ``hosts`` keeps its checkpoints of ``directory``: the directory itself for
    a slice of one host, else ``<directory>/host<k>-of-<H>``."""
    if hosts == 1:
        return directory
    if not 0 <= host < hosts:
        raise ValueError(f"no host {host} in a slice of {hosts} hosts")
    return f"{directory.rstrip('/')}/host{host}-of-{hosts}"


def _store(directory: str, **kwargs):
    from runtime.state.checkpoint import CheckpointStore

    return CheckpointStore(directory, **kwargs)


def _host_counts(directory: str) -> set[int]:
    """The host counts ``H`` > 1 that have stores in ``directory`` (one ``host<k>-of-<H>`` is enough)."""
    from etils import epath

    from runtime.state.checkpoint_storage import checked_directory

    path = epath.Path(checked_directory(directory, None)[0].rstrip("/"))
    forget_listings(path)
    if not path.exists():
        return set()
    return {int(m[2]) for p in path.iterdir() if (m := _HOST_STORE.fullmatch(p.name)) and int(m[2]) > 1}


def layouts(directory: str) -> dict[int, list[int]]:
    """``{host count: its complete steps, ascending}`` of ``directory``: 1 for the directory's own checkpoints
    (one-host slices', or MaxText's trainer's), H for the steps every ``host<k>-of-<H>`` store holds. Host counts
    without a complete step are left out. Reads the storage each call."""
    out = {}
    own = _store(directory).steps()
    if own:
        out[1] = own
    for hosts in sorted(_host_counts(directory)):
        held = [set(_store(host_directory(directory, k, hosts)).steps()) for k in range(hosts)]
        if common := set.intersection(*held):
            out[hosts] = sorted(common)
    return out


def steps(directory: str) -> list[int]:
    """Every complete step of ``directory``, of any host count, ascending."""
    return sorted({s for held in layouts(directory).values() for s in held})


def stores(directory: str) -> list:
    """Every checkpoint store of ``directory``: its own, then each host's of each host count (for
    :meth:`~runtime.state.checkpoint.CheckpointStore.cleanup`)."""
    return [_store(directory)] + [_store(host_directory(directory, k, h))
                                  for h in sorted(_host_counts(directory)) for k in range(h)]


def restore_for_host(directory: str, at_most: int | None, *, layout, dims, hosts: int = 1, host: int = 0,
                     tree=None) -> tuple[Restored, list[Skipped]]:
    """Host ``host`` of a slice of ``hosts``: its blocks of the newest checkpoint of ``directory`` at or before
    step ``at_most`` that reads and verifies, and the newer ones skipped (see the module docstring).

    ``layout``: the whole state's ``[(shape, dtype)]`` (another model's checkpoint is read as it is: the
    caller compares); ``dims``: each leaf's split dimension over the slice's
    mesh (None: replicated); ``tree``: how the programs name the leaves (a checkpoint of MaxText's trainer is
    read with it). The :class:`Restored` leaves are this host's blocks and its digest theirs. Raises
    :class:`~runtime.state.checkpoint_record.CheckpointNotFoundError` when none is usable.
    """
    held = layouts(directory)
    candidates = sorted({s for s_ in held.values() for s in s_ if at_most is None or s <= at_most})

    def read(step: int) -> Restored:
        # This host count's first (this host's blocks alone), then whole leaves, then any other.
        written = sorted((h for h, s_ in held.items() if step in s_), key=lambda h: (h != hosts, h))
        errors = []
        for h in written:
            try:
                return _read(directory, step, h, layout, dims, hosts, host, tree)
            except CheckpointCorruptError as e:
                errors.append(e)
        raise errors[0]

    return newest_valid(directory, candidates, read, at_most, "none was ever committed here")


def _read(directory: str, step: int, written: int, layout, dims, hosts: int, host: int, tree) -> Restored:
    """Host ``host`` of ``hosts``' blocks of the checkpoint of ``step`` that slices of ``written`` hosts wrote."""
    def restore(k: int) -> Restored:   # (the tree and layout read one of MaxText's trainer: one host's, no record;
        one = written == 1                # a host's blocks are a flat list)
        return _store(host_directory(directory, k, written), tree=tree if one else None,
                      layout=layout if one else None).restore(step)

    if written == hosts:
        return restore(host)
    parts = [restore(k) for k in range(written)]   # each verified against its own record
    try:
        whole = join_blocks([p.leaves for p in parts], dims)
    except ValueError as e:
        raise CheckpointCorruptError(directory, f"step {step} of {written} hosts: {e}") from None
    mine = take_blocks(whole, dims, hosts, host)
    return Restored(step, mine, state_digest(mine), parts[0].metadata)
