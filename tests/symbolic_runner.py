"""An executor for ``LLMEngine`` with no model: every KV slot and GDN state row holds the hash of
the token prefix it stands for, and every read is checked against the request's own tokens.

A step's sequence must find, before its first token, each earlier position's KV slot (through
the block table the ranks keep, ``ft.engine.block_tables``) holding that position's prefix, and
on a hybrid model its state slot holding the prefix before the chunk (after any snapshot restore);
its snapshot row gets the prefix at its snapshot point. A sampled token and its log-prob are
functions of the prefix alone, so a wrong block, slot, snapshot or restore fails at the step it
happens, and outputs must equal those of the request run alone exactly. The engine, scheduler
and prefix cache are the real ones; ``engine`` swaps this in for the ranks.
"""

from __future__ import annotations

from ft.config import EngineConfig
from ft.engine.block_tables import BlockTables
from ft.engine.model_runner import SeqResult
from ft.engine.pools import PoolPlan
from ft.layers.sampler import SampleResult
from ft.scheduler.step import HISTORY, PENDING_TOKEN


def prefix(tokens: list[int], n: int) -> int:
    return hash(tuple(tokens[:n]))


class SymbolicExecutor:
    def __init__(self, cfg: EngineConfig, hybrid: bool, vocab: int) -> None:
        bs, running = cfg.block_size, cfg.max_running_requests or 8
        snapshots = (cfg.prefix_snapshot_slots or running) if hybrid and cfg.enable_prefix_cache else 0
        blocks = cfg.num_tokens // bs
        chunk = cfg.max_num_batched_tokens or 8192
        self.plan = PoolPlan(blocks, running, 0, 0, 0, snapshots, hybrid, None, chunk)
        self.bs, self.hybrid, self.vocab = bs, hybrid, vocab
        self.tables = BlockTables(running + 1, blocks, bs)
        self.snapshot_base = running + 1
        self.kv: dict[int, int] = {}  # KV slot -> the prefix its token ends
        self.rows: dict[int, int] = {}  # GDN state row -> the prefix it holds
        self.requests: dict = {}  # the scheduler's, once the engine exists

    def runs_unattended(self, tokens: int) -> bool:
        return True  # so the engine decodes ahead where it can

    def execute(self, seqs):
        return self.collect(self.launch(seqs))

    def launch(self, seqs, ids_from=None) -> list[SeqResult]:
        self.tables.update(seqs)
        for s in seqs:
            if s.restore_from is not None:
                self.rows[s.state_slot] = self.rows[self.snapshot_base + s.restore_from]
        if ids_from is not None:
            assert [r.request_id for r in ids_from] == [s.request_id for s in seqs]
        return [self._run(s, ids_from[i].sample.token_id if ids_from else None) for i, s in enumerate(seqs)]

    def _run(self, s, pending: int | None) -> SeqResult:
        tokens = self.requests[s.request_id].all_token_ids
        if pending is not None:
            assert s.token_ids == [PENDING_TOKEN]
            tokens = tokens + [pending]
        start, end = s.start, s.start + len(s.token_ids)
        assert pending is not None or s.token_ids == tokens[start:end], f"{s.request_id}: tokens"
        assert s.history == tokens[max(0, start - HISTORY) : start], f"{s.request_id}: history"
        row = self.tables.rows[s.state_slot]
        for q in range(end):
            slot = int(row[q // self.bs]) * self.bs + q % self.bs
            assert row[q // self.bs] >= 0, f"{s.request_id}: no block for position {q}"
            if q < start:
                assert self.kv.get(slot) == prefix(tokens, q + 1), f"{s.request_id}: KV at {q} (from {start})"
            else:
                self.kv[slot] = prefix(tokens, q + 1)
        if self.hybrid:
            if start > 0:
                assert self.rows.get(s.state_slot) == prefix(tokens, start), (
                    f"{s.request_id}: state at {start}"
                )
            if s.snapshot_to is not None:
                assert 0 < s.snapshot_len <= len(s.token_ids)
                self.rows[self.snapshot_base + s.snapshot_to] = prefix(tokens, start + s.snapshot_len)
            self.rows[s.state_slot] = prefix(tokens, end)
        else:
            assert s.snapshot_to is None, "a snapshot on a model without GDN layers"
        sample = None
        if s.sample:
            h = prefix(tokens, end)
            token = h % (self.vocab - 1) + 1
            sample = SampleResult(
                token, {token: -(h % 1000) / 100} if s.params.logprobs is not None else None
            )
        plp = None
        if s.prompt_targets:
            assert s.prompt_targets == tokens[start + 1 : start + 1 + len(s.prompt_targets)]
            plp = [{t: -(prefix(tokens, start + j + 1) % 997) / 10} for j, t in enumerate(s.prompt_targets)]
        return SeqResult(s.request_id, sample, plp)

    def collect(self, launched: list[SeqResult]) -> list[SeqResult]:
        return launched

    def shutdown(self) -> None:
        pass


def engine(monkeypatch, model: str, hybrid: bool, **options):
    """An ``LLMEngine`` over a ``SymbolicExecutor``, with the config of checkpoint ``model`` (no
    weights read) and ``options``, ``EngineConfig``'s (a pool size, ``num_tokens``, is required)."""
    import ft.engine.engine as engine_module

    cfg = EngineConfig(model=model, device="cpu", dtype="float32", progress=False, **options)
    monkeypatch.setattr(
        engine_module, "make_executor", lambda c, m: SymbolicExecutor(c, hybrid, m.vocab_size)
    )
    eng = engine_module.LLMEngine(cfg)
    eng.executor.requests = eng.scheduler.requests
    return eng


def alone(monkeypatch, model: str, hybrid: bool, block_size: int):
    """The oracle engine of the fuzz tests: one request at a time, no prefix cache, no decode
    ahead, room for any workload's request."""
    return engine(
        monkeypatch, model, hybrid, block_size=block_size, num_tokens=1024, max_running_requests=1,
        enable_prefix_cache=False, decode_ahead=False,
    )  # fmt: skip


def random_options(rng, block_size: int, need: int) -> dict:
    """Engine options a fuzz case draws: a pool of ``need`` tokens and a little more (down to
    preemption), chunks that split blocks or hold several, the prefix cache on or off with one
    to 16 snapshot slots, few running requests, decode ahead on or off."""
    return dict(
        block_size=block_size,
        num_tokens=need + block_size * rng.choice([0, 0, 1, 3, 50]),
        max_num_batched_tokens=rng.choice([1, 2, 3, 5, 7, 16, 64]),
        enable_prefix_cache=rng.random() < 0.85,
        prefix_snapshot_slots=rng.choice([1, 2, 16]),
        max_running_requests=rng.choice([1, 2, 3, 8]),
        decode_ahead=rng.random() < 0.5,
    )
