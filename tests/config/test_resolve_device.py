"""`resolve_device`: every device string a user can pass is a torch device or one ConfigError naming the field
(the CLI turns a ConfigError into one line, exit 2), never torch's own traceback."""

from __future__ import annotations

import pytest
import torch

from metainfer.config import ConfigError
from metainfer.config.engine_config import resolve_device


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", ""])
def test_an_unknown_device_is_a_config_error_naming_the_field(device):
    with pytest.raises(ConfigError, match="device must be auto, cpu, cuda or mlx"):
        resolve_device(device)


def test_cpu_and_auto_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
