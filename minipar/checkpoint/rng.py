"""The random number generators' states a checkpoint carries per rank: torch's, CUDA's, Python's,
NumPy's and the tensor-parallel dropout streams (`minipar.tensor_parallel.rng`)."""

from __future__ import annotations

import random

import torch


# -- RNG ---------------------------------------------------------------------------------------------

def rng_state(model) -> dict:
    """This rank's generators' states, as plain tensors and numbers (a checkpoint holds nothing else)."""
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if model.mesh.device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(model.mesh.device)
    tp_random = getattr(model.module, "tp_random", None)
    if tp_random is not None:
        out["tp_streams"] = dict(tp_random.states)
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    return out


def set_rng_state(model, rng: dict, own_rank: bool) -> None:
    """Restore ``rng``; the device and tensor-parallel streams only when it is this rank's own."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "numpy" in rng:
        import numpy as np
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if own_rank and "cuda" in rng and model.mesh.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], model.mesh.device)
    tp_random = getattr(model.module, "tp_random", None)
    if own_rank and tp_random is not None and "tp_streams" in rng:
        tp_random.states = dict(rng["tp_streams"])
