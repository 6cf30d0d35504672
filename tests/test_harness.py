"""The harness itself: results come back per rank, failures name the rank, hangs become failures,
and a call costs a queue round trip, not a process start."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from minipar.testing import PoolSet, RankError, RankPool


def _whoami(ctx, bonus):
    t = torch.tensor([float(ctx.rank)], device=ctx.device)  # nccl only takes tensors on the rank's GPU
    dist.all_reduce(t)
    return ctx.rank, ctx.world_size, t.item() + bonus, os.getpid()


def _pid(ctx):
    return os.getpid()


def _fail_on_rank1(ctx):
    if ctx.rank == 1:
        raise KeyError("only rank 1 trips")
    return "fine"


def _hang_on_rank0(ctx):
    if ctx.rank == 0:
        dist.recv(torch.zeros(1, device=ctx.device), src=1)  # rank 1 never sends: a hang
    return "rank 1 returns at once"


def _die_on_rank1(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()


def test_results_come_back_in_rank_order(pools):
    out = pools.run(3, _whoami, 0.5)
    assert [o[:3] for o in out] == [(r, 3, 0 + 1 + 2 + 0.5) for r in range(3)]


def test_no_process_start_per_call(pools):
    """Ranks are reused across calls (what keeps hypothesis examples cheap): 50 calls of a trivial
    function on a started world-2 pool run in the same two processes and take well under 5 s in all.
    Starting a rank process (spawn, import torch, join the process group) costs seconds, so even one
    start per call would need minutes; the bound is loose enough for a loaded CI machine."""
    calls = 50
    pids = pools.run(2, _pid)  # starts the pool if this is its first use; not timed
    t0 = time.perf_counter()
    seen = [pools.run(2, _pid) for _ in range(calls)]
    total_s = time.perf_counter() - t0
    print(f"harness overhead: {total_s / calls * 1e3:.2f} ms per call at world size 2 "
          f"({calls} calls in {total_s:.3f} s)")
    assert all(s == pids for s in seen), "a call ran in processes other than the pool's ranks"
    assert total_s < 5.0, f"{calls} trivial calls took {total_s:.1f} s: is a process started per call?"


def test_exception_names_rank_and_traceback(pools):
    with pytest.raises(RankError) as info:
        pools.run(2, _fail_on_rank1)
    msg = str(info.value)
    assert "rank 1 raised" in msg and "KeyError: 'only rank 1 trips'" in msg and "_fail_on_rank1" in msg
    assert "rank 0 raised" not in msg
    assert [o[0] for o in pools.run(2, _whoami, 0)] == [0, 1]  # the pool still works


def test_hang_becomes_failure_and_pool_restarts():
    pool = RankPool(2, timeout=20)
    try:
        pool.start()
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"ranks \[0\] did not answer"):
            pool.run(_hang_on_rank0, timeout=3)
        assert time.monotonic() - t0 < 15
        assert [o[0] for o in pool.run(_whoami, 0)] == [0, 1]  # restarted, usable
    finally:
        pool.close()


def test_dead_rank_becomes_failure():
    pool = RankPool(2, timeout=20)
    try:
        pool.start()
        with pytest.raises(RankError, match=r"rank 1 died \(exit code 3\)"):
            pool.run(_die_on_rank1)
        assert [o[0] for o in pool.run(_whoami, 0)] == [0, 1]
    finally:
        pool.close()


def test_nccl_without_enough_gpus_falls_back_to_gloo_and_says_why(capsys):
    """Asked for nccl, a world with more ranks than GPUs runs on gloo, and the reason goes to stderr
    once per world size (never silently: the run would otherwise look like an nccl run)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = gpus + 1  # one rank more than there are GPUs, on any machine
    pool_set = PoolSet(backend="nccl")
    assert [pool_set.backend_for(world) for _ in range(3)] == ["gloo"] * 3
    err = capsys.readouterr().err
    assert err.count("nccl asked for") == 1, err
    assert f"world size {world} needs {world} GPUs" in err and f"this machine has {gpus}" in err
    assert "runs on gloo" in err
    assert set(pool_set.fallbacks) == {world}
    assert PoolSet(backend="gloo").backend_for(world) == "gloo"
    assert capsys.readouterr().err == ""  # gloo asked for, gloo given: nothing to explain


def _leave_a_group_behind(ctx):
    group = dist.new_group(list(range(ctx.world_size)))
    dist.all_reduce(torch.ones(1, device=ctx.device), group=group)  # used, never destroyed
    return None


def _groups_and_threads(ctx, at_most: int | None = None):
    """(no group but WORLD registered, this process's thread count); with ``at_most``, the count is
    read again for up to 5 s until it is no more than that: a destroyed group's threads are told to
    stop and join, and on a loaded machine the last of them may not have left /proc yet."""
    registry = dist.distributed_c10d._world.pg_map

    def threads():
        return int(open(f"/proc/{os.getpid()}/status").read().split("Threads:")[1].split()[0])
    count, deadline = threads(), time.monotonic() + 5
    while at_most is not None and count > at_most and time.monotonic() < deadline:
        time.sleep(0.1)
        count = threads()
    return [pg for pg in registry if pg is not dist.group.WORLD] == [], count


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="counts threads through /proc (Linux only)")
def test_groups_a_task_leaves_behind_are_destroyed_with_their_threads(pools):
    """A task that creates a process group and never destroys it (most tests build a Mesh and return)
    leaves no group, and no gloo thread, in the reused rank process: thousands of such groups once
    woke each other ~190,000 times a second and took two thirds of the CI machine."""
    _, before = pools.run(2, _groups_and_threads)[0]
    for _ in range(5):
        pools.run(2, _leave_a_group_behind)
    for no_groups_left, threads in pools.run(2, _groups_and_threads, before):
        assert no_groups_left, "a group created by an earlier task is still registered"
        assert threads <= before, f"{threads - before} threads more than before the five tasks: groups leak"
