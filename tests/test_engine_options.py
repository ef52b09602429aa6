"""Engine options: a bad value is refused with an error naming the option, before a model loads."""

from __future__ import annotations

import pytest

from ft.config import EngineConfig

DUMMY = dict(config_file="config.json", load_format="dummy")


@pytest.mark.parametrize("length", [0, -8])
def test_max_model_len_below_one_is_refused(length):
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(**DUMMY, max_model_len=length)


def test_routing_skew_needs_dummy_weights(tmp_path):
    with pytest.raises(ValueError, match="dummy_routing_skew.*load_format='dummy'"):
        EngineConfig(model=str(tmp_path), dummy_routing_skew=1.0)
    assert EngineConfig(**DUMMY, dummy_routing_skew=1.0).dummy_routing_skew == 1.0


@pytest.mark.parametrize("name", ["max_gpu_memory", "max_host_memory"])
@pytest.mark.parametrize("size", ["garbage", "48XB", "-1GiB"])
def test_unreadable_size_names_the_option(name, size):
    with pytest.raises(ValueError, match=rf"EngineConfig\.{name}={size!r}: expected a number"):
        EngineConfig(**DUMMY, **{name: size})


def dummy_engine(tmp_path, raw: dict, **options):
    import json

    from ft.engine.engine import LLMEngine

    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = EngineConfig(config_file=str(tmp_path / "config.json"), load_format="dummy", device="cpu",
                       progress=False, **options)  # fmt: skip
    return LLMEngine(cfg)


@pytest.mark.parametrize(
    "family,options,why",
    [
        ("qwen3_next", dict(tp_size=3), r"linear_num_key_heads over tp ranks: 2 is not divisible by 3"),
        ("qwen3_moe", dict(tp_size=8), r"4 attention heads cannot be split over 8 ranks"),
        ("qwen3_moe", dict(tp_size=4), r"moe_intermediate_size over tp ranks: 6 is not divisible by 4"),
        ("qwen3_moe", dict(tp_size=2, quantize_experts="nvfp4"), r"NVFP4 .* per rank, which must be"),
    ],
)
def test_tp_size_that_does_not_shard_the_model_is_refused_before_ranks_start(tmp_path, family, options, why):
    """The sharding rules of the layers are checked in this process, on a model built on the meta
    device, so the error names --tp-size and comes before any rank is spawned or weight read."""
    from tests.checkpoints import QWEN3_MOE_BASE, QWEN3_NEXT_BASE

    base = QWEN3_NEXT_BASE if family == "qwen3_next" else QWEN3_MOE_BASE
    raw = base | dict(model_type=family, moe_intermediate_size=6 if options["tp_size"] == 4 else 16)
    tp = options["tp_size"]
    with pytest.raises(ValueError, match=rf"EngineConfig\.tp_size={tp} does not fit the model: {why}"):
        dummy_engine(tmp_path, raw, **options)


def test_max_model_len_beyond_the_models_positions_is_refused(tmp_path):
    from tests.checkpoints import QWEN3_MOE_BASE

    raw = QWEN3_MOE_BASE | dict(model_type="qwen3_moe", max_position_embeddings=512)
    with pytest.raises(ValueError, match=r"max_model_len=1024 .* max_position_embeddings of 512"):
        dummy_engine(tmp_path, raw, max_model_len=1024)
    assert dummy_engine(tmp_path, raw, max_model_len=512).max_model_len == 512


def test_a_model_refused_whatever_the_split_is_not_blamed_on_tp_size(monkeypatch):
    """``tp_refusal``: a refusal the model gets at one rank too (a declaration we cannot run, say)
    is raised as it is; only one that depends on the split names --tp-size."""
    from ft.engine import build

    def refuses(split_only: bool):
        def build_model(mc, tp, device, dtype):
            if tp.size > 1 or not split_only:
                raise ValueError("the layers refuse")

        return build_model

    monkeypatch.setattr(build, "build_model", refuses(split_only=False))
    for size in (1, 2):
        with pytest.raises(ValueError, match="^the layers refuse$"):
            build.tp_refusal(None, size)
    monkeypatch.setattr(build, "build_model", refuses(split_only=True))
    assert build.tp_refusal(None, 2) == "the layers refuse" and build.tp_refusal(None, 1) is None


