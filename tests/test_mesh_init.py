"""minipar.init: the backend it picks and the world it starts, from the environment it finds.

init() initialises torch.distributed at most once per process, so every case starts from a process
where it is not initialised yet. The single-process cases run in this (the pytest) process, which
the rank pools never initialise (their ranks are processes of their own), with the torchrun
variables removed and CUDA hidden or faked, and tear the world down afterwards. The torchrun case
starts two fresh processes with a torchrun-like environment.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import minipar

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "MINIPAR_BACKEND")


@pytest.fixture
def fresh_process(monkeypatch):
    """This process as a plain ``python train.py`` sees it: no torchrun variables, no MINIPAR_BACKEND,
    no GPU (tests that want GPUs fake them). Any world init() starts is destroyed after the test."""
    assert not dist.is_initialized(), "torch.distributed is already initialised in the pytest process"
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


def test_without_gpus_init_picks_gloo(fresh_process):
    mesh = minipar.init()
    assert dist.get_backend() == "gloo"
    assert mesh.device == torch.device("cpu")


def test_without_torchrun_environment_init_starts_a_world_of_one(fresh_process):
    mesh = minipar.init()
    assert (dist.get_world_size(), dist.get_rank()) == (1, 0)
    assert (mesh.world_size, mesh.rank) == (1, 0)
    assert (mesh.dp, mesh.tp, mesh.pp, mesh.ep) == (1, 1, 1, 1)
    assert all(mesh.size(axis) == 1 for axis in ("dp", "tp", "pp", "ep", "edp"))
    t = torch.tensor([3.0])
    dist.all_reduce(t)  # the world really exists: a collective over it returns
    assert t.item() == 3.0
    again = minipar.init()  # initialised already: a new Mesh over the same world, no second init
    assert (again.world_size, dist.get_world_size()) == (1, 1)


def test_minipar_backend_gloo_overrides_the_gpu_choice(fresh_process):
    """With a GPU for every local rank init would pick nccl; MINIPAR_BACKEND=gloo wins."""
    fresh_process.setattr(torch.cuda, "is_available", lambda: True)
    fresh_process.setattr(torch.cuda, "device_count", lambda: 8)
    fresh_process.setenv("MINIPAR_BACKEND", "gloo")
    mesh = minipar.init()
    assert dist.get_backend() == "gloo"
    assert mesh.device == torch.device("cpu")


@pytest.mark.parametrize("name", ["mpi", "cuda"])
def test_unknown_minipar_backend_raises_naming_the_options(fresh_process, name):
    fresh_process.setenv("MINIPAR_BACKEND", name)
    with pytest.raises(ValueError, match=rf"backend '{name}' is not supported; use 'nccl' or 'gloo'"):
        minipar.init()
    assert not dist.is_initialized()  # raised before anything was started


_RANK_SCRIPT = textwrap.dedent("""
    import json

    import torch
    import torch.distributed as dist

    import minipar

    mesh = minipar.init()
    t = torch.tensor([float(mesh.rank + 1)], device=mesh.device)
    mesh.comm.all_reduce(t, mesh.group("dp"))
    print(json.dumps({"rank": mesh.rank, "world": mesh.world_size, "dp": mesh.dp, "dp_rank": mesh.dp_rank,
                      "backend": dist.get_backend(), "device": str(mesh.device), "sum": t.item()}))
    minipar.shutdown()
""")


def test_torchrun_environment_builds_a_world_of_two(tmp_path):
    """Two fresh processes, each with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): init() joins them into one world of two, picks
    nccl when each has a GPU of its own and gloo otherwise, and the mesh's dp group all-reduces."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    procs = []
    for rank in range(2):
        env = {**base, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=90))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-2000:]}\n{err[-3000:]}"
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    for rank, r in enumerate(results):
        assert r == {"rank": rank, "world": 2, "dp": 2, "dp_rank": rank, "backend": backend,
                     "device": f"cuda:{rank}" if backend == "nccl" else "cpu", "sum": 3.0}, r
