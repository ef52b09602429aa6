"""The kernel switch table (``ft.switches``) stays in step with the modules it names, and ``ft bench``
reports what a run had on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ft import switches


def test_every_switch_names_its_module_attribute_and_environment_variable():
    """Read as text (the GPU kernels' modules need triton to import): each module exists, assigns
    the attribute at top level, and reads the environment variable the table gives."""
    for module, attr, env in switches.SWITCHES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, module
        source = Path(spec.origin).read_text()
        assert f"\n{attr} = " in source, f"{module} assigns no {attr}"
        assert f'"{env}"' in source, f"{module} does not read {env}"


def test_current_values_and_their_line():
    values = switches.current()
    assert values["ft.distributed:SYMM_ALL_REDUCE"] is False  # importable everywhere, off by default
    assert all(isinstance(v, int) for v in values.values())  # booleans, and integer switches
    assert (
        values["ft.moe.backends.host_prefetch:ROWS"] == 0
        and type(values["ft.moe.backends.host_prefetch:ROWS"]) is int
    )
    assert switches.describe({"ft.layers.pdl:EARLY": True, "ft.distributed:SYMM_ALL_REDUCE": False}) == (
        "kernel switches on: pdl.EARLY"
    )
    assert switches.describe({"ft.layers.pdl:EARLY": True, "ft.moe.backends.host_prefetch:ROWS": 3}) == (
        "kernel switches on: pdl.EARLY, host_prefetch.ROWS=3"
    )
    assert switches.describe({}) == "kernel switches on: none"
