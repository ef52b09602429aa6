"""The scheduler's side of the prefix cache (the tree itself is ``radix_cache``): where a newly
admitted request starts, and what of a step enters the cache.

A newly admitted request starts after the longest cached prefix of its tokens (whole blocks,
leaving at least one token to compute; on hybrid models only up to a block that has a GDN state
snapshot); one asking for prompt log-probs computes its whole prompt. After each step the
request's newly full blocks enter the cache (where the same tokens are cached already, the
request takes that copy instead of its own), and the GDN state snapshot its chunk saved is
attached to the block of its path it ends at, or given back when that block has one. A chunk
snapshots at the deepest block it shares with the cache that lacks a snapshot, else at its last
block boundary (``shared_point``). A decode step that fills a block snapshots the state after
it, so a chat's next turn hits the generated tokens too; a request keeps only its latest such
snapshot.
"""

from __future__ import annotations

from ft.scheduler.radix_cache import Node, RadixCache
from ft.scheduler.request import Request
from ft.scheduler.step import ScheduledSeq


def take_hit(cache: RadixCache | None, req: Request, block_size: int, hybrid: bool) -> Node | None:
    """Start ``req`` after the longest usable cached prefix of its tokens; the last cached
    block its tokens matched (the root: none; None when the cache was not asked)."""
    if cache is None or req.params.prompt_logprobs is not None:
        return None
    path = cache.match(req.all_token_ids)
    nodes = path[: (req.num_tokens - 1) // block_size]
    matched = path[-1] if path else cache.root
    while hybrid and nodes and nodes[-1].snapshot is None:
        nodes.pop()
    if not nodes:
        return matched
    cache.acquire(nodes)
    req.cache_nodes, req.block_ids = list(nodes), [n.block for n in nodes]
    req.num_computed_tokens = len(nodes) * block_size
    req.restore_snapshot = nodes[-1].snapshot if hybrid else None
    return matched


def insert_computed(cache: RadixCache, req: Request, seq: ScheduledSeq, block_size: int) -> list[int]:
    """After ``seq``'s step: enter the request's newly full blocks (and a state snapshot) into the
    cache. Returns the blocks it gave up: where the same tokens are cached already (its hit fell
    back to an earlier snapshot and it computed them again, or it runs behind a twin), it reads
    that copy from now on (its ranks are sent the table again from there) and its own goes back,
    so what it computes next enters the cache below the shared blocks, and holds no block twice."""
    bs = block_size
    parent = req.cache_nodes[-1] if req.cache_nodes else cache.root
    given_up = []
    for i in range(len(req.cache_nodes), req.num_computed_tokens // bs):
        parent = cache.insert(parent, tuple(req.tokens(i * bs, (i + 1) * bs)), req.block_ids[i])
        if parent.block != req.block_ids[i]:
            given_up.append(req.block_ids[i])
            req.block_ids[i] = parent.block
            req.blocks_sent = min(req.blocks_sent, i)
        req.cache_nodes.append(parent)
    if seq.snapshot_to is not None:
        depth = (seq.start + seq.snapshot_len) // bs
        node = req.cache_nodes[depth - 1] if len(req.cache_nodes) >= depth else None
        decode = req.decodes(seq.start, len(seq.token_ids))
        if decode and node is not None and node.ref > 1:
            # a twin ahead of it holds the block (and dropped its own decode snapshot there): the
            # request's latest would outlive it there, held until the twin ends
            node = None
        if node is not None and node.snapshot is None:
            cache.attach_snapshot(node, seq.snapshot_to, decode)
            if decode:  # the request keeps its latest alone
                keep_latest_decode_snapshot(cache, req, node)
        else:
            cache.give_back_snapshot(seq.snapshot_to)
    return given_up


def keep_latest_decode_snapshot(cache: RadixCache, req: Request, node: Node) -> None:
    """Drop the snapshot ``req``'s previous decode step attached and remember ``node``, the block
    of its path that took this one (none another request held: a twin ahead of it keeps its own
    latest, ``insert_computed``). A generation snapshots every block it fills, and the blocks a
    running request holds are never evicted: without this a long reply would take the snapshot
    pool from every other prefix."""
    previous = req.decode_snapshot
    if previous is not None and previous.decode:  # not since taken back for a prompt's
        cache.drop_snapshot(previous)
    req.decode_snapshot = node


def shared_point(cache: RadixCache, req: Request, start: int, n: int, block_size: int) -> int:
    """The tokens of ``req``'s chunk [start, start + n) before the deepest block boundary in it
    that the cache holds without a GDN state snapshot (0: none), short of the request's last
    token: a prefix another request cached and this one shares up to there (a system prompt that
    ends inside a block, the chat that cached it having snapshotted its own boundaries only).
    Until a snapshot sits there every request sharing it falls back to an earlier one."""
    bs = block_size
    held = len(req.cache_nodes)
    end = min(start + n, req.num_tokens - 1) // bs
    top = req.cache_nodes[-1] if held else cache.root
    below = cache.descend(top, req.tokens(held * bs, end * bs))
    depth = held + len(below)
    if not below or depth * bs <= start or below[-1].snapshot is not None:
        return 0
    return depth * bs - start
