"""Release-size VoxCPMModel skeletons (meta device, no memory) have the published main-model parameter counts."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model.voxcpm import VoxCPMModel
from engine.model_configs import voxcpm05b, voxcpm2, voxcpm15


@pytest.mark.parametrize(("make", "millions"), [(voxcpm2, 2290.0), (voxcpm15, 801.7), (voxcpm05b, 652.3)])
def test_release_parameter_counts(make, millions: float) -> None:
    with torch.device("meta"):
        model = VoxCPMModel(ModelConfig.from_dict(make()))
    count = sum(p.numel() for p in model.parameters())
    assert round(count / 1e6, 1) == millions
