"""Prefix cache: a radix tree over token ids at block granularity.

Each node is one full KV block: its ``block_size`` token ids are the edge from its parent, so a
path from the root spells a prefix and the nodes on it hold that prefix's KV blocks. Requests
holding a node keep it alive (``ref``); nodes no one holds stay cached until their block is
needed, then the least recently used leaves go first.

Hybrid models also need the recurrent GDN state at the end of the prefix, which KV blocks do not
give: a node may carry a ``snapshot`` (a slot of the runner's snapshot pool holding the conv and
recurrent state after the node's last token). A hit on such a model can only end at a node with a
snapshot. Each prefill chunk takes one, at its last block boundary short of the request's last
token (the GDN layers save it mid-chunk, ``ft.gdn.snapshots``).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    block: int
    parent: Node | None
    depth: int  # number of blocks from the root, this one included
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    ref: int = 0
    snapshot: int | None = None
    decode: bool = False  # the snapshot is a decode step's (a running request's latest)
    on_head: bool = False  # on the prefix the refused waiting head matched (``mark_head``)
    last_use: int = 0


class RadixCache:
    """The tree plus what eviction needs kept up to date as nodes are held, released, added and
    dropped, so that neither eviction nor a snapshot slot walks the tree: the unreferenced leaves
    (the eviction candidates), the nodes holding snapshots and the count of unreferenced nodes.
    A request holds every node of its path, so a node's ``ref`` is at least each child's: an
    unreferenced node heads an unreferenced subtree, all of it evictable leaf by leaf."""

    def __init__(self, block_size: int, num_snapshots: int = 0) -> None:
        self.block_size = block_size
        self.root = Node((), -1, None, 0)
        self._clock = itertools.count(1)
        self._free_snapshots = list(range(num_snapshots - 1, -1, -1))
        self._leaves: set[Node] = set()  # ref 0, no children
        self._snapshotted: set[Node] = set()  # snapshot is not None
        self.num_nodes = 0
        self.num_evictable = 0  # nodes with ref 0
        # snapshots attached or dropped so far on the refused head's matched prefix: on a hybrid
        # model a hit ends at a snapshot, so its hit may have grown or shrunk since
        # (``Scheduler.refused_again``); elsewhere they cannot change it
        self.head_changes = 0
        self._head: Node | None = None  # the last node of the head's matched prefix

    def _keys(self, tokens: list[int], num_blocks: int):
        bs = self.block_size
        return (tuple(tokens[i * bs : (i + 1) * bs]) for i in range(num_blocks))

    def match(self, tokens: list[int]) -> list[Node]:
        """The nodes of the longest cached prefix of ``tokens``, in whole blocks (a use of each)."""
        path, now = self.descend(self.root, tokens), next(self._clock)
        for node in path:
            node.last_use = now
        return path

    def extends(self, node: Node, key: tuple[int, ...] | None) -> bool:
        """Whether a match that ended at ``node`` could now go further: ``key`` (the next block's
        tokens; None: there is none to match) is cached below it, or the node was evicted since
        (the match is shorter now, or a re-inserted copy may have grown)."""
        if node.parent is not None and node.parent.children.get(node.key) is not node:
            return True
        return key is not None and key in node.children

    def touch(self, last: Node, held: int) -> None:
        """The recency a match of a path ending at ``last``, then the release of its first
        ``held`` nodes, would leave (a refused request not matched again keeps its prefix as
        recent as its retries kept it, so eviction takes the same blocks)."""
        matched, released = next(self._clock), next(self._clock)
        while last is not self.root and last is not None:
            last.last_use = released if last.depth <= held else matched
            last = last.parent

    def acquire(self, nodes: list[Node]) -> None:
        for n in nodes:
            if n.ref == 0:
                self.num_evictable -= 1
                self._leaves.discard(n)
            n.ref += 1

    def release(self, nodes: list[Node]) -> None:
        now = next(self._clock)
        for n in nodes:
            n.ref -= 1
            n.last_use = now
            assert n.ref >= 0, "prefix-cache node released more often than acquired"
            if n.ref == 0:
                self.num_evictable += 1
                if not n.children:
                    self._leaves.add(n)

    def descend(self, node: Node, tokens: list[int]) -> list[Node]:
        """The cached nodes below ``node`` that spell ``tokens``' whole blocks, as far as they
        go; a look that leaves recency as it is (``match`` counts as a use)."""
        path = []
        for key in self._keys(tokens, len(tokens) // self.block_size):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def insert(self, parent: Node, key: tuple[int, ...], block: int) -> Node:
        """Add ``block`` as the child of ``parent`` for ``key``, held once by the caller; when that
        prefix is cached already (under another block), that node, held once more."""
        node = parent.children.get(key)
        if node is not None:
            self.acquire([node])
            return node
        node = Node(key, block, parent, parent.depth + 1, ref=1, last_use=next(self._clock))
        parent.children[key] = node
        self._leaves.discard(parent)
        self.num_nodes += 1
        return node

    # ---- eviction
    def evict(self, num_blocks: int) -> list[int]:
        """Drop up to ``num_blocks`` unreferenced leaves, least recently used first (then the
        lower block; a parent left childless joins the candidates); their blocks. Costs the
        candidates, not the tree: with the pool full, each decode step's new block evicts one."""
        heap = [(n.last_use, n.block, n) for n in self._leaves]  # blocks are unique: no node compares
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_blocks:
            n = heapq.heappop(heap)[2]
            parent = n.parent
            del parent.children[n.key]
            self._leaves.discard(n)
            self.num_nodes -= 1
            self.num_evictable -= 1
            freed.append(n.block)
            if n.snapshot is not None:
                self.drop_snapshot(n)
            if parent is not self.root and parent.ref == 0 and not parent.children:
                self._leaves.add(parent)
                heapq.heappush(heap, (parent.last_use, parent.block, parent))
        return freed

    def mark_head(self, last: Node | None) -> None:
        """Mark the prefix ending at ``last`` as the refused head's (None: no head is refused), the
        last head's unmarked: snapshot changes there count in ``head_changes``. A walk of the
        prefix, once a refusal (its match already walked it)."""
        node = self._head
        while node is not None and node.on_head:
            node.on_head = False
            node = node.parent
        self._head = last
        while last is not None and last is not self.root:
            last.on_head = True
            last = last.parent

    # ---- GDN state snapshots
    def attach_snapshot(self, node: Node, slot: int, decode: bool = False) -> None:
        node.snapshot, node.decode = slot, decode
        self.head_changes += node.on_head
        self._snapshotted.add(node)

    def take_snapshot_slot(self, evict: bool = True) -> int | None:
        """A free snapshot slot; with ``evict``, if none is free, the one of the least recently
        used unreferenced snapshot (of equally recent ones, the deepest: shorter prefixes are
        shared more), else of the least recently used decode snapshot that only its running
        request holds (a reply's latest block; a prompt's snapshot is shared more)."""
        if not self._free_snapshots:
            if not evict:
                return None
            # (a decode snapshot another request's hit holds too is restored in this step: kept)
            held = [n for n in self._snapshotted if n.ref == 0] or [
                n for n in self._snapshotted if n.decode and n.ref == 1
            ]
            if not held:
                return None
            self.drop_snapshot(min(held, key=lambda n: (n.last_use, -n.depth)))
        return self._free_snapshots.pop()

    def drop_snapshot(self, node: Node) -> None:
        """Free ``node``'s snapshot slot; the node stays cached."""
        self.head_changes += node.on_head
        self._snapshotted.discard(node)
        self._free_snapshots.append(node.snapshot)
        node.snapshot, node.decode = None, False

    def give_back_snapshot(self, slot: int) -> None:
        self._free_snapshots.append(slot)
