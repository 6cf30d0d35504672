"""What offload keeps where and moves per step, built on the planner's formulas (`minipar.plan.formulas`):
`offload_state_bytes` (device, host memory and disk bytes of each kind of state) and `offload_traffic`
(the bytes one optimizer step moves between them). ``tests/test_offload.py`` proves both exact against
what `minipar.Offload` really allocates and counts."""

from __future__ import annotations

from . import formulas as F


def offload_state_bytes(ps: F.ParamSet, dp: F.DataParallelShape, optimizer: str | None, params: str | None,
                        adam: bool = True) -> dict[str, int]:
    """`state_bytes` with `minipar.Offload(optimizer=, params=)`: {"params", "grads", "optimizer"} on
    the compute device, "host" (memory) and "disk" (files) for what is offloaded. The masters are
    always a separate fp32 copy; under "nvme" the masters and moments are files and only the step
    counters stay in host memory; parameter shards move whole (zero3 only)."""
    on_device = F.state_bytes(ps, dp, "adamw" if adam else "sgd")
    groups = F.flat_groups(ps, dp)
    real = sum(g.layout.real_len for g in groups)
    opt = 4 * real + ((F.ADAMW_STATE * real + F.STEP_BYTES * len(groups)) if adam else 0)
    out = {"params": on_device["params"], "grads": on_device["grads"], "optimizer": 0, "host": 0, "disk": 0}
    if optimizer == "cpu":
        out["host"] += opt
    elif optimizer == "nvme":
        steps = F.STEP_BYTES * len(groups) if adam else 0
        out["disk"] += opt - steps
        out["host"] += steps
    else:
        out["optimizer"] = on_device["optimizer"]
    if params is not None:
        out["host" if params == "cpu" else "disk"] += out["params"]
        out["params"] = 0
    return out


def offload_traffic(ps: F.ParamSet, dp: F.DataParallelShape, optimizer: str | None, params: str | None,
                    backwards: int = 1, pipeline: bool = False, first_step: bool = False,
                    adam: bool = True) -> dict[str, int]:
    """Bytes offloading moves in one optimizer step (what `offload_traffic()` counts): each
    gradient shard's real part to the host; the new shard back to the device (or its file); under
    "nvme" the masters read and written (and the moments, except that the first step reads none);
    under params offload each zero3 gather's shard copied to the device (and read from its file)."""
    groups = F.flat_groups(ps, dp)
    real = sum(g.layout.real_len for g in groups)
    out = {"to_device": 0, "to_host": 0, "disk_read": 0, "disk_write": 0}
    if optimizer is None:
        return out
    out["to_host"] += real * dp.grad_bytes
    if optimizer == "nvme":
        moments = F.ADAMW_STATE if adam else 0
        out["disk_read"] += real * (4 + (0 if first_step else moments))
        out["disk_write"] += real * (4 + moments)
    if params is None:
        out["to_device"] += real * dp.param
        return out
    if params == "nvme":
        out["disk_write"] += real * dp.param
    for g, gathers in zip(groups, F.zero3_gathers(ps, dp, backwards, pipeline)):
        moved = g.layout.shard_size * dp.param * gathers
        out["to_device"] += moved
        if params == "nvme":
            out["disk_read"] += moved
    return out
