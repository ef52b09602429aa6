"""What ``ft bench offline`` measured (``Report``, a ``Row`` per batch size) and how it is printed
(``format_report``) or saved as JSON (``as_dict``). The measuring is ``ft.bench.offline``'s."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from ft import switches as kernel_switches
from ft.bench.census import format_census


@dataclass
class Row:
    batch: int
    aggregate_tok_s: float
    decode_tok_s: float
    roofline_tok_s: float
    step_gb: float
    wall_s: float
    moe_hit_rate: float | None = None  # decode steps only
    moe_mb_per_token: float | None = None  # expert MB over PCIe (copied, read in place) per generated token
    pcie_floor_tok_s: float | None = None
    moe_prefetched_per_token: float | None = None  # experts prefetched (all layers) per token
    moe_prefetch_used: float | None = None  # of those, the share its layer then read

    @property
    def ratio(self) -> float:
        return self.decode_tok_s / self.roofline_tok_s if self.roofline_tok_s else 0.0


@dataclass
class Report:
    model: str
    device: str
    hbm_gb_s: float
    matmul_tflops: float = 0.0  # the dense matmul rate measured on the device (bf16 on a GPU)
    rows: list[Row] = field(default_factory=list)
    single_stream_tok_s: float = 0.0
    ttft_ms: float = 0.0
    ttft_input_len: int = 0  # the TTFT prompt's length
    ttft_runs_ms: list[float] = field(default_factory=list)  # the five runs the median is of, in order
    ttft_idle_s: float = 0.0  # the engine idle this long before each TTFT run (``--ttft-idle-s``)
    idle_hook_ms: list[tuple[float, float]] = field(default_factory=list)  # engine.idle(): host, copies after
    ttft_prestaged_layers: list[int] = field(default_factory=list)  # layers each TTFT run found pre-staged
    prefill: dict[int, float] = field(default_factory=dict)
    # prompt length (the TTFT's and each prefill's) -> its FLOPs over ``matmul_tflops``, in seconds
    compute_floor_s: dict[int, float] = field(default_factory=dict)
    prefill_streamed: dict[int, float] = field(default_factory=dict)  # offload: expert bytes a prefill moved
    # --prefill-runs > 1: every run's (tok/s, bytes streamed) in order; prefill / prefill_streamed
    # then hold the middle run's (by rate; the upper middle of an even count)
    prefill_runs: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    hf: dict[str, float] = field(default_factory=dict)
    moe: dict = field(default_factory=dict)  # backend, residency, policy, ... and h2d_gb_s measured
    census: list = field(default_factory=list)  # ft.bench.census.Census rows, with --census
    switches: dict = field(default_factory=dict)  # kernel switch -> value this run had (ft.switches)
    memory: dict = field(default_factory=dict)  # CUDA: the device's peak against the plan (``device_peak``)


def format_report(r: Report) -> str:
    lines = [
        f"model {r.model} on {r.device}; measured memory bandwidth {r.hbm_gb_s:,.0f} GB/s, "
        f"dense matmul {r.matmul_tflops:,.1f} TFLOP/s",
        *([kernel_switches.describe(r.switches)] if r.switches else []),
        f"single-stream decode: {r.single_stream_tok_s:,.1f} tok/s   TTFT: {r.ttft_ms:,.1f} ms"
        + (f" (runs {', '.join(f'{t:,.1f}' for t in r.ttft_runs_ms)})" if r.ttft_runs_ms else "")
        + (f", each after {r.ttft_idle_s:g} s idle" if r.ttft_idle_s else "")
        + _floor(r, r.ttft_input_len, r.ttft_ms / 1e3),
    ]
    if any(r.ttft_prestaged_layers) and r.idle_hook_ms:  # staging.PRESTAGE: what each idle spell staged
        host, copies = (statistics.median(v) for v in zip(*r.idle_hook_ms))
        lines.append(
            f"pre-staged while idle: {', '.join(map(str, r.ttft_prestaged_layers))} layers a TTFT run; "
            f"engine.idle() {host:,.1f} ms of host time, its copies landed {copies:,.1f} ms later (medians)"
        )
    for length, rate in r.prefill.items():
        streamed = r.prefill_streamed.get(length)
        link = ""
        if streamed:  # bytes over PCIe in the prefill's wall time, against the measured copy rate
            gb_s = streamed / (length / rate) / 1e9
            share = f" ({gb_s / r.moe['h2d_gb_s']:.0%} of the link)" if r.moe.get("h2d_gb_s") else ""
            size = f"{streamed / 1e9:,.2f} GB" if streamed >= 1e8 else f"{streamed / 1e6:,.3f} MB"
            link = f"; streamed {size} at {gb_s:,.1f} GB/s{share}"
        runs = r.prefill_runs.get(length)
        if runs:  # every run's rate (and share of the link), the middle one reported above
            link += f"; runs {' / '.join(f'{tok_s:,.0f}' for tok_s, _ in runs)} tok/s"
            if streamed and r.moe.get("h2d_gb_s"):
                shares = (b / (length / tok_s) / 1e9 / r.moe["h2d_gb_s"] for tok_s, b in runs)
                link += f" ({' / '.join(f'{s:.1%}' for s in shares)} of the link)"
        first = length / rate  # the prompt's wall time to its one token: its time to first token
        lines.append(
            f"prefill {length} tokens: {rate:,.0f} tok/s, first token in {first:,.2f} s"
            + _floor(r, length, first)
            + link
        )
    lines.append(
        f"{'batch':>6} {'aggregate tok/s':>16} {'decode tok/s':>13} {'roofline tok/s':>15} "
        f"{'achieved/roof':>14} {'GB/step':>8}"
    )
    for row in r.rows:
        lines.append(
            f"{row.batch:>6} {row.aggregate_tok_s:>16,.1f} {row.decode_tok_s:>13,.1f} "
            f"{row.roofline_tok_s:>15,.1f} {row.ratio:>13.0%} {row.step_gb:>8.2f}"
        )
    if r.moe:
        m = r.moe
        prefetch = "on" if m["prefetch"] else "off"
        lines.append(
            f"moe {m['backend']}: {m['slots_per_layer']}/{m['experts_per_layer']} experts resident per "
            f"layer ({m['residency']:.0%}), policy {m['policy']}, prefetch {prefetch}, "
            f"routing skew {m['routing_skew']}"
            + (f"; pinned host->device {m['h2d_gb_s']:,.1f} GB/s" if "h2d_gb_s" in m else "")
        )
        for row in r.rows:
            if row.moe_hit_rate is None:
                continue
            floor = (
                f", PCIe floor {row.pcie_floor_tok_s:,.1f} tok/s "
                f"(achieved {row.decode_tok_s / row.pcie_floor_tok_s:.0%})"
                if row.pcie_floor_tok_s
                else ""
            )
            prefetch = (
                f", {row.moe_prefetched_per_token:,.1f} experts prefetched per token "
                f"({row.moe_prefetch_used:.0%} used)"
                if row.moe_prefetched_per_token
                else ""
            )
            lines.append(
                f"{row.batch:>6}  decode hit rate {row.moe_hit_rate:.1%}, "
                f"{row.moe_mb_per_token:,.2f} MB over PCIe per token{floor}{prefetch}"
            )
    if r.memory:
        m = r.memory
        lines.append(
            f"device memory: peak {m['peak_gib']:,.2f} GiB (live tensors {m['peak_allocated_gib']:,.2f}) "
            f"of the {m['plan_gib']:,.2f} GiB planned "
            f"(cap x --memory-ratio), {m['reserve_gib']:,.2f} GiB of it kept for activations; "
            f"prefill chunk {m['prefill_chunk']}"
        )
    for k, v in r.hf.items():
        lines.append(f"transformers {k}: {v:,.1f}")
    return "\n".join(lines + format_census(r.census))


def _floor(r: Report, length: int, seconds: float) -> str:
    """``seconds`` for a prompt of ``length`` beside its compute floor, if known."""
    floor = r.compute_floor_s.get(length)
    if not floor or not seconds:
        return ""
    shown = f"{1e3 * floor:,.1f} ms" if floor >= 1e-3 else f"{1e6 * floor:,.1f} us"
    return f" (compute floor {shown}: {floor / seconds:.1%})"


def as_dict(r: Report) -> dict:
    d = asdict(r)
    for row, src in zip(d["rows"], r.rows):
        row["ratio"] = src.ratio
    return d
