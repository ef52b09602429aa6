"""The packed per-step inputs of CUDA-graph decode (``ft.engine.cuda_graph.Packed``), on CPU:
every field is a contiguous segment the graphs read, filled through the host twin, and one
upload of ``rows`` rows refreshes the first ``rows`` rows of every field and nothing past them."""

from __future__ import annotations

import pytest
import torch

from ft.engine.cuda_graph import Packed


def test_fields_are_contiguous_segments_and_upload_moves_the_first_rows():
    p = Packed({"ids": 1, "history": 3, "table": 2}, 4, torch.int64, torch.device("cpu"))
    ids, history, table = p.views()
    assert ids.shape == (4,) and history.shape == (4, 3) and table.shape == (4, 2)
    assert all(v.is_contiguous() for v in (ids, history, table))
    h_ids, h_hist, h_table = p.host_views(2)
    h_ids[:] = [7, 8]
    h_hist[:] = [[1, 2, 3], [4, 5, 6]]
    h_table[:] = [[9, 9], [10, 10]]
    p.upload(2)
    assert ids[:2].tolist() == [7, 8] and history[:2].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert table[:2].tolist() == [[9, 9], [10, 10]] and table[2:].eq(0).all()
    h_table = p.host_views(4)[2]
    h_table[3] = [5, 5]  # past the uploaded rows: stays on the host until an upload covers it
    p.upload(2)
    assert table[3].tolist() == [0, 0]
    p.upload(4)
    assert table[3].tolist() == [5, 5]


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_moe"])
def test_only_expert_kernels_that_sync_block_graph_capture(tmp_path, model_type, monkeypatch):
    """On a CPU the expert banks run torch kernels (not graph-safe) and block decode graphs; once
    their kernel is graph-safe nothing else in the model does (a router that grew a
    ``num_experts`` attribute once turned graphs off on the GPU, decode 17x slower)."""
    from ft.distributed import TPInfo
    from ft.engine.build import build_model
    from ft.engine.model_runner import graph_blockers
    from ft.models.config_json import load_model_config
    from ft.moe.banks import ExpertBank
    from tests.checkpoints import write_checkpoint

    write_checkpoint(tmp_path, model_type, seed=0)
    model = build_model(load_model_config(str(tmp_path)), TPInfo(0, 1), "cpu", torch.float32)
    blockers = graph_blockers(model, {})
    assert blockers and all(isinstance(model.get_submodule(n), ExpertBank) for n in blockers)
    monkeypatch.setattr(ExpertBank, "graph_safe", True)
    assert graph_blockers(model, {}) == []
    assert graph_blockers(model, {"attention": object()}) == ["attention"]


def test_upload_lists_returns_views_of_one_buffer_per_dtype():
    from ft.utils import upload_lists

    a, b, c, d = upload_lists(
        [
            ([1, 2, 3], torch.int64, (3,)),
            ([4, 5, 6, 7], torch.int32, (2, 2)),
            ([8], torch.int64, (1, 1)),
            ([], torch.int32, (0,)),
        ],
        torch.device("cpu"),
    )
    assert a.tolist() == [1, 2, 3] and b.tolist() == [[4, 5], [6, 7]] and c.tolist() == [[8]]
    assert d.shape == (0,) and (a.dtype, b.dtype, c.dtype) == (torch.int64, torch.int32, torch.int64)
    assert all(x.is_contiguous() for x in (a, b, c, d))
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()  # one int64 buffer
    with pytest.raises(AssertionError, match="do not fill"):
        upload_lists([([1, 2], torch.int64, (3,))], torch.device("cpu"))
