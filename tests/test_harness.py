"""The harness itself: results come back per rank, failures name the rank, hangs become failures."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from minipar.testing import RankError, RankPool


def _whoami(ctx, bonus):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return ctx.rank, ctx.world_size, t.item() + bonus, os.getpid()


def _fail_on_rank1(ctx):
    if ctx.rank == 1:
        raise KeyError("only rank 1 trips")
    return "fine"


def _hang_on_rank0(ctx):
    if ctx.rank == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends: a hang
    return "rank 1 returns at once"


def _die_on_rank1(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()


def test_results_come_back_in_rank_order(pools):
    out = pools.run(3, _whoami, 0.5)
    assert [o[:3] for o in out] == [(r, 3, 0 + 1 + 2 + 0.5) for r in range(3)]


def test_no_process_start_per_call(pools):
    """Ranks are reused across calls (what keeps hypothesis examples cheap)."""
    pids = [o[3] for o in pools.run(2, _whoami, 0)]
    t0 = time.perf_counter()
    for _ in range(20):
        again = [o[3] for o in pools.run(2, _whoami, 0)]
    per_call_ms = (time.perf_counter() - t0) / 20 * 1e3
    print(f"harness overhead: {per_call_ms:.1f} ms per call at world size 2")
    assert again == pids


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
