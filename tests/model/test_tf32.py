"""`precision.tf32`: TF32 matmuls on CUDA as the setting says, nothing changed on a CPU (no GPU here: the
flags are process-wide settings that a CPU build holds too, so what a CUDA run would set is visible)."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.model.precision import use_tf32


@pytest.fixture
def restore_flags():
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


def test_tf32_follows_the_setting_on_cuda_only(restore_flags):
    assert TrainConfig().precision.tf32 is True
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    use_tf32(torch.device("cpu"), True)
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before
    use_tf32(torch.device("cuda", 0), True)
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("high", True)
    use_tf32(torch.device("cuda", 0), False)
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("highest", False)
