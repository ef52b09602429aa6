"""``all_gather_last_dim`` (the vocab-parallel lm_head's logits) over two gloo ranks: rank order
along the last dimension, whatever the layout of the tensor it is given."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ft.distributed import TPInfo, all_gather_last_dim


def _rank(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        x = (torch.arange(6.0).view(2, 3) + 10 * rank).t()  # [3, 2], not contiguous
        got = all_gather_last_dim(x, TPInfo(rank, 2, dist.group.WORLD))
        out[rank] = got.tolist()
    finally:
        dist.destroy_process_group()


def test_a_non_contiguous_input_gathers_in_rank_order():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
    want = torch.cat([(torch.arange(6.0).view(2, 3) + 10 * r).t() for r in (0, 1)], dim=-1).tolist()
    assert out[0] == out[1] == want
