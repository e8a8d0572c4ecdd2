"""A slice of several hosts: which part of the state each host holds, how a slice is addressed, its digest.

A physical slice is H hosts (worker processes) joined by a JAX distributed
system of their own, running one SPMD program on global arrays over the
slice's D devices, D / H on each host, host ``k`` holding mesh positions
``k*D/H .. (k+1)*D/H - 1``. A state leaf split over the mesh along
dimension ``dim`` (FSDP: ``n`` divisible by D) is then held by host ``k`` as
one contiguous block, rows ``k*n/H .. (k+1)*n/H - 1`` of that dimension; a
replicated leaf is held whole by every host. Host ``k`` of every slice holds
the same blocks, so a state moves host ``k`` to host ``k`` and the runtime's
state tiers work per host on plain host arrays (the blocks).

A slice's address (and its data plane's) is its hosts' addresses in host
order joined by ``,``; a one-host slice's is its one address. The control
plane passes a slice's address on unchanged, and host ``k`` reaches host
``k`` of another slice (:func:`host_address`). A slice's digest is its hosts'
digests combined in host order (:func:`runtime.state.state_copy.slice_digest`),
so replicas of the same H compare digests as before.

Pure.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Layout", "block_of", "host_address", "host_addresses", "host_id", "host_layout", "join_blocks", "slice_address",
           "slice_of_host", "take_blocks"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A slice's shape as the control plane knows it: its ``devices`` over its ``hosts``. A copy of the state
    moves from one layout to another (:class:`runtime.control.plan.Copy`); programs are exported for one."""

    devices: int
    hosts: int = 1

    def __str__(self) -> str:
        return f"{self.devices} device(s)" + (f" on {self.hosts} hosts" if self.hosts > 1 else "")


_JOIN = ","
_HOST = "/"   # a host's id: "<slice id>/<host index>" (a one-host slice's is the slice's id)


def host_layout(layout: list, dims: list, hosts: int) -> list:
    """``[(shape, dtype)]`` of the blocks one host holds, from the whole leaves' ``layout`` and each leaf's split
    dimension (None: replicated). ValueError when a split dimension does not divide among the hosts."""
    if len(layout) != len(dims):
        raise ValueError(f"{len(layout)} leaves, {len(dims)} placements")
    out = []
    for i, ((shape, dtype), dim) in enumerate(zip(layout, dims)):
        shape = tuple(shape)
        if hosts > 1 and dim is not None:
            if shape[dim] % hosts:
                raise ValueError(f"state leaf {i} {shape}: dimension {dim} does not divide among {hosts} hosts")
            shape = shape[:dim] + (shape[dim] // hosts,) + shape[dim + 1:]
        out.append((shape, dtype))
    return out


def block_of(shape: tuple, dim: int | None, hosts: int, host: int) -> tuple[slice, ...]:
    """The index of host ``host``'s block of a leaf of ``shape`` split along ``dim`` (None: all of it)."""
    index = [slice(None)] * len(shape)
    if dim is not None and hosts > 1:
        n = shape[dim] // hosts
        index[dim] = slice(host * n, (host + 1) * n)
    return tuple(index)


def join_blocks(blocks: list[list], dims: list) -> list:
    """The whole leaves from every host's blocks of them (``blocks[k]``: host ``k``'s, in host order): a split
    leaf's blocks concatenated along its dimension, a replicated leaf host 0's. ValueError when the hosts hold
    different numbers of leaves."""
    import numpy as np

    if any(len(b) != len(dims) for b in blocks):
        raise ValueError(f"hosts hold {[len(b) for b in blocks]} blocks, for {len(dims)} leaves")
    return [parts[0] if dim is None or len(parts) == 1 else np.concatenate(parts, axis=dim)
            for parts, dim in zip(zip(*blocks), dims)]


def take_blocks(leaves: list, dims: list, hosts: int, host: int) -> list:
    """Host ``host``'s blocks (of ``hosts``) of whole ``leaves``, each split along its dimension of ``dims``
    (None: replicated, the whole leaf itself); a split leaf's block is a contiguous array of its own."""
    import numpy as np

    if hosts == 1:
        return list(leaves)
    return [x if dim is None else np.array(x[block_of(x.shape, dim, hosts, host)], order="C")
            for x, dim in zip(leaves, dims)]


def slice_address(addresses: list[str]) -> str:
    """A slice's address from its hosts' (in host order)."""
    return _JOIN.join(addresses)


def host_addresses(address: str) -> list[str]:
    """A slice's hosts' addresses, in host order ("" has none)."""
    return address.split(_JOIN) if address else []


def host_address(address: str, host: int) -> str:
    """The address host ``host`` of a slice talks to in another slice of address ``address``: its host ``host``.

    A one-host slice's address serves every host (a host of a slice of another shape has no counterpart: the
    runtime never pairs slices of different host counts). ValueError when ``address`` has hosts but not that one.
    """
    hosts = host_addresses(address)
    if len(hosts) <= 1:
        return address
    if not 0 <= host < len(hosts):
        raise ValueError(f"slice address {address!r} has {len(hosts)} hosts, no host {host}")
    return hosts[host]


def host_id(slice_id: str, host: int, hosts: int) -> str:
    """The id of host ``host`` of slice ``slice_id`` (the health monitor's and the launcher's name for it)."""
    return slice_id if hosts == 1 else f"{slice_id}{_HOST}{host}"


def slice_of_host(host_id_: str) -> tuple[str, int]:
    """``(slice id, host index)`` of a host id (:func:`host_id`)."""
    slice_id, sep, k = host_id_.rpartition(_HOST)
    if sep and k.isdigit():
        return slice_id, int(k)
    return host_id_, 0
