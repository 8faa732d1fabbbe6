"""Collectives under the alpha-beta model, per link class, on the app's rank layout.

Volumes are the textbook ones of ring algorithms, per rank and for an ``n``-byte
buffer over ``G`` ranks: all-reduce sends ``2(G-1)/G n`` in ``2(G-1)`` steps,
reduce-scatter and all-gather ``(G-1)/G n`` in ``G-1`` steps, and an all-to-all
whose send buffer holds ``n`` bytes spread evenly over the ``G`` ranks sends
``(G-1)/G n`` to ``G-1`` peers.

Which link a group uses follows ``pretrain.mesh``'s rank order
(``rank = pp_rank * dp + ep_dp_rank * ep + ep_mp_rank``), nodes being runs of
``gpus_per_node`` consecutive ranks: a group inside one node runs on NVLink; a
ring over several nodes is paced by the network (each GPU has its own NIC), and
an all-to-all over several nodes sends each peer's share over the link to that
peer, both classes at once, so the slower of the two parts decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.planner.profile import Link


def ring_all_reduce_bytes(nbytes: float, group: int) -> float:
    return 2 * (group - 1) / group * nbytes if group > 1 else 0.0


def reduce_scatter_bytes(nbytes: float, group: int) -> float:
    """Bytes a rank sends reduce-scattering an ``nbytes`` input (all-gather: the same
    for an ``nbytes`` output)."""
    return (group - 1) / group * nbytes if group > 1 else 0.0


all_gather_bytes = reduce_scatter_bytes


def all_to_all_bytes(nbytes: float, group: int) -> float:
    """Bytes a rank sends from an ``nbytes`` send buffer spread evenly over the group."""
    return (group - 1) / group * nbytes if group > 1 else 0.0


@dataclass(frozen=True)
class Group:
    """A process group: ``size`` ranks ``stride`` apart (the first at rank 0)."""

    size: int
    stride: int

    def ranks(self) -> list[int]:
        return [i * self.stride for i in range(self.size)]

    def nodes(self, gpus_per_node: int) -> int:
        return len({r // gpus_per_node for r in self.ranks()})

    def per_node(self, gpus_per_node: int) -> int:
        """Members sharing a node with a given member (itself included)."""
        return self.size // self.nodes(gpus_per_node)


@dataclass(frozen=True)
class Fabric:
    nvlink: Link
    network: Link
    gpus_per_node: int

    def ring_link(self, group: Group) -> Link:
        return self.nvlink if group.nodes(self.gpus_per_node) == 1 else self.network

    def all_reduce(self, nbytes: float, group: Group) -> float:
        if group.size < 2:
            return 0.0
        return self.ring_link(group).seconds(ring_all_reduce_bytes(nbytes, group.size),
                                             2 * (group.size - 1))

    def reduce_scatter(self, nbytes: float, group: Group) -> float:
        if group.size < 2:
            return 0.0
        return self.ring_link(group).seconds(reduce_scatter_bytes(nbytes, group.size),
                                             group.size - 1)

    all_gather = reduce_scatter

    def all_to_all(self, nbytes: float, group: Group, efficiency: float = 1.0) -> float:
        """Seconds for an all-to-all of an ``nbytes`` send buffer (evenly spread); the
        transport reaches ``efficiency`` of each link's bandwidth."""
        if group.size < 2:
            return 0.0
        local = group.per_node(self.gpus_per_node)
        share = nbytes / group.size
        times = []
        for link, peers in ((self.nvlink, local - 1), (self.network, group.size - local)):
            if peers:
                times.append(peers * link.alpha_us * 1e-6
                             + peers * share / (link.gb_per_s * 1e9 * efficiency))
        return max(times)

    def send(self, nbytes: float, crosses_nodes: bool) -> float:
        return (self.network if crosses_nodes else self.nvlink).seconds(nbytes)
