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
    last_use: int = 0


class RadixCache:
    def __init__(self, block_size: int, num_snapshots: int = 0) -> None:
        self.block_size = block_size
        self.root = Node((), -1, None, 0)
        self._clock = itertools.count(1)
        self._free_snapshots = list(range(num_snapshots - 1, -1, -1))
        self.num_nodes = 0

    def _keys(self, tokens: list[int], num_blocks: int):
        bs = self.block_size
        return (tuple(tokens[i * bs : (i + 1) * bs]) for i in range(num_blocks))

    def match(self, tokens: list[int]) -> list[Node]:
        """The nodes of the longest cached prefix of ``tokens``, in whole blocks."""
        path, node, now = [], self.root, next(self._clock)
        for key in self._keys(tokens, len(tokens) // self.block_size):
            node = node.children.get(key)
            if node is None:
                break
            node.last_use = now
            path.append(node)
        return path

    def acquire(self, nodes: list[Node]) -> None:
        for n in nodes:
            n.ref += 1

    def release(self, nodes: list[Node]) -> None:
        now = next(self._clock)
        for n in nodes:
            n.ref -= 1
            n.last_use = now
            assert n.ref >= 0, "prefix-cache node released more often than acquired"

    def insert(self, parent: Node, key: tuple[int, ...], block: int) -> Node | None:
        """Add ``block`` as the child of ``parent`` for ``key``, held once by the caller.
        None when that prefix is already cached under another block."""
        if key in parent.children:
            return None
        node = Node(key, block, parent, parent.depth + 1, ref=1, last_use=next(self._clock))
        parent.children[key] = node
        self.num_nodes += 1
        return node

    # ---- eviction
    def _evictable_leaves(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.ref == 0:
                out.append(n)
        return out

    def evict(self, num_blocks: int) -> list[int]:
        """Drop up to ``num_blocks`` unreferenced leaves, least recently used first; their blocks."""
        freed: list[int] = []
        while len(freed) < num_blocks:
            leaves = sorted(self._evictable_leaves(), key=lambda n: n.last_use)
            if not leaves:
                break
            for n in leaves[: num_blocks - len(freed)]:
                del n.parent.children[n.key]
                self.num_nodes -= 1
                freed.append(n.block)
                if n.snapshot is not None:
                    self._free_snapshots.append(n.snapshot)
        return freed

    @property
    def num_evictable(self) -> int:
        count, stack = 0, list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            count += n.ref == 0
        return count

    # ---- GDN state snapshots
    def take_snapshot_slot(self) -> int | None:
        """A free snapshot slot, dropping the least recently used unreferenced snapshot if needed."""
        if not self._free_snapshots:
            held, stack = [], list(self.root.children.values())
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                if n.snapshot is not None and n.ref == 0:
                    held.append(n)
            if not held:
                return None
            victim = min(held, key=lambda n: n.last_use)
            self._free_snapshots.append(victim.snapshot)
            victim.snapshot = None
        return self._free_snapshots.pop()

    def give_back_snapshot(self, slot: int) -> None:
        self._free_snapshots.append(slot)
