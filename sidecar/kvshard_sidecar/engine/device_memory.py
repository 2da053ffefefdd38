"""Does the blend engine's copy of the weights fit on the card beside vLLM? Checked before loading.

On a GPU node the sidecar's blend engine holds its own copy of the weights next to vLLM's, which by
default takes 85 % of the card for weights and KV cache. An 8 B model in bfloat16 is ~16 GB: on an
80 GB card vLLM leaves 12 GB, so loading the second copy would die in a CUDA out-of-memory error
half-way through startup, with nothing in the log about why. This module refuses first, with the
numbers: what is free, what the weights and the working margin need, and what to change.

The decision (:func:`check`) is a pure function of the free bytes and the needed bytes, so it is
tested on any machine; :func:`free_device_memory` is the thin ``torch.cuda`` adapter around it.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
ACTIVATION_MARGIN = 0.10
"""Working memory beyond the weights (activations of one blend pass, allocator slack), as a share of
the weights; a floor of :data:`MIN_MARGIN_BYTES` applies for small models."""
MIN_MARGIN_BYTES = 512 << 20


class DeviceMemoryError(RuntimeError):
    """The blend engine's weights would not fit in the device's free memory."""


@dataclass(frozen=True)
class Need:
    weights: int
    margin: int

    @property
    def total(self) -> int:
        return self.weights + self.margin


def need_for(weight_bytes: int) -> Need:
    """Bytes the blend engine needs on the device for ``weight_bytes`` of parameters."""
    if weight_bytes < 0:
        raise ValueError("weight_bytes must be >= 0")
    return Need(weight_bytes, max(MIN_MARGIN_BYTES, int(weight_bytes * ACTIVATION_MARGIN)))


def check(free: int, total: int, need: Need, *, device: str = "the device") -> None:
    """Raise :class:`DeviceMemoryError` naming the numbers unless ``need`` fits in ``free``."""
    if need.total <= free:
        return
    used = total - free
    raise DeviceMemoryError(
        f"the blend engine needs {need.total / GIB:.1f} GiB on {device} ({need.weights / GIB:.1f} GiB of weights "
        f"+ {need.margin / GIB:.1f} GiB working margin) but only {free / GIB:.1f} GiB of {total / GIB:.1f} GiB "
        f"is free ({used / GIB:.1f} GiB in use, e.g. by vLLM at its --gpu-memory-utilization share). Lower "
        f"engine.vllm.gpuMemoryUtilization to at most {max(0.0, (total - need.total) / total):.2f}, or run the "
        f"blend engine on another device or on the CPU")


def weight_bytes(model: object) -> int:
    """Bytes of a torch module's parameters and buffers."""
    import torch

    assert isinstance(model, torch.nn.Module)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def free_device_memory(device: str) -> tuple[int, int] | None:
    """``(free, total)`` bytes of a CUDA device, None for other devices (the CPU has no such budget)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(dev)
    return int(free), int(total)
