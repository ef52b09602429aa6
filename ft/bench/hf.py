"""transformers' ``generate`` timed on the same config and device as ``ft bench offline``'s rows
(``--compare-hf``): random weights, batch 1, the time to the first new token and the decode rate
after it, both read off one call's token stream. Not a transformers tuning: its default cache
and attention, as a user would call it.
"""

from __future__ import annotations

import time

import torch

from ft.config import EngineConfig


def bench_hf(cfg: EngineConfig, input_len: int, output_len: int) -> dict[str, float]:
    """transformers' ``generate`` on the same config and device (random weights), batch 1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ft.models.config_json import load_raw_config

    raw = {k: v for k, v in load_raw_config(cfg.model_path).items() if v is not None}
    hf_config = AutoConfig.for_model(**raw)
    device = cfg.resolved_device
    dtype = cfg.torch_dtype(str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    ids = torch.randint(hf_config.vocab_size, (1, input_len), device=device)

    def timed() -> tuple[float, float]:
        """(time to the first new token, time from it to the last) of one generate call, both
        read off the token stream of that one call: a tiny model's few steps are smaller than a
        busy host's noise between two calls (a 2-core machine timed a 4-token call shorter than
        a 1-token one, a negative decode rate)."""
        stamps = TokenTimes(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                max_new_tokens=output_len + 1,
                min_new_tokens=output_len + 1,
                do_sample=False,
                streamer=stamps,
            )
        first, last = stamps.times[1], stamps.times[-1]  # times[0]: generate hands over the prompt
        return first - t0, last - first

    timed()  # warm-up
    ttft, decode = (sorted(runs)[1] for runs in zip(*(timed() for _ in range(3))))  # the middle of three
    return {"single_stream_tok_s": output_len / decode, "ttft_ms": 1e3 * ttft}


class TokenTimes:
    """A ``generate`` streamer that notes when each batch of tokens reaches it (the prompt first)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def put(self, value: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
