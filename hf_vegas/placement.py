"""Models whose layers sit on several devices (accelerate's `device_map`, e.g. `from_pretrained(...,
device_map="auto")` over several GPUs).

The generate loop keeps its row state, the step plan and the selection on the device of the prompt (the model's
first device). A layer on another device reads its own copy of them (`VegasCache` keeps one `StepPlan` and one
`SelectionState` per other device: each copy follows the prompt device's at the first of its layers a forward
reaches), and its kernels launch on it (`device_guard`). A generation with any layer away from the prompt's device
runs its steps eagerly (a CUDA graph is captured on one device) and with the model's own projections.
"""

from __future__ import annotations

import contextlib

import torch


def layer_devices(model) -> list[torch.device] | None:
    """Each decoder layer's device, for a model that accelerate placed on several devices (`hf_device_map` naming
    more than one); None for a model on one device (tensor parallelism included: each rank holds its shards on its
    own device)."""
    placed = {str(where) for where in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(placed) < 2:
        return None
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    devices: list[torch.device | None] = [None] * num_layers
    for module in model.modules():  # attention modules (and some decoder layers) carry their layer's index
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and 0 <= index < num_layers and devices[index] is None:
            weight = next(module.parameters(), None)
            if weight is not None:
                devices[index] = weight.device
    return [device if device is not None else model.device for device in devices]


def spread_reason(devices: list[torch.device] | None, main: torch.device) -> str | None:
    """Why a generation whose prompt is on `main` and whose layers are on `devices` runs its steps eagerly and
    without fused projections (some layer is on another device than the prompt), or None."""
    main = torch.device(main)
    if devices is None or all(torch.device(d) == main for d in devices):
        return None
    names = ", ".join(str(d) for d in dict.fromkeys(devices))
    return (f"the model's layers are on {names} and its inputs on {main} (device_map): a CUDA graph is captured on "
            "one device")


def device_guard(device: torch.device):
    """Make `device` current for the block (Triton launches its kernels on the current device, not on their
    tensors'); a no-op for the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.get_device_module(device.type).device(device)
