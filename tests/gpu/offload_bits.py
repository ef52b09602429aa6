"""Does an offloaded model's output depend on what its expert cache holds? (not run by CI)

    python tests/gpu/offload_bits.py

On the 80B with NVFP4 experts under 48 GiB (2026-12-06, an H100) two rows of the same settings,
one after the other from one load, parted within their first greedy tokens: their cache states
differed. The offload paths claim the resident arithmetic: decode reads each expert's rows where
they lie (a slot, the host store, the staging block) into the same kernels, and a streamed
prefill writes each (token, k) term and sums them in k order. Here, on the tests' tiny models
(bf16, and NVFP4 experts), every path against the resident backend: the largest difference of the
prompt's log-probs, of the decode's, and whether the greedy tokens agree, at top-2 and top-4 (two
terms sum alike in either order), the cache at a quarter of the experts, host reads on and off,
and the same offloaded engine's second pass over the prompts (its cache warmed by the first). 0.0
everywhere is what the design says; a row that is not names the path whose sums follow the cache.
2026-12-06 (an H100, after 3053d11): 0.0 and the same tokens in every row.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ft import LLM  # noqa: E402
from ft.moe.backends import host_reads  # noqa: E402
from tests.checkpoints import write_checkpoint  # noqa: E402
from tests.nvfp4.modelopt_ckpt import write_nvfp4_checkpoint  # noqa: E402
from tests.offload.test_offload_gpu import PARAMS, PROMPTS, max_logprob_diff  # noqa: E402


def passes(path: Path, n: int, **options) -> list:
    """The prompts ``n`` times through one engine -> each pass's outputs."""
    with LLM(model=str(path), progress=False, device="cuda", dtype="bfloat16", **options) as llm:
        return [llm.generate(PROMPTS, PARAMS) for _ in range(n)]


def row(label: str, got, want) -> None:
    same = [o.token_ids for o in got] == [o.token_ids for o in want]
    prompt, both = max_logprob_diff(got, want, decode=False), max_logprob_diff(got, want)
    print(f"{label:58} prompt {prompt:9.2e}  with decode {both:9.2e}  tokens {'same' if same else 'DIFFER'}")


def main() -> None:
    root = Path(tempfile.mkdtemp())
    for k in (2, 4):  # two terms sum alike in any order; four need the order kept
        bf16, nvfp4 = root / f"bf16_{k}", root / f"q{k}"
        write_checkpoint(bf16, "qwen3_next", seed=31, weight_scale=0.8, num_experts_per_tok=k)
        write_nvfp4_checkpoint(nvfp4, "qwen3_next", seed=8, moe_intermediate_size=64, num_experts_per_tok=k)
        for fmt, path in ((f"bf16, top-{k}", bf16), (f"nvfp4, top-{k}", nvfp4 / "nvfp4")):
            (want,) = passes(path, 1, moe_backend="gpu")
            for reads in (True, False):
                host_reads.ENABLED = reads
                for fraction in (0.25,):
                    first, second = passes(path, 2, moe_backend="offload", expert_cache_fraction=fraction)
                    tag = f"{fmt}, host reads {'on ' if reads else 'off'}, cache {fraction:.2f}"
                    row(f"{tag}, pass 1", first, want)
                    row(f"{tag}, pass 2", second, want)
            host_reads.ENABLED = True


if __name__ == "__main__":
    main()
