"""`CommStats`: what every collective hf_zero issues costs, in two measures.

Each call is booked by *purpose*, *kind*, *where* (intra- or inter-node) and *algorithm*, with two
byte counts:

``paper_bytes``
    The ZeRO paper's data volume of an ``M``-byte buffer: reduce-scatter ``M`` (its input),
    all-gather ``M`` (its output), all-reduce ``2M``, broadcast ``M``, all-to-all ``M`` (its
    input), barrier 0. The convention hf_zero has always reported, comparable across backends.
``wire_bytes``
    The payload this rank *sends* with the algorithm actually run (``N`` = group size):

    =====================  ==================================================  =================
    algorithm              where it runs                                       bytes this rank
                                                                               sends
    =====================  ==================================================  =================
    ``ring_all_reduce``    all-reduce (gloo: always its ring; NCCL: ring)      2(N-1)/N M
    ``gloo_all_reduce``    gloo's own reduce-scatter: torch runs it as an      2(N-1)/N M
                           all-reduce of a copy, then keeps the rank's slice
    ``ring``               all-gather (gloo, NCCL); reduce-scatter (NCCL)      (N-1)/N M
    ``exchange``           hf_zero's point-to-point reduce-scatter/all-gather  (N-1)/N M
                           on gloo (`hf_zero.comm.exchange`)
    ``pairwise``           all-to-all (gloo, NCCL)                             (N-1)/N M
    ``binomial_tree``      gloo broadcast: the root sends to ceil(log2 N)      M per child:
                           ranks, each forwards down its subtree               the root M times
                                                                               ceil(log2 N), a
                                                                               leaf 0
    ``chain``              NCCL broadcast (pipelined ring from the root):      booked (N-1)/N M
                           every rank but the last sends M                     (the mean)
    ``barrier``            barriers, monitored barriers                        0
    ``point_to_point``     one send to one peer (pipeline stages' activations  M
                           and their gradients)
    =====================  ==================================================  =================

    ``hierarchical``: hf_zero's reduce-scatter / all-gather on a gloo data-parallel group that
    spans nodes (`hf_zero.comm.hierarchical`): an exchange among the ranks with the same
    position on every node (``k`` nodes: ``(k-1)/k`` of ``M/L`` out of the node, ``L`` ranks per
    node) and exchanges inside the node (``(L-1)/L M``).

    The wire bytes are split by destination: ``inter_node_wire_bytes`` are those sent to ranks
    on other nodes (what crosses the network: the ring's hop to the next node, the exchange's
    chunks for remote peers, the tree's remote children), ``intra_node_wire_bytes`` the rest.
    Paper bytes are split by group: inter-node when the group spans nodes.

    Summed over a group's ranks each figure is exact (to integer rounding); per rank it is exact
    for every row but ``chain`` (NCCL picks the ring order, so the mean is booked on every rank).
    Against loopback interface counters (tests/comm/test_comm_wire.py) the wire figure is the
    payload: TCP/IP and gloo headers and ACKs add 0.09% to 1.4% on top. Assumptions, stated: NCCL
    may pick its tree or NVLS/CollNet algorithms for an all-reduce, which send other amounts than
    the ring booked here; a buffer that does not split into ``N`` equal chunks moves up to a chunk
    more or less on a given rank than the formula (the sum stays right); tiny control messages
    (flags, barriers) are booked at their payload, which is smaller than their headers.

Purposes keep the ZeRO traffic comparable with the paper while nothing goes uncounted:

* ``"zero"``: gradient and parameter traffic (reductions, gathers, the initial broadcast, ZeRO++).
* ``"tp"``: AutoTP activations and gradients, and gathering TP slices for a state dict.
* ``"sp"``: sequence parallelism's attention all-to-alls and loss sums.
* ``"pp"``: pipeline stages: activations and their gradients sent between stages (booked as
  each send is issued: kind ``send``), the tied embedding's gradient sum and value copy, and
  whole-model gathers after training.
* ``"control"``: flags, execution-order checks, barriers, gradient-norm and overflow reductions.

``bytes()``, ``as_dict()`` (without arguments), ``calls``, ``intra_node_bytes`` and
``inter_node_bytes`` keep their old meaning: the paper volume of the ``"zero"`` purpose.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import NamedTuple

PURPOSES = ("zero", "tp", "sp", "pp", "control")
PAPER_FACTOR = {
    "send": 1,
    "all_reduce": 2,
    "reduce_scatter": 1,
    "all_gather": 1,
    "broadcast": 1,
    "all_to_all": 1,
    "barrier": 0,
}
"""Paper volume per byte of the buffer a collective is booked with."""
WIRE_FRACTION = {
    "ring_all_reduce": 2,
    "gloo_all_reduce": 2,
    "ring": 1,
    "exchange": 1,
    "pairwise": 1,
    "chain": 1,
    "barrier": 0,
}
"""Algorithm -> k in k(N-1)/N M, the bytes one rank sends (``binomial_tree``: see `wire_bytes`)."""
ALGORITHMS = {
    "all_reduce": ("ring_all_reduce", "ring_all_reduce"),
    "reduce_scatter": ("ring", "gloo_all_reduce"),  # torch's gloo reduce-scatter all-reduces
    "all_gather": ("ring", "ring"),
    "all_to_all": ("pairwise", "pairwise"),
    "broadcast": ("chain", "binomial_tree"),
    "barrier": ("barrier", "barrier"),
    "send": ("point_to_point", "point_to_point"),
}
"""Kind -> (algorithm on NCCL and other backends, on gloo) when the backend's own collective runs."""


