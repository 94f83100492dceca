"""Global gradient-norm clipping whose norm is the same number under every strategy.

`accelerator.clip_grad_norm_`'s norms differed by up to 2.6e-4 across strategies (each its dtype
and its shards). Here each rank sums squares in fp64 over what it holds, shards are added over the
ranks that shard them, and torch's `clip_grads_with_norm_` clips; DeepSpeed's engine clips itself.
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from common import checks
from common.errors import Stop


FP64_CHUNK_ELEMENTS = 1 << 24  # the most fp64 temporaries per gradient: 128 MB


def _sum_of_squares_fp64(grad: torch.Tensor) -> torch.Tensor:
    """sum(grad.double() ** 2), 0-dim, over slices (a whole cast would need 8 bytes per element)."""
    parts = grad.reshape(-1).split(FP64_CHUNK_ELEMENTS)  # views, for contiguous gradients
    return sum(torch.linalg.vector_norm(part, dtype=torch.float64) ** 2 for part in parts)


def clip_grad_norm_(accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip `model`'s gradients in place to a global L2 norm of at most `max_norm` (0 or None:
    measure only), where `accelerator.clip_grad_norm_` would go. Returns the norm before clipping,
    a 0-dim fp64 tensor on the device, the same on every rank: read it on logging steps only."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        ds_clip = accelerator.state.deepspeed_plugin.deepspeed_config.get("gradient_clipping")
        if error := checks.clipping_problem(ds_clip, max_norm):
            raise Stop(error)
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)  # DeepSpeed's clipped norm
        return torch.as_tensor(
            float("nan") if norm is None else norm, dtype=torch.float64, device=accelerator.device
        )
    accelerator.unscale_gradients()  # no-op unless fp16 loss scaling is on
    params = [p for p in model.parameters() if p.grad is not None]
    sum_of_squares = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    on_mesh = {}  # FSDP2 on a 2-D mesh (HSDP), tensor parallel: (mesh, sharded dims) -> sum of squares
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor):  # FSDP2 (and tensor parallel): this rank's shard
            mesh = grad.device_mesh
            if not (mesh.ndim == 1 and mesh.size() == accelerator.num_processes):
                # (FSDP2 over tp slices shards with `_StridedShard`, not a `Shard` in torch 2.13)
                sharded = (Shard, _StridedShard)
                dims = tuple(d for d, x in enumerate(grad.placements) if isinstance(x, sharded))
                part = on_mesh.setdefault((mesh, dims), torch.zeros_like(sum_of_squares))
                part += _sum_of_squares_fp64(grad.to_local()).to(part.device)
                continue
            grad = grad.to_local()
        sum_of_squares += _sum_of_squares_fp64(grad).to(sum_of_squares.device)
    strategy = getattr(model, "sharding_strategy", None)  # FSDP1 only
    if strategy is not None and "HYBRID" in strategy.name:
        raise NotImplementedError(
            f"clip_grad_norm_ supports FSDP1 FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, "
            f"got {strategy.name}"
        )
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if fsdp and getattr(strategy, "name", "") != "NO_SHARD" and not on_mesh:  # disjoint shards
        sum_of_squares = accelerator.reduce(sum_of_squares, reduction="sum")
    for (mesh, dims), part in on_mesh.items():  # add up over the sharded mesh dims only: a
        for dim in dims:  # replicated dim (HSDP's dp_replicate) holds copies, counted once
            torch.distributed.all_reduce(part, group=mesh.get_group(dim))
        sum_of_squares += part
    total_norm = sum_of_squares.sqrt()
    # torch's grad *= min(1, max_norm / (norm + 1e-6)), the norm on the gradients' device
    if max_norm is not None and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm
