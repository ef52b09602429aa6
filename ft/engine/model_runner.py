"""ModelRunner: one per rank. Builds and loads the model, owns the KV and state pools, and runs
one scheduled batch: tensors in, sampled tokens (on the first rank) out.

Where the routed experts live is the MoE runtime's business (``ft.moe.backends.runtime``): the
runner asks it where to build the banks, lets it place them in a host store before loading
(telling it what the pools, planned first, will take), and hands it what memory is left after the
pools for its expert cache. Not here: building the model (``build``), turning scheduler output
into tensors on the device (``batch_inputs``), prompt log-probs (``prompt_logprobs``), the pools'
sizes (``pools``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ft.attention import get_attention_backend
from ft.config import EngineConfig
from ft.distributed import TPInfo, broadcast_from_first
from ft.engine import allocator
from ft.engine.batch_inputs import batch_inputs
from ft.engine.block_tables import BlockTables
from ft.engine.build import build_model, effective_model_config
from ft.engine.pools import CacheLayers, PoolPlan, allocate_pools, plan_pools
from ft.engine.prompt_logprobs import prompt_logprobs
from ft.forward_context import ForwardContext, forward_context
from ft.gdn import get_gdn_backend
from ft.layers.sampler import Draw, Sampler, SampleResult, logprob_rows
from ft.models.config import ModelConfig
from ft.models.dummy import init_dummy_weights, skew_routers
from ft.models.loader import load_weights
from ft.moe.backends.placement import placed
from ft.moe.backends.runtime import MoeRuntime
from ft.sampling_params import Logprobs
from ft.scheduler.step import ScheduledSeq
from ft.utils import cdiv, upload, upload_lists


@dataclass
class SeqResult:
    request_id: str
    sample: SampleResult | None
    prompt_logprobs: list[Logprobs] | None


@dataclass
class Launched:
    """A batch issued to the device (``ModelRunner.launch``) and not yet collected: its logits, and
    on the first rank its sampled tokens on the device and on their way to the host."""

    seqs: list[ScheduledSeq]
    logits: torch.Tensor  # [S, V], sequence i's last row in row i
    prompt: list[tuple | None]  # each sequence's prompt log-probs (``top_parts``), on the device
    sampling: list[int] = field(default_factory=list)  # the sequences that sample, in ``draw`` order
    draw: Draw | None = None  # their tokens (and log-probs), on the device
    host: Draw | None = None  # the same, copied to the host once ``done`` has passed
    done: torch.cuda.Event | None = None


def graph_blockers(model: torch.nn.Module, kernels: dict[str, object]) -> list[str]:
    """What stops a decode step from being captured: the backends in ``kernels`` and the modules
    that declare ``graph_safe`` false, and expert banks (modules with ``num_experts``) that do not
    declare it. Empty when every kernel of the step runs without host synchronisation."""
    named = list(kernels.items()) + [
        (n, m) for n, m in model.named_modules() if hasattr(m, "graph_safe") or hasattr(m, "num_experts")
    ]
    return [name for name, k in named if not getattr(k, "graph_safe", False)]


class ModelRunner:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig, tp: TPInfo) -> None:
        self.cfg, self.mc, self.tp = cfg, mc, tp
        self.device = cfg.resolved_device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", tp.rank)
        allocator.configure(self.device)  # before the first allocation
        if cfg.max_gpu_memory_bytes:  # else a limit the user set on the process stands
            allocator.cap(cfg.max_gpu_memory_bytes, self.device)
        self.dtype = cfg.torch_dtype(mc.dtype)
        mc = self.mc = effective_model_config(cfg, mc)
        self.moe = MoeRuntime(cfg, mc, tp, self.device, self.dtype)
        self.model = build_model(mc, tp, self.device, self.dtype, self.moe.bank_device).eval()
        pools = self._plan_pools()  # first: a lean expert cache is allocated around them, at attach
        self.moe.attach_stores(self.model, pools.kv_bytes + pools.state_bytes)  # the loaders fill it
        self.routing_skew = cfg.dummy_routing_skew
        if cfg.load_format == "dummy":
            init_dummy_weights(self.model, cfg.seed, cfg.dummy_routing_skew, self.device)
        else:
            load_weights(self.model, cfg.model, progress=cfg.progress and tp.is_first)
        self.attention = get_attention_backend(cfg.attention_backend, self.device.type)
        self.gdn = get_gdn_backend(cfg.gdn_backend, self.device.type)
        self.sampler = Sampler(self.device, cfg.seed)
        self.sampler.eos_ids = tuple(self.mc.eos_token_ids)  # banned below a request's min_tokens
        self.plan = self._allocate_pools(pools)
        self.plan = replace(self.plan, moe=self.moe.allocate(self.model, self.plan.num_slots))
        if cfg.progress or self.moe.offloads:
            rows = self.plan.state_rows if self.plan.has_gdn else 0
            print(
                self.moe.describe(self.plan.num_blocks * cfg.block_size, rows, self.plan.state_bytes),
                flush=True,
            )
        self.graphs = None
        max_bs = min(cfg.cuda_graph_max_bs, self.plan.num_slots, self.moe.max_graph_batch())
        if self.device.type == "cuda" and not cfg.disable_cuda_graph and max_bs >= 1:
            self.graphs = self._decode_graphs(max_bs)
            self.moe.discard_uses()

    def _decode_graphs(self, max_bs: int):
        """The captured decode steps, or None, said why, when a kernel of the step cannot be captured."""
        blockers = graph_blockers(self.model, {"attention": self.attention, "gdn": self.gdn})
        if blockers:
            more = f" and {len(blockers) - 3} more" if len(blockers) > 3 else ""
            print(f"ft: CUDA graphs off, decode runs eagerly: {', '.join(blockers[:3])}{more} not graph-safe")
            return None
        from ft.engine.cuda_graph import CudaGraphRunner
        from ft.moe.backends.graph_split import SegmentedGraphRunner

        max_len = self.cfg.model_len(self.mc.max_position_embeddings)
        graphs = SegmentedGraphRunner if self.moe.splits_graphs else CudaGraphRunner
        return graphs(self, max_bs, cdiv(max_len, self.cfg.block_size))

    def set_moe_variant(self, policy: str | None = None, routing_skew: float | None = None) -> None:
        """Switch the expert-cache policy and, with dummy weights, the routers' skew, in place, so
        ``ft bench offline`` measures several variants on one loaded model (loading an 80B
        offload store takes minutes). The routers are rescaled from the current skew to the new
        one with the same popularity ranks (``ft.models.dummy.skew_routers``). The expert caches
        start again from their start-up fill."""
        if routing_skew is not None and routing_skew != self.routing_skew:
            if self.cfg.load_format != "dummy":
                raise ValueError("a routing skew applies to dummy weights only (--load-format dummy)")
            if routing_skew < 0:
                raise ValueError(f"routing skew must be >= 0, got {routing_skew}")
            skew_routers(self.model, routing_skew - self.routing_skew, self.cfg.seed)
            self.routing_skew = routing_skew
        if policy is not None:
            self.moe.set_policy(policy)
        self.moe.restart_caches()  # each variant from the start-up fill, not the last one's cache

    def profile(self, action: str, calls: list | None = None) -> dict | float | None:
        """``begin``: decode runs eagerly (each kernel visible) and this process's kernels are
        profiled; ``end``: graphs back, and the first rank returns what ran; ``all_reduces``:
        every rank times the all-reduces ``calls`` (shape, dtype) with the ranks in step, and the
        first returns the milliseconds (``ft.bench.census``)."""
        from ft.bench.census import KernelProfile, time_all_reduces

        if action == "begin":
            self._graphs_off, self.graphs = self.graphs, None
            self._profile = KernelProfile(self.device)
            self._profile.begin()
            return None
        if action == "all_reduces":
            try:  # a figure of the census, not worth the run: every rank fails alike (same calls)
                ms = time_all_reduces(calls, self.tp.group, self.device)
            except Exception as e:
                ms = f"{type(e).__name__}: {e}"
            return ms if self.tp.is_first else None
        if action != "end":
            raise ValueError(f"profile action {action!r} (known: begin, end, all_reduces)")
        got = self._profile.end()
        self.graphs, self._profile = self._graphs_off, None
        return got if self.tp.is_first else None

    def close(self) -> None:
        """Drop the CUDA graphs, which hold this runner: without the cycle the runner, its weights
        and pools go as soon as the executor lets go, not at the next cyclic collection; and lift
        ``--max-gpu-memory``'s hold on the allocator, which is the process's, not the runner's."""
        self.graphs = None
        if self.cfg.max_gpu_memory_bytes:
            allocator.cap(None, self.device)

    # ---- pools
    def _plan_pools(self) -> PoolPlan:
        """The KV and state pools' sizes, decided once, before the experts are placed and loaded."""
        self.layers = CacheLayers.of(self.model)  # found once: state copies walk them every step
        self.attention_layers, self.gdn_layers = self.layers.attention, self.layers.gdn
        return plan_pools(self.cfg, self.mc, self.layers, self.device, self.dtype, self.moe, self.tp)

    def _allocate_pools(self, plan: PoolPlan) -> PoolPlan:
        self.state_stacks = allocate_pools(plan, self.cfg, self.layers, self.device, self.dtype)
        slots, bs = plan.num_slots + 1, self.cfg.block_size
        self.snapshot_base = slots  # snapshot k lives in state row slots + k
        max_len = min(self.cfg.model_len(self.mc.max_position_embeddings), plan.num_blocks * bs)
        self.tables = BlockTables(slots, cdiv(max_len, bs), bs)
        self.scratch_slot = slots - 1  # padded rows of a captured batch write here
        self.sampler.num_slots = slots
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters() if not placed(p))
        return replace(plan, weight_bytes=weights)

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy GDN state rows src -> dst in every GDN layer (restoring or taking snapshots)."""
        if not pairs:
            return
        n = len(pairs)
        src, dst = upload_lists(
            [([p[0] for p in pairs], torch.int64, (n,)), ([p[1] for p in pairs], torch.int64, (n,))],
            self.device,
        )
        for stack in self.state_stacks:  # [layers, rows, ...]: every layer's rows at once
            stack.index_copy_(1, dst, stack.index_select(1, src))

    # ---- one step
    def _forward(
        self, seqs: list[ScheduledSeq], ids_now: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[tuple | None]]:
        """The logits of each sequence's last row [S, V], and each sequence's prompt log-probs
        (``prompt_logprobs``). ``ids_now``: the input ids [T] already on the device (decode
        ahead), in place of the sequences' own."""
        if self.graphs is not None and self.graphs.can_run(seqs):
            return self.graphs.run(seqs, ids_now), [None] * len(seqs)
        ids, batch = batch_inputs(seqs, self.tables, self.snapshot_base, bool(self.gdn_layers), self.device)
        if ids_now is not None:
            ids.copy_(ids_now)
        with forward_context(ForwardContext(batch, self.attention, self.gdn)):
            hidden = self.model(ids, batch.positions)
        last = hidden.index_select(0, batch.cu_seqlens[1:].long() - 1)  # no host-to-device copy
        prompt = prompt_logprobs(self.model, hidden, seqs, self.mc.vocab_size, self.tp.is_first)
        return self.model.compute_logits(last), prompt

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> list[SeqResult] | None:
        """Run one batch; the first rank returns one result per sequence, the others None."""
        return self.collect(self.launch(seqs))

    @torch.inference_mode()
    def launch(self, seqs: list[ScheduledSeq], ids_from: Launched | None = None) -> Launched:
        """Issue one batch and its sampling without waiting for the device. ``ids_from``: a decode
        batch whose every sequence's token is the one ``ids_from`` (launched before it, not yet
        collected) samples for the same sequence, in the same order, taken on the device: the
        engine's decode ahead (``LLMEngine.step``); those sequences' ``token_ids`` hold
        ``PENDING_TOKEN``."""
        self.tables.update(seqs)  # every batch, in launch order: the rows follow the scheduler's
        base = self.snapshot_base
        self._copy_states([(base + s.restore_from, s.state_slot) for s in seqs if s.restore_from is not None])
        tokens = sum(len(s.token_ids) for s in seqs)
        ids = None
        if ids_from is not None:
            first = self.tp.is_first
            if not len(ids_from.seqs) == len(seqs) == tokens or (first and ids_from.draw is None):
                raise ValueError("decode ahead takes one token a sequence, the last batch's sample for it")
            # the first rank sampled them; the others take them from it, on the device
            ids = (
                ids_from.draw.tokens if first else torch.empty(tokens, dtype=torch.int64, device=self.device)
            )
            broadcast_from_first(ids, self.tp)
        self.moe.before_step(tokens)
        logits, prompt = self._forward(seqs, ids)  # [S, V]; GDN layers save the snapshots as they run
        # a snapshot at a chunk's end (a decode step's) is the slot's state now, copied before any
        # later step is issued (decode ahead included)
        self._copy_states([(s.state_slot, base + s.snapshot_to) for s in seqs if s.snapshot_after])
        self.moe.after_step(tokens)
        out = Launched(seqs, logits, prompt)
        if not self.tp.is_first:
            return out
        out.sampling = [i for i, s in enumerate(seqs) if s.sample]
        if out.sampling == list(range(len(out.sampling))):  # decodes first, as the scheduler puts them
            sampled = logits[: len(out.sampling)]  # no gather
        else:  # a pageable index would block the host until the forward has run
            sampled = logits.index_select(0, upload(torch.tensor(out.sampling), logits.device))
        params = [seqs[i].params for i in out.sampling]
        if params:
            index = [seqs[i].output_index for i in out.sampling]
            seen = [seqs[i].seen for i in out.sampling]
            owners = [(seqs[i].state_slot, seqs[i].request_id) for i in out.sampling]
            out.draw = self.sampler.draw(sampled, params, index, seen, owners)
            out.host = out.draw.to_host()  # pinned: on its way while the host goes on
            if sampled.is_cuda:
                out.done = torch.cuda.Event()
                out.done.record()
        return out

    @torch.inference_mode()
    def collect(self, launched: Launched) -> list[SeqResult] | None:
        """A launched batch's results (waits for its sampled tokens): one per sequence on the first
        rank, None on the others."""
        if not self.tp.is_first:
            return None
        seqs = launched.seqs
        samples = []
        if launched.host is not None:
            if launched.done is not None:
                launched.done.synchronize()
            samples = self.sampler.results(launched.host, [seqs[i].params for i in launched.sampling])
        by_seq = dict(zip(launched.sampling, samples))
        out = []
        for i, (s, parts) in enumerate(zip(seqs, launched.prompt)):
            plp = None if parts is None else logprob_rows(*(t.tolist() for t in parts))
            out.append(SeqResult(s.request_id, by_seq.get(i), plp))
        return out