class Key(NamedTuple):
    purpose: str
    kind: str
    inter_node: bool
    algorithm: str


def tree_child_vranks(vrank: int, size: int) -> list[int]:
    """The ranks ``vrank`` (0 = the root) sends to in gloo's binomial-tree broadcast."""
    children, step = [], 1
    while step < size:
        if vrank < step and vrank + step < size:
            children.append(vrank + step)
        step *= 2
    return children


def tree_children(vrank: int, size: int) -> int:
    """How many ranks ``vrank`` sends to in gloo's binomial-tree broadcast."""
    return len(tree_child_vranks(vrank, size))


def wire_bytes(algorithm: str, nbytes: int, size: int, vrank: int = 0) -> int:
    """Bytes one rank sends for a collective on an ``nbytes`` buffer over ``size`` ranks.

    ``vrank`` is the rank's distance from the root (``binomial_tree`` only).
    """
    if algorithm == "binomial_tree":
        return nbytes * tree_children(vrank, size)
    if algorithm == "point_to_point":
        return nbytes
    return WIRE_FRACTION[algorithm] * (size - 1) * nbytes // size


class CommStats:
    """Calls, paper bytes and wire bytes per purpose, kind, intra/inter-node and algorithm."""

    def __init__(self) -> None:
        self._tally: dict[Key, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self._lock = threading.Lock()

    def record(
        self,
        kind: str,
        nbytes: int,
        spans_nodes: bool,
        group_size: int,
        purpose: str = "zero",
        algorithm: str | None = None,
        wire: int | None = None,
        off_node: int | None = None,
    ) -> None:
        """Book one call of ``kind`` on an ``nbytes`` buffer over ``group_size`` ranks.

        ``nbytes`` is ``M`` as in the module docstring (the input of a reduce-scatter or an
        all-to-all, the output of an all-gather, the buffer of an all-reduce or broadcast);
        ``algorithm`` defaults to the NCCL one (`ALGORITHMS`); ``wire`` overrides the bytes this
        rank sends (default: from ``algorithm``); ``off_node`` is the part of them sent to ranks
        on other nodes (default: all of them when the group spans nodes, else none).
        """
        if purpose not in PURPOSES:
            raise ValueError(f"CommStats: purpose {purpose!r} is not one of {PURPOSES}")
        algorithm = algorithm or ALGORITHMS[kind][0]
        wire = wire_bytes(algorithm, nbytes, group_size) if wire is None else wire
        off_node = (wire if spans_nodes else 0) if off_node is None else off_node
        with self._lock:  # qgZ's inter-node step books from a worker thread
            row = self._tally[Key(purpose, kind, bool(spans_nodes), algorithm)]
            row[0] += 1
            row[1] += PAPER_FACTOR[kind] * nbytes
            row[2] += wire
            row[3] += off_node

    # --- totals ------------------------------------------------------------------------------
    def _sum(self, column: int, kind, purpose, inter_node, algorithm=None) -> int:
        return sum(
            row[column]
            for key, row in self._tally.items()
            if (kind is None or key.kind == kind)
            and (purpose is None or key.purpose == purpose)
            and (inter_node is None or key.inter_node == inter_node)
            and (algorithm is None or key.algorithm == algorithm)
        )

    def wire_bytes(
        self, kind: str | None = None, purpose: str | None = None, inter_node: bool | None = None
    ) -> int:
        """Bytes this rank sent (``None`` = every kind / purpose / both intra and inter-node).

        ``inter_node=True``: the bytes sent to ranks on other nodes, what crosses the network
        between nodes; ``False``: the rest, sent to ranks on this node.
        """
        total, off_node = self._sum(2, kind, purpose, None), self._sum(3, kind, purpose, None)
        if inter_node is None:
            return total
        return off_node if inter_node else total - off_node

    def paper_bytes(
        self, kind: str | None = None, purpose: str | None = None, inter_node: bool | None = None
    ) -> int:
        """ZeRO-paper volume (``None`` = every kind / purpose / both intra and inter-node)."""
        return self._sum(1, kind, purpose, inter_node)

    def call_count(self, kind: str | None = None, purpose: str | None = None) -> int:
        return self._sum(0, kind, purpose, None)

    # --- the views hf_zero has always had: paper volume of the ZeRO traffic ------------------
    def bytes(self, kind: str | None = None) -> int:
        """Paper volume of one kind (or all kinds) of ``"zero"`` traffic, intra- plus inter-node."""
        return self.paper_bytes(kind, purpose="zero")

    def _per_kind(self, column: int, inter_node: bool | None) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, row in self._tally.items():
            if key.purpose == "zero" and (inter_node is None or key.inter_node == inter_node):
                out[key.kind] = out.get(key.kind, 0) + row[column]
        return out

    @property
    def calls(self) -> dict[str, int]:
        """Calls per kind of ``"zero"`` traffic."""
        return self._per_kind(0, None)

    @property
    def intra_node_bytes(self) -> dict[str, int]:
        """Paper volume per kind of ``"zero"`` traffic on groups inside one node."""
        return self._per_kind(1, False)

    @property
    def inter_node_bytes(self) -> dict[str, int]:
        """Paper volume per kind of ``"zero"`` traffic on groups that span nodes."""
        return self._per_kind(1, True)

    def as_dict(self, purpose: str | None = "zero") -> dict[str, dict]:
        """Per kind: calls, ``bytes`` (= ``paper_bytes``), ``wire_bytes``, their intra/inter-node
        split and ``algorithms`` (calls per algorithm actually run: a reduce-scatter run as
        hf_zero's point-to-point exchange says ``{"exchange": n}``). ``purpose=None`` merges
        every purpose; the default is the ZeRO traffic only, as before."""
        out: dict[str, dict] = {}
        for key in sorted(self._tally):
            if purpose is not None and key.purpose != purpose:
                continue
            calls, paper, wire, off_node = self._tally[key]
            entry = out.setdefault(
                key.kind,
                {
                    "calls": 0,
                    "bytes": 0,
                    "paper_bytes": 0,
                    "wire_bytes": 0,
                    "intra_node_bytes": 0,
                    "inter_node_bytes": 0,
                    "intra_node_wire_bytes": 0,
                    "inter_node_wire_bytes": 0,
                    "algorithms": {},
                },
            )
            where = "inter_node" if key.inter_node else "intra_node"
            entry["calls"] += calls
            entry["bytes"] += paper
            entry["paper_bytes"] += paper
            entry["wire_bytes"] += wire
            entry[f"{where}_bytes"] += paper
            entry["inter_node_wire_bytes"] += off_node
            entry["intra_node_wire_bytes"] += wire - off_node
            entry["algorithms"][key.algorithm] = entry["algorithms"].get(key.algorithm, 0) + calls
        return out

    def by_purpose(self) -> dict[str, dict[str, dict]]:
        """``{purpose: as_dict(purpose)}`` for every purpose with traffic."""
        present = {key.purpose for key in self._tally}
        return {p: self.as_dict(p) for p in PURPOSES if p in present}

    def rows(self) -> list[dict]:
        """One row per (purpose, kind, intra/inter-node, algorithm): the raw tally."""
        return [
            {**key._asdict(), "calls": c, "paper_bytes": p, "wire_bytes": w, "off_node_bytes": o}
            for key, (c, p, w, o) in sorted(self._tally.items())
        ]

    # --- housekeeping ------------------------------------------------------------------------
    def copy(self) -> CommStats:
        twin = CommStats()
        twin._tally.update({k: list(v) for k, v in self._tally.items()})
        return twin

    def since(self, earlier: CommStats) -> CommStats:
        """What was counted after ``earlier`` (a `copy` taken before): a window of steps."""
        window = self.copy()
        for key, row in earlier._tally.items():
            window._tally[key] = [a - b for a, b in zip(window._tally[key], row)]
        return window

    def reset(self) -> CommStats:
        """Start counting from zero; returns what was counted until now (a new `CommStats`)."""
        before = self.copy()
        self._tally.clear()
        return before

    def __repr__(self) -> str:
        rows = [
            f"{purpose}/{kind}: {v['calls']} calls, {v['wire_bytes']} B sent, "
            f"{v['paper_bytes']} B paper"
            for purpose, kinds in self.by_purpose().items()
            for kind, v in kinds.items()
        ]
        return "CommStats(" + "; ".join(rows) + ")"
