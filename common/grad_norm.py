"""Global gradient-norm clipping whose norm is the same number under every strategy.

Why not `accelerator.clip_grad_norm_`: it computes the norm in the gradients' dtype with torch's
kernels, and on CPU torch 2.13's fp32 `vector_norm` accumulates serially: on the 4096x256
embedding gradient of the debug model it is off from the exact norm by ~3e-5 (relative). A
single process takes that norm over whole tensors, FSDP over half shards and DeepSpeed in fp64,
so the same gradients got norms that differed by up to 2.6e-4 across strategies. Here every
strategy sums squares in fp64 over what the rank holds, adds the shards up over the ranks
where the gradients are sharded, and clips with torch's own `clip_grads_with_norm_`. DeepSpeed
clips inside its engine (norm in fp64 already), so for it this only reads the norm back.

On a GPU: no fp64 copy of a whole gradient (the fp64 sums run over slices), and no host sync:
the norm and the clip factor stay on the device, and recipes read the norm on logging steps only.
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from common import checks
from common.errors import Stop


FP64_CHUNK_ELEMENTS = (
    1 << 24
)  # fp64 temporaries per gradient are at most this many elements (128 MB)


def _sum_of_squares_fp64(grad: torch.Tensor) -> torch.Tensor:
    """sum(grad.double() ** 2) without a full fp64 copy: `vector_norm` casts its input to fp64,
    so it runs over slices of at most FP64_CHUNK_ELEMENTS (a 1B-parameter embedding would
    otherwise need 4 GB of fp64 temporaries for its norm). 0-dim fp64 tensor on grad's device."""
    flat = grad.reshape(-1)  # a view for contiguous gradients
    if flat.numel() <= FP64_CHUNK_ELEMENTS:
        return torch.linalg.vector_norm(flat, dtype=torch.float64) ** 2
    return sum(
        torch.linalg.vector_norm(part, dtype=torch.float64) ** 2
        for part in flat.split(FP64_CHUNK_ELEMENTS)
    )


def clip_grad_norm_(accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of `model` in place to a global L2 norm of at most `max_norm`.

    Call it where `accelerator.clip_grad_norm_` would go: after the window's last backward, before
    `optimizer.step()`. Under fp16 it unscales the gradients first (Accelerate's GradScaler), so
    the norm and the threshold are in true gradient units. No host sync: the norm stays on the
    device, so read it (`float(norm)`) only on logging steps.

    Args:
        accelerator: the `Accelerator` that prepared `model`.
        model: the prepared model (DDP, FSDP1, FSDP2 or DeepSpeed engine, or a plain module).
        max_norm: clip threshold, in the gradients' units; 0 or less (or None) only measures the
            norm and clips nothing, as `max_grad_norm=0` in transformers' Trainer and
            `gradient_clipping: 0` in DeepSpeed.

    Returns:
        The global L2 norm of all gradients before clipping: a 0-dim fp64 tensor on
        `accelerator.device` (DeepSpeed: whatever its engine reports, as a 0-dim tensor), the
        same value on every rank; inf or nan if a gradient overflowed. The norm is
        sqrt(sum over ranks and tensors of sum(g.double() ** 2)), each tensor's sum taken in
        slices of at most `FP64_CHUNK_ELEMENTS`; the clip factor is torch's,
        min(1, max_norm / (norm + 1e-6)).

    Raises:
        ValueError: under DeepSpeed, if `max_norm` differs from the JSON's `gradient_clipping`
            (`checks.clipping_problem`, which the recipes also check at start-up).
        NotImplementedError: for FSDP1 HYBRID_SHARD, where a sum over all ranks would count
            replicated shards more than once. (FSDP1 NO_SHARD holds full gradients on every rank,
            like DDP: no sum. FSDP2 on a 2-D mesh, HSDP and tensor parallel: each gradient's squares
            are added up over the mesh dims it is sharded on, not over the replicas or the tp ranks
            that hold copies, such as the RMSNorm weights.)
    """
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
                # FSDP2 over tensor-parallel slices shards on dp with `_StridedShard`, which torch 2.13
                # does not count as a Shard (`is_shard()` is False): a norm without it misses half the squares
                dims = tuple(
                    d
                    for d, placement in enumerate(grad.placements)
                    if isinstance(placement, (Shard, _StridedShard))
                )
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
    sharded = (
        accelerator.distributed_type == DistributedType.FSDP
        and getattr(strategy, "name", "") != "NO_SHARD"
    )
    if sharded and not on_mesh:  # each rank holds a disjoint shard: add them up
        sum_of_squares = accelerator.reduce(sum_of_squares, reduction="sum")
    for (mesh, dims), part in on_mesh.items():  # add up over the sharded mesh dims only: a
        for dim in dims:  # replicated dim (HSDP's dp_replicate) holds copies, counted once
            torch.distributed.all_reduce(part, group=mesh.get_group(dim))
        sum_of_squares += part
    total_norm = sum_of_squares.sqrt()
    # torch's own scaling, grad *= min(1, max_norm / (norm + 1e-6)), with the norm on the gradients'
    # device (a CPU norm would send CUDA gradients down the per-tensor slow path).
    if max_norm is not None and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm
