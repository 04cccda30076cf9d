"""Tensor parallelism (transformers' `tp_plan="auto"`): the group whose ranks share a selection (and whose
all-reduces `symmetric_all_reduce` may take over).

Under `tp_plan="auto"` each rank holds a shard of every attention layer's heads as `DTensor` parameters. By default
each rank rates the slots from its own query heads (`VegasConfig.selection_heads="local"`, no communication). With
`"all"`, the ranks average their scores over the tensor-parallel group before choosing (`SelectionState.pool`): the
paper's Collect-2-Query average over every head, the same slots on every rank.
"""

from __future__ import annotations

import torch


def score_group(model):
    """The group whose ranks average their scores under `vegas_selection_heads="all"` (`tp_group`)."""
    return tp_group(model, "`vegas_selection_heads='all'` averages scores over the tensor-parallel ranks")


def tp_group(model, needed_by: str):
    """The process group over which `model`'s tensor parallelism shards its heads, or None for a model on one device
    (no `DTensor` parameters). A mesh of several dimensions must name its tensor-parallel one "tp"; `needed_by` says
    in the error what needs the group."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            mesh = parameter.device_mesh
            if mesh.ndim == 1:
                return mesh.get_group()
            if "tp" in (mesh.mesh_dim_names or ()):
                return mesh.get_group("tp")
            raise ValueError(
                f"{needed_by}, but this model's device mesh has dimensions {mesh.mesh_dim_names} and none is named "
                "'tp'."
            )
    return None
