"""Engine options: a bad value is refused with an error naming the option, before a model loads."""

from __future__ import annotations

import pytest

from ft.config import EngineConfig

DUMMY = dict(config_file="config.json", load_format="dummy")


@pytest.mark.parametrize("length", [0, -8])
def test_max_model_len_below_one_is_refused(length):
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(**DUMMY, max_model_len=length)


def test_routing_skew_needs_dummy_weights(tmp_path):
    with pytest.raises(ValueError, match="dummy_routing_skew.*load_format='dummy'"):
        EngineConfig(model=str(tmp_path), dummy_routing_skew=1.0)
    assert EngineConfig(**DUMMY, dummy_routing_skew=1.0).dummy_routing_skew == 1.0


@pytest.mark.parametrize("name", ["max_gpu_memory", "max_host_memory"])
@pytest.mark.parametrize("size", ["garbage", "48XB", "-1GiB"])
def test_unreadable_size_names_the_option(name, size):
    with pytest.raises(ValueError, match=rf"EngineConfig\.{name}={size!r}: expected a number"):
        EngineConfig(**DUMMY, **{name: size})
