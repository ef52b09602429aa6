"""tests/gpu/decode_variants.py's rows: each row runs with its own switch values (CPU)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.gpu.decode_variants import set_row


def test_a_row_runs_its_own_value_when_specs_share_a_switch():
    mod, other = SimpleNamespace(ROWS=4), SimpleNamespace(ON=False)
    switches = [(mod, "ROWS", 0), (mod, "ROWS", 2), (other, "ON", True)]
    defaults = [4, 4, False]
    seen = []
    for on in ([], [0], [1], [2], range(3)):
        set_row(switches, defaults, on)
        seen.append((mod.ROWS, other.ON))
    # defaults; ROWS=0 alone (the spec after it no longer restores 4 over it); ROWS=2; ON alone;
    # all of them: each switch the last value given
    assert seen == [(4, False), (0, False), (2, False), (4, True), (2, True)]


def test_prefill_only_switches_are_switches_and_left_out_of_the_default_rows():
    """``PREFILL_ONLY`` names switches of ``ft.switches`` (a renamed one would silently run again in
    the default rows), and none of them is among the switches the default rows turn on."""
    from ft import switches
    from tests.gpu.decode_variants import PREFILL_ONLY, switches_off

    table = {f"{module}:{attr}" for module, attr, _ in switches.SWITCHES}
    assert set(PREFILL_ONLY) <= table
    assert not set(PREFILL_ONLY) & set(switches_off())
