"""What the profiling scripts beside this file share (not a test): a log that prints and appends
to a file, and a model config cut to its first layers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def logger(out: str | None) -> Callable[[str], None]:
    """Print a line, and append it to ``out`` when given (a run cut short keeps what it said)."""

    def log(line: str) -> None:
        print(line, flush=True)
        if out:
            with Path(out).open("a") as f:
                print(line, file=f)

    return log


def cut_config(src: str, layers: int) -> tuple[str, dict]:
    """The config.json at ``src`` with its first ``layers`` layers, written to /tmp: (path, config)."""
    cfg = json.loads(Path(src).read_text()) | {"num_hidden_layers": layers}
    path = f"/tmp/ft_cut_{layers}.json"
    Path(path).write_text(json.dumps(cfg))
    return path, cfg
