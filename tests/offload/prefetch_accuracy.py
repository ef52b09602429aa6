"""How well the next layer's router on this layer's MoE input predicts the next layer's experts,
on a model with generated weights (not a test; CPU or GPU):

    python tests/offload/prefetch_accuracy.py CONFIG [LAYERS] [SKEWS] [--device=cuda]

CONFIG's dimensions (hidden size, experts, top-k: what routing depends on), cut to LAYERS layers
(default 8) and with the experts made narrow (moe_intermediate_size 16, so that a CPU holds
them); dummy weights as ``ft bench`` generates them, for each routing skew of SKEWS (default
"0,1"). A 64-token random prompt, then 16 greedy decode steps; at every MoE layer l > 0 of every
decode step, the share of the layer's top-k experts that layer l - 1's input through layer l's
router also picks (what host reads' prefetch and the copying path's prefetch bet on), and the
share the prediction's first choices would cover with N picks (its top N vs the layer's top-k).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from ft.config import EngineConfig  # noqa: E402
from ft.engine.engine import LLMEngine  # noqa: E402
from ft.moe.backends.runtime import moe_blocks  # noqa: E402
from ft.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    src, layers = args[0], int(args[1]) if len(args) > 1 else 8
    skews = [float(s) for s in (args[2] if len(args) > 2 else "0,1").split(",")]
    device = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--device=")), "cpu")
    with open(src) as f:
        cfg = json.load(f) | {"num_hidden_layers": layers}
    cfg |= {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}
    path = os.path.join(tempfile.mkdtemp(), "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    k = cfg["num_experts_per_tok"]
    for skew in skews:
        engine = LLMEngine(EngineConfig(
            config_file=path, load_format="dummy", device=device, dtype="float32", num_tokens=4096,
            max_model_len=256, progress=False, dummy_routing_skew=skew, enable_prefix_cache=False,
        ))  # fmt: skip
        model = engine.executor.runner.model
        blocks = moe_blocks(model)
        layers_ = model.model.layers
        seen: list[tuple] = []  # per layer: (MoE input, its top-k ids, the layer's (x, residual) out)

        def record(block, inputs, _output, seen=seen):
            x = inputs[0]
            seen.append([x.detach(), block.gate(x)[1].detach(), None])

        def record_layer(_layer, _inputs, output, seen=seen):
            seen[-1][2] = tuple(t.detach() for t in output)

        hooks = [b.register_forward_hook(record) for b in blocks]
        hooks += [layer.register_forward_hook(record_layer) for layer in layers_]
        prompt = [(i * 7919 + 13) % cfg["vocab_size"] for i in range(64)]
        engine.add_request(prompt, SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
        steps = []
        while engine.has_unfinished_requests():
            seen.clear()
            engine.step()
            steps.append(list(seen))
        for h in hooks:
            h.remove()
        hit = {(how, n): [0, 0] for how in ("moe input", "layer output") for n in (k, 4, 2)}
        for step in steps[1:]:  # decode steps (the first is the prompt)
            if len(step) != len(blocks) or len(step[0][0]) != 1:
                continue
            for layer in range(1, len(blocks)):
                actual = set(step[layer][1][0].tolist())
                x, residual = step[layer - 1][2]  # layer l - 1's output, not yet added
                after = layers_[layer].post_attention_layernorm(x, residual)[0]  # without layer l's mixer
                for how, inp in (("moe input", step[layer - 1][0]), ("layer output", after)):
                    pred = blocks[layer].gate(inp)[1][0]  # by falling weight
                    for n in (k, 4, 2):
                        hit[how, n][0] += len(actual & set(pred[:n].tolist()))
                        hit[how, n][1] += min(n, k)
        for how in ("moe input", "layer output"):
            shares = ", ".join(f"top {n}: {hit[how, n][0] / max(1, hit[how, n][1]):.0%}" for n in (k, 4, 2))
            print(f"skew {skew}: {cfg['num_experts']} experts, top-{k}, {len(blocks)} MoE layers; the next "
                  f"router on the {how}: predicted picks the next layer uses — {shares}")  # fmt: skip
        engine.shutdown()


if __name__ == "__main__":
    main()
