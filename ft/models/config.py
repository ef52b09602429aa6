"""ModelConfig: the one frozen, typed view of a checkpoint's config.json that layers are built from.

The fields every family's layers read, as plain values checked once in ``__post_init__``;
derived sizes are properties. Reading a checkpoint's config.json into one is
``ft.models.config_json``. Layers never see the Hugging Face config object.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ft.quant.declaration import QuantDeclaration

LAYER_TYPES = ("full_attention", "linear_attention")
MLP_TYPES = ("moe", "dense")
# fields that must be positive integers, and the config.json names errors give them by
POSITIVE = dict(
    vocab_size="vocab_size", hidden_size="hidden_size", num_layers="num_hidden_layers",
    num_heads="num_attention_heads", num_kv_heads="num_key_value_heads", head_dim="head_dim",
    max_position_embeddings="max_position_embeddings",
)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    attn_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate (Qwen3-Next)
    zero_centered_norm: bool = False  # RMSNorm scales by (1 + w) (Qwen3-Next)
    # gated delta net
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    intermediate_size: int = 0  # dense MLP layers
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    expert_format: str = "bf16"  # how routed experts are stored: bf16 | nvfp4
    # QSA sparse attention (qwen4_exp): blocks of B positions, top-K plus Lc local blocks
    qsa_block_size: int = 0
    qsa_topk_blocks: int = 0
    qsa_local_blocks: int = 0
    qsa_index_heads: int = 0
    qsa_index_head_dim: int = 0
    # hyper-connections (qwen4_exp): n residual streams; 1 means plain residuals
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 1
    hc_eps: float = 1e-6
    # PLE hashed n-gram embeddings (qwen4_exp); no ple_layers means no PLE
    ple_layers: tuple[int, ...] = ()
    ple_ngram_orders: tuple[int, ...] = ()
    ple_heads: int = 0
    ple_head_dim: int = 0
    ple_pad_id: int = 0
    ple_table_rows: int = 0  # R = sum of the checkpoint's primes (config.json does not carry it)
    ple_on_host: bool = False  # the table lives in (pinned) host memory: --ple-backend pinned
    quantization: QuantDeclaration = field(default_factory=QuantDeclaration, hash=False, compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"config field {name}: {why}")

        for name, key in POSITIVE.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, f"{value!r} must be a positive integer")
        if len(self.layer_types) != self.num_layers:
            raise bad("layer_types", f"{len(self.layer_types)} entries for {self.num_layers} layers")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise bad("layer_types", f"layer {i} has unknown type {t!r} (known: {LAYER_TYPES})")
        if len(self.mlp_types) != self.num_layers or any(t not in MLP_TYPES for t in self.mlp_types):
            raise bad("mlp_types", f"{self.mlp_types}")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_key_value_heads", f"{self.num_kv_heads} does not divide {self.num_heads} heads")
        if self.rotary_dim % 2:
            raise bad("partial_rotary_factor", f"rotary dim {self.rotary_dim} must be even")
        if "linear_attention" in self.layer_types:
            hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
            if hk <= 0 or hv % hk:
                raise bad("linear_num_value_heads", f"Hv={hv} must be a multiple of Hk={hk}")
        dense = [i for i, t in enumerate(self.mlp_types) if t == "dense"]
        if dense and self.intermediate_size <= 0:
            why = f"{self.intermediate_size} must be positive: layers {dense} are dense"
            raise bad("intermediate_size", why)
        if "moe" in self.mlp_types:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise bad("num_experts_per_tok", f"{self.num_experts_per_tok} of {self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise bad("moe_intermediate_size", "must be positive")
        if self.model_type == "qwen4_exp":
            self._check_qwen4_exp(bad)

    def _check_qwen4_exp(self, bad) -> None:
        from ft.scheduler.step import HISTORY  # the tokens before a chunk every rank sees

        positive = ("qsa_block_size", "qsa_local_blocks", "qsa_index_heads", "qsa_index_head_dim", "hc_mult")
        for name in positive:
            if getattr(self, name) < 1:
                raise bad(name, f"{getattr(self, name)} must be >= 1")
        if self.qsa_topk_blocks < 0:
            raise bad("qsa_topk_blocks", f"{self.qsa_topk_blocks} must be >= 0")
        if self.hc_mult > 1 and self.hc_sinkhorn_iters < 1:
            raise bad("hc_sinkhorn_iters", f"{self.hc_sinkhorn_iters} must be >= 1")
        if not self.ple_layers:
            return
        if len(set(self.ple_layers)) != len(self.ple_layers) or not all(
            0 <= i < self.num_layers for i in self.ple_layers
        ):  # a layer's u is its index in the list, in any order (spec section 7)
            raise bad(
                "ple_layers", f"{list(self.ple_layers)} must be distinct layer indices < {self.num_layers}"
            )
        if not self.ple_ngram_orders or not all(1 <= n <= HISTORY + 1 for n in self.ple_ngram_orders):
            raise bad(
                "ple_ngram_orders",
                f"{list(self.ple_ngram_orders)}: orders must lie in 1..{HISTORY + 1} (the engine carries "
                f"{HISTORY} tokens of context before each chunk)",
            )
        for name in ("ple_heads", "ple_head_dim", "ple_table_rows"):
            if getattr(self, name) < 1:
                raise bad(name, f"{getattr(self, name)} must be >= 1 when ple_layers is set")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def summary(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "quantization"}
