"""A checkpoint's recommended sampling settings (its ``generation_config.json``) as the defaults
of requests that leave them out, as vLLM does with ``--generation-config auto`` (its default): an
instruct model's card asks for e.g. temperature 0.7, top_p 0.8, top_k 20, and a client that sends
only messages then gets those rather than plain sampling at temperature 1.

Read: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and
``max_new_tokens`` as ``max_tokens``. Not read: ``do_sample`` (vLLM does not read it either: a
file with ``do_sample: false`` and a temperature samples at that temperature), nor anything else.
A value a request gives (``SamplingParams`` passed to ``LLM.generate``, a field in a server
request) always wins.
"""

from __future__ import annotations

import json
import os

from ft.sampling_params import SamplingParams

FILE = "generation_config.json"
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
INTEGERS = ("top_k", "max_tokens")


def sampling_defaults(source: str, model: str | None) -> dict[str, float | int]:
    """The ``SamplingParams`` fields ``source`` sets: "auto" the model directory's file (none
    there: nothing), "none" nothing, else a directory that must hold one."""
    if source == "none":
        return {}
    folder = model if source == "auto" else source
    path = os.path.join(folder, FILE) if folder else None
    if path is None or not os.path.isfile(path):
        if source == "auto":
            return {}
        raise ValueError(f"--generation-config {source!r}: no {FILE} there")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    out: dict[str, float | int] = {}
    for key, name in KEYS.items():
        value = raw.get(key) if isinstance(raw, dict) else None
        if value is None:
            continue
        kind = int if name in INTEGERS else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind):
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{path}: {key} = {value!r} is not {what}")
        out[name] = value
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return out


def describe(defaults: dict[str, float | int]) -> str:
    """The start-up line: ``sampling defaults from generation_config.json: temperature=0.7 ...``."""
    return f"sampling defaults from {FILE}: " + " ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
