"""The sidecar refuses to load the blend engine's weights onto a card without room, naming the numbers
(the decision is a pure function of free and needed bytes; the torch.cuda adapter is one call)."""

from __future__ import annotations

import pytest
import torch

from kvshard_sidecar.engine import device_memory as dm

GIB = dm.GIB


def test_an_8b_second_copy_does_not_fit_beside_vllm_at_85_percent_of_an_80gb_card() -> None:
    total = 80 * GIB
    free = total - int(0.85 * total)  # what vLLM leaves at --gpu-memory-utilization 0.85
    need = dm.need_for(8_030_000_000 * 2)  # Llama-3.1-8B in bfloat16
    with pytest.raises(dm.DeviceMemoryError) as err:
        dm.check(free, total, need, device="cuda:0")
    message = str(err.value)
    assert "16.5 GiB on cuda:0" in message and "15.0 GiB of weights" in message
    assert "only 12.0 GiB of 80.0 GiB is free" in message and "at most 0.79" in message
    dm.check(free, total, dm.need_for(270_000_000))  # SmolLM2-135M fits


def test_the_margin_has_a_floor_and_grows_with_the_weights() -> None:
    assert dm.need_for(0).total == dm.MIN_MARGIN_BYTES
    assert dm.need_for(20 * GIB).margin == 2 * GIB
    dm.check(dm.need_for(GIB).total, 4 * GIB, dm.need_for(GIB))  # exactly enough is enough
    with pytest.raises(dm.DeviceMemoryError):
        dm.check(dm.need_for(GIB).total - 1, 4 * GIB, dm.need_for(GIB))
    with pytest.raises(ValueError):
        dm.need_for(-1)


def test_weight_bytes_count_parameters_and_buffers_and_the_cpu_has_no_budget() -> None:
    layer = torch.nn.BatchNorm1d(10).to(torch.float16)  # 20 parameters + 21 buffer values
    assert dm.weight_bytes(layer) == 20 * 2 + 20 * 2 + 8
    assert dm.free_device_memory("cpu") is None
