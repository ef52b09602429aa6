"""The one-shot all-reduce over symmetric memory (``ft.distributed.SYMM_ALL_REDUCE``) on two GPUs:
the same sums as NCCL's, eagerly and replayed from a CUDA graph, and NCCL kept for what it does
not take. Two ranks are spawned; each reports what it saw through a queue."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    from ft import distributed

    distributed.SYMM_ALL_REDUCE = True
    device = torch.device("cuda", rank)
    distributed.init_process_group(rank, 2, f"tcp://127.0.0.1:{port}", device, 60.0)
    group = dist.group.WORLD
    try:
        one_shot = distributed._ONE_SHOT[group]
        gen = torch.Generator(device=device).manual_seed(rank)
        results = {}
        for shape in ((1, 2048), (64, 2048), (3, 1000)):
            x = torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)
            want = x.clone()
            dist.all_reduce(want, group=group)
            got = distributed.group_all_reduce(x.clone(), group)
            results[shape] = torch.equal(got, want) and one_shot.takes(x)
        x = torch.randn(1, 2048, generator=gen, device=device).to(torch.bfloat16)
        want = x.clone()
        dist.all_reduce(want, group=group)
        y = x.clone()
        distributed.group_all_reduce(y.clone(), group)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            distributed.group_all_reduce(y, group)
        dist.barrier(group)
        graph.replay()
        torch.cuda.synchronize(device)
        results["graph"] = torch.equal(y, want)
        big = torch.ones(2 * distributed.SYMM_MAX_BYTES, dtype=torch.bfloat16, device=device)
        results["nccl for what does not fit"] = not one_shot.takes(big) and bool(
            (distributed.group_all_reduce(big, group) == 2).all()
        )
        queue.put((rank, results))
    except Exception as e:  # the test reports it
        queue.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def test_one_shot_all_reduce_sums_as_nccl_does():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for rank in (0, 1):
        assert isinstance(got[rank], dict), f"rank {rank}: {got[rank]}"
        assert all(got[rank].values()), f"rank {rank}: {got[rank]}"