@pytest.mark.parametrize(
    "family,options,why",
    [
        ("dense", dict(moe_backend="offload"), r"moe_backend='offload': the model has no routed experts"),
        ("dense", dict(moe_backend="cpu"), r"moe_backend='cpu': the model has no routed experts"),
        ("dense", dict(quantize_experts="nvfp4"), r"quantize_experts='nvfp4': the model has no routed"),
        ("dense", dict(expert_cache_fraction=0.5), r"expert_cache_fraction=0\.5: the model has no routed"),
        ("dense", dict(static_experts=1), r"static_experts=1: the model has no routed experts"),
    ],
)
def test_an_option_for_a_part_the_model_lacks_is_refused(family, options, why):
    """An expert placement or format on a model without routed experts was parsed and then ignored;
    it is refused by name before ranks start."""
    from dataclasses import replace

    from ft.engine.build import check_fits
    from ft.models.config_json import config_from_dict
    from tests.checkpoints import QWEN3_MOE_BASE, QWEN3_NEXT_BASE

    base = QWEN3_NEXT_BASE if family == "qwen3_next" else QWEN3_MOE_BASE
    raw = base | dict(model_type="qwen3_next" if family == "qwen3_next" else "qwen3_moe")
    if family == "dense":
        raw |= dict(mlp_only_layers=list(range(raw["num_hidden_layers"])))
    mc = config_from_dict(raw)
    cfg = EngineConfig(**DUMMY, device="cpu", **options)
    with pytest.raises(ValueError, match=rf"^EngineConfig\.{why}"):
        check_fits(cfg, mc)
    check_fits(replace(cfg, **{k: getattr(EngineConfig, k) for k in options}), mc)  # the defaults fit


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_moe"])
def test_a_ple_backend_on_a_model_without_ple_is_noted_not_refused(family, capsys):
    """The mission's command line (``--ple-backend pinned``) serves Qwen3-Next too: on a model
    without a PLE table the option starts the engine as without it, and says so."""
    from ft.engine.build import check_fits
    from ft.models.config_json import config_from_dict
    from tests.checkpoints import QWEN3_MOE_BASE, QWEN3_NEXT_BASE

    base = QWEN3_NEXT_BASE if family == "qwen3_next" else QWEN3_MOE_BASE
    mc = config_from_dict(base | dict(model_type=family))
    check_fits(EngineConfig(**DUMMY, device="cpu", ple_backend="pinned"), mc)
    assert "--ple-backend pinned: the model has no PLE n-gram table" in capsys.readouterr().err
    check_fits(EngineConfig(**DUMMY, device="cpu"), mc)
    assert capsys.readouterr().err == ""


def test_max_gpu_memory_on_the_cpu_is_refused():
    """--max-gpu-memory caps a GPU's allocator and plan; on the CPU it was accepted and ignored."""
    with pytest.raises(ValueError, match=r"max_gpu_memory='48GiB' caps a GPU's memory.*runs on cpu"):
        EngineConfig(**DUMMY, device="cpu", max_gpu_memory="48GiB")
    assert EngineConfig(**DUMMY, device="cuda", max_gpu_memory="48GiB").max_gpu_memory_bytes == 48 << 30


def test_a_tokenizer_option_without_a_tokenizer_is_refused(tmp_path):
    """--tokenizer naming a missing directory, or one without tokenizer files, served token ids only
    (as a checkpoint without a tokenizer does), saying nothing of the option."""
    with pytest.raises(ValueError, match=r"EngineConfig\.tokenizer: '/no/such/dir' is not a directory"):
        EngineConfig(**DUMMY, tokenizer="/no/such/dir")
    with pytest.raises(ValueError, match=r"EngineConfig\.tokenizer: .* has no tokenizer files \(tokenizer"):
        EngineConfig(**DUMMY, tokenizer=str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert EngineConfig(**DUMMY, tokenizer=str(tmp_path)).tokenizer == str(tmp_path)


@pytest.mark.parametrize("size", [1, 8, 24])
def test_a_block_size_the_cuda_kernels_cannot_page_is_refused(size):
    """On CUDA the Triton attention kernels take blocks of a power of two >= 16 (``triton_paged``);
    another --block-size passed, and failed their assertion once the weights had loaded."""
    with pytest.raises(ValueError, match=rf"EngineConfig\.block_size={size}: .* a power of two >= 16"):
        EngineConfig(**DUMMY, device="cuda", block_size=size)
    assert EngineConfig(**DUMMY, device="cpu", block_size=size).block_size == size  # the torch reference's
    assert EngineConfig(**DUMMY, device="cuda", attention_backend="torch", block_size=size).block_size == size
    assert EngineConfig(**DUMMY, device="cuda", block_size=32).block_size == 32


@pytest.mark.parametrize(
    "option",
    [
        dict(moe_prefill_hit_d2d=True),
        dict(moe_staging_experts=4),
        dict(moe_stream_ahead=False),
        dict(moe_prefetch=False),
        dict(expert_cache_policy="lfu"),
        dict(max_host_memory="8GiB"),
    ],
)
def test_a_streaming_option_beside_the_gpu_backend_is_refused(option):
    """With every expert resident nothing streams: these options of the offloading backends were
    parsed and ignored beside an explicit --moe-backend gpu (auto may still choose to offload)."""
    ((name, value),) = option.items()
    with pytest.raises(ValueError, match=rf"EngineConfig\.{name}={value!r} .* the gpu MoE backend keeps"):
        EngineConfig(**DUMMY, moe_backend="gpu", **option)
    assert getattr(EngineConfig(**DUMMY, **option), name) == value
