"""LLMEngine: requests in, outputs out, one ``step()`` at a time.

It owns the scheduler (pure Python) and an executor (the ranks); ``step()`` schedules a batch,
runs it, and folds the sampled tokens back into the requests. The offline ``LLM`` and the
server's engine process both drive this loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from ft.config import EngineConfig
from ft.engine.build import model_config_of
from ft.engine.executor import make_executor
from ft.models.config import ModelConfig
from ft.sampling_params import RequestOutput, SamplingParams
from ft.scheduler.kv_pool import BlockAllocator
from ft.scheduler.radix_cache import RadixCache
from ft.scheduler.request import Request
from ft.scheduler.scheduler import Scheduler
from ft.scheduler.state_pool import SlotAllocator


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    prompt_tokens: int
    generation_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int = 0
    # MoE placement (the first rank's; ft.moe.backends): cumulative over requests (docs/serving.md)
    moe_backend: str = "gpu"
    moe_layers: int = 0
    moe_experts: int = 0  # routed experts per layer
    moe_slots: int = 0  # GPU cache slots per layer
    moe_resident: int = 0  # experts on the GPU now, all layers
    moe_hits: int = 0  # (layer, expert) uses of a batch that found the expert resident
    moe_misses: int = 0  # ... that did not (copied, streamed or computed on the CPU)
    moe_evictions: int = 0
    moe_prefetched: int = 0
    moe_prefetch_hits: int = 0
    moe_bytes_h2d: int = 0  # expert bytes copied host -> device
    moe_bytes_host_read: int = 0  # expert bytes kernels read from the host store in place (host reads)
    moe_bytes_d2d: int = 0
    moe_copy_seconds: float = 0.0  # busy time of those host -> device copies
    moe_tokens: int = 0  # tokens the model computed (prompt and decode; not a graphed batch's padding)
    moe_cpu_pairs: int = 0  # (token, expert) pairs computed on the CPU
    moe_prestaged_layers: int = 0  # layers a batch computed from experts staged while idle (staging.PRESTAGE)

    @property
    def kv_tokens_used(self) -> int:
        return (self.kv_blocks_total - self.kv_blocks_free) * self.block_size

    @property
    def kv_tokens_free(self) -> int:
        return self.kv_blocks_free * self.block_size

    @property
    def moe_residency(self) -> float:
        """Fraction of the routed experts resident on the GPU."""
        total = self.moe_layers * self.moe_experts
        return self.moe_resident / total if total else 1.0

    @property
    def moe_hit_rate(self) -> float:
        uses = self.moe_hits + self.moe_misses
        return self.moe_hits / uses if uses else 1.0

    @property
    def moe_bytes_pcie(self) -> int:
        """Expert bytes that crossed PCIe: copied into the GPU, and read in place by host reads."""
        return self.moe_bytes_h2d + self.moe_bytes_host_read

    @property
    def moe_bytes_per_token(self) -> float:
        return self.moe_bytes_pcie / self.moe_tokens if self.moe_tokens else 0.0

    @property
    def moe_pcie_gb_s(self) -> float:
        """Effective host -> device bandwidth of the expert copies (bytes over copy busy time)."""
        return self.moe_bytes_h2d / self.moe_copy_seconds / 1e9 if self.moe_copy_seconds else 0.0

    def derived(self) -> dict[str, float]:
        """The properties, by name (what /metrics and the logs read beside the fields)."""
        names = ("kv_tokens_used", "kv_tokens_free", "moe_residency", "moe_hit_rate")
        names += ("moe_bytes_per_token", "moe_pcie_gb_s")
        return {n: getattr(self, n) for n in names}


class LLMEngine:
    def __init__(self, cfg: EngineConfig, model_config: ModelConfig | None = None) -> None:
        self.cfg = cfg
        self.model_config = model_config_of(cfg, model_config)
        self.executor = make_executor(cfg, self.model_config)
        plan = self.executor.plan
        self.plan = plan
        max_len = cfg.model_len(self.model_config.max_position_embeddings)
        cache = RadixCache(cfg.block_size, plan.num_snapshots) if cfg.enable_prefix_cache else None
        self.scheduler = Scheduler(
            BlockAllocator(plan.num_blocks, cfg.block_size),
            SlotAllocator(plan.num_slots),
            plan.num_slots,
            plan.prefill_chunk,
            max_len,
            cache=cache,
            hybrid=plan.has_gdn,
        )
        self.eos_ids = set(self.model_config.eos_token_ids)
        # decode ahead (``step``): the batch issued ahead and its sequences, until a step collects it
        self.decodes_ahead = cfg.decode_ahead  # public: a benchmark may switch it between steps
        self._ahead: tuple[list, object] | None = None
        self._ids = itertools.count()
        self.prompt_tokens = self.generation_tokens = 0

    # ---- requests
    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        biased = [t for t, _ in params.logit_bias if t >= vocab]
        if biased:
            raise ValueError(f"logit_bias token ids {biased[:5]} are outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):  # the sampler's top n would fail the whole step
            if (n := getattr(params, name)) is not None and n > vocab:
                raise ValueError(f"{name}={n} is more than the vocabulary's {vocab} tokens")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, [int(t) for t in prompt_token_ids], params)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs.append(None)  # position 0 has no prediction
        self.scheduler.add(req)
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        self._drop_stale_ahead()
        return self._output(req) if req is not None else None

    @property
    def _prestages(self) -> bool:
        """Whether an idle engine pre-stages experts for the next prefill (``staging.PRESTAGE``)."""
        from ft.moe.backends import staging

        moe = self.plan.moe
        return staging.PRESTAGE and moe is not None and moe.backend in ("offload", "hybrid")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of the requests it advanced.

        Decode ahead (``EngineConfig.decode_ahead``): when the batch just issued lets the
        scheduler know the next one (``Scheduler.schedule_ahead``: every running request decoding,
        no waiting request admissible), that next batch is issued before this one's tokens are read, its input
        ids taken from this one's samples on the device (the other tensor-parallel ranks take
        them from the first by a broadcast). The device then never waits for the host between
        decode steps (reading the tokens, folding them in, scheduling and uploading the next
        batch). This call returns this batch's outputs; the next call starts with the batch
        already running. On an H200 (2026-12-03, batch 1, off and on alternating on one load):
        the full 80B offloaded at --memory-ratio 0.94 went 58.0 -> 59.9 tok/s, with its NVFP4
        experts resident 325.8 -> 334.1 (docs/benchmarks.md)."""
        if self._ahead is not None:
            seqs, launched = self._ahead
            self._ahead = None
        else:
            sched = self.scheduler.schedule()
            if not sched.seqs:
                if self.scheduler.waiting and not self.scheduler.running:  # nothing could ever free room
                    head = self.scheduler.waiting[0]
                    raise RuntimeError(
                        f"scheduler cannot admit request {head.request_id!r} into an idle engine "
                        f"({self.scheduler.blocks.num_free} blocks, {self.scheduler.slots.num_free} "
                        "state slots free)"
                    )
                return []
            seqs = sched.seqs
            if not self.decodes_ahead:
                return self._fold(seqs, self.executor.execute(seqs))
            launched = self.executor.launch(seqs)
        # only a step that runs without the host mid-step (``MoeRuntime.runs_unattended``) gains; none
        # once ``decodes_ahead`` is switched off, though a step issued ahead before still runs
        unattended = self.decodes_ahead and self.executor.runs_unattended(len(seqs))
        ahead = self.scheduler.schedule_ahead(seqs) if unattended else None
        if ahead is not None:
            self._ahead = (ahead, self.executor.launch(ahead, ids_from=launched))
        outputs = self._fold(seqs, self.executor.collect(launched))
        self._drop_stale_ahead()
        return outputs

    def _fold(self, seqs: list, results: list) -> list[RequestOutput]:
        """Fold a batch's results into its requests; the outputs of those still known."""
        outputs = []
        for seq, res in zip(seqs, results):
            req = self.scheduler.requests.get(seq.request_id)
            # aborted while the batch ran, or ended by the batch before (ahead); either way its id
            # may since name a new request, which starts from its own prompt
            if req is None or req.num_computed_tokens != seq.start:
                self.scheduler.discard(seq)
                continue
            req.num_computed_tokens += len(seq.token_ids)
            self.scheduler.cache_computed(req, seq)
            if seq.start < req.prompt_len:
                self.prompt_tokens += min(req.prompt_len, seq.start + len(seq.token_ids)) - seq.start
            if res.prompt_logprobs is not None:
                first = seq.start + 1
                for j, lp in enumerate(res.prompt_logprobs):
                    if first + j == len(req.prompt_logprobs):
                        req.prompt_logprobs.append(lp)
            if res.sample is not None:
                self._append(req, res.sample)
            outputs.append(self._output(req))
        return outputs

    def _drop_stale_ahead(self) -> None:
        """Wait out and forget a batch issued ahead whose requests have all ended (a stop token in
        the batch before, an abort): nothing will collect it otherwise."""
        live = self.scheduler.requests
        if self._ahead is not None and not any(s.request_id in live for s in self._ahead[0]):
            self.executor.collect(self._ahead[1])
            for seq in self._ahead[0]:  # a decode's block-filling snapshot, never to be attached
                self.scheduler.discard(seq)
            self._ahead = None

    def check_workers(self) -> None:
        """Raise ``WorkerError`` if a tensor-parallel rank has died (``MultiprocExecutor.check``)."""
        self.executor.check()

    def idle(self) -> None:
        """The caller has nothing for the engine to run now (the serving loop before it waits for
        requests, ``LLM.generate`` before it returns): an offloading engine pre-stages experts for
        the next prefill (``staging.PRESTAGE``). Not called from ``step``: the outputs of
        the step that finished the last request go out first, then the copies are issued."""
        if self._prestages and not self.has_unfinished_requests():
            self.executor.moe_idle()

    def _append(self, req: Request, sample) -> None:
        p = req.params
        if p.max_tokens == 0:
            self.scheduler.finish(req, "length")
            return
        req.output_token_ids.append(sample.token_id)
        self.generation_tokens += 1
        if sample.logprobs is not None:
            req.logprobs.append(sample.logprobs)
        n = len(req.output_token_ids)
        stop = sample.token_id in p.stop_token_ids or (not p.ignore_eos and sample.token_id in self.eos_ids)
        if stop and n >= p.min_tokens:
            self.scheduler.finish(req, "stop")
        elif n >= p.max_tokens or req.num_tokens >= self.scheduler.max_model_len:
            self.scheduler.finish(req, "length")

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def _output(self, req: Request) -> RequestOutput:
        """The request's state so far. Its lists are the request's own (no copy per step, which
        would make long generations quadratic): read them, do not change them."""
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_cached_tokens=req.num_cached_tokens,
        )

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            len(s.running),
            len(s.waiting),
            s.blocks.num_blocks,
            s.room,
            s.blocks.block_size,
            self.prompt_tokens,
            self.generation_tokens,
            s.prefix_hit_tokens,
            s.num_preemptions,
            **self._moe_stats(),
        )

    def set_moe_variant(self, policy: str | None = None, routing_skew: float | None = None) -> None:
        """Switch every rank's expert-cache policy and (dummy weights) routing skew in place; for
        ``ft bench offline``, which measures several variants on one loaded model."""
        self.executor.set_moe_variant(policy, routing_skew)
        if policy is not None and self.plan.moe is not None:
            self.plan = replace(self.plan, moe=replace(self.plan.moe, policy=policy))

    def _moe_stats(self) -> dict:
        moe = self.plan.moe
        if moe is None or not moe.layers:
            return {}
        if moe.backend == "gpu":  # nothing moves: the plan says it all, no call to the ranks
            return dict(moe_layers=moe.layers, moe_experts=moe.experts, moe_slots=moe.slots,
                        moe_resident=moe.layers * moe.experts)  # fmt: skip
        if not self.has_unfinished_requests():  # idle: count the step host reads deferred
            self.executor.flush_moe()
        return self.executor.moe_stats()

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
