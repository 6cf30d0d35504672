"""Issue 34: compositions that trained or evaluated a different model than the user built, with no
error on any rank. Each test states the class it covers, and either that the composition now equals
one process (or keeps its copies of a parameter equal), or that it is refused on every rank, before
any collective, with a ValueError that says why and what to do.

Every test here failed on the code before its fix (each docstring says how).
"""

from __future__ import annotations

import pytest
import torch

from minipar import Mesh


# -- Mesh.new_group: every rank must create the same groups ---------------------------------------


def _new_group_per_rank(ctx, per_rank: list) -> list[str]:
    """Each rank asks for ``per_rank[rank]`` = (name, lists); returns what each call said."""
    mesh = Mesh()
    said = []
    for name, lists in per_rank[ctx.rank]:
        try:
            group = mesh.new_group(name, lists)
            said.append(f"ok {group.name} {group.ranks}")
        except ValueError as e:
            said.append(f"refused: {e}")
    mesh.destroy()
    return said


@pytest.mark.parametrize("per_rank", [
    # the same partition listed in another order: torch would pair rank 0's group [0] with rank 1's [1]
    [[("a", [[0], [1]])], [("a", [[1], [0]])]],
    # one rank's lists are no partition: before, it raised alone and the other created its groups
    [[("a", [[0], [1]])], [("a", [[0]])]],
    # another name: the groups would be counted and reported under two names
    [[("a", [[0, 1]])], [("b", [[0, 1]])]],
])
def test_new_group_with_different_lists_is_refused_on_every_rank(pools, per_rank):
    """Class 5. Lists, names or backends that differ between ranks raise ValueError on every rank,
    naming the ranks and the difference, and no group is created (a later, agreed call still works).
    Before: the first case built groups silently, the second hung in torch's new_group."""
    for case in per_rank:
        case.append(("after", [[0, 1]]))
    said = pools.run(2, _new_group_per_rank, per_rank, timeout=60)
    for rank, (first, after) in enumerate(said):
        assert first.startswith("refused:") and "differs between ranks" in first and "rank 1" in first, (rank, first)
        assert after == "ok after (0, 1)", (rank, after)


# -- the planner: nonsense inputs exit non-zero with the reason ------------------------------------


@pytest.mark.parametrize("args, why", [
    (["--global-batch", "-8"], "global batch=-8 must be a positive integer"),
    (["--global-batch", "0"], "global batch=0 must be a positive integer"),
    (["--gpus", "0"], "--gpus 0 must be at least 1"),
    (["--gpus", "-8"], "--gpus -8 must be at least 1"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0 must be at least 1"),
    (["--gpus", "12"], "not a multiple of --gpus-per-node"),
    (["--memory-gb", "-1"], "--memory-gb -1.0 must be a finite number > 0"),
    (["--peak-tflops", "0"], "--peak-tflops 0.0 must be a finite number > 0"),
    (["--inter-gbps", "inf"], "--inter-gbps inf must be a finite number > 0"),
    (["--efficiency", "nan"], "--efficiency nan must be a finite number > 0"),
    (["--efficiency", "1.5"], "at most 1"),
    (["--top", "0"], "top=0 must be a positive integer"),
    (["--layers", "0"], "model layers=0 must be a positive integer"),
    (["--heads", "7"], "hidden=768 must be divisible by heads=7"),
    (["--kv-heads", "5"], "kv_heads=5 must divide heads=12"),
    (["--seq", "-1024"], "model seq=-1024 must be a positive integer"),
    (["--top-k", "2"], "top_k=2 describe experts, but the model has experts=0"),
    (["--experts", "8", "--top-k", "9", "--moe-ffn", "64"], "1 <= top_k <= experts"),
    (["--config", "/nonexistent/config.json"], "cannot read a JSON config"),
    (["--explain", "tp0.pp1.dp8"], "layout tp=0 must be a positive integer"),
    (["--explain", "tp1.pp1.dp8.zero9"], "cannot read 'zero9'"),
    (["--explain", "tp1.pp1.dp8", "--json"], "leave out --json"),
])
def test_planner_refuses_nonsense_inputs_with_a_message(capsys, args, why):
    """Class 6. Every size, rate and option is validated before any arithmetic: the command exits 2
    (a usage error) with the reason on stderr, never 0 with negative, infinite or nan step times.
    Before: a negative batch printed negative step times and exited 0; zero GPUs raised
    ZeroDivisionError; a negative memory or a top-k without experts planned on."""
    from minipar.plan.__main__ import main
    base = [] if "--config" in args else ["--model", "gpt2-124m"]
    with pytest.raises(SystemExit) as exit_:
        main(base + args)
    assert exit_.value.code == 2
    assert why in capsys.readouterr().err


def test_planner_api_refuses_nonsense_inputs():
    """Class 6, from Python: `plan` and `evaluate` raise ValueError for the same inputs."""
    from dataclasses import replace

    from minipar.plan import Layout, evaluate, plan
    from minipar.plan.presets import H100, MODELS

    with pytest.raises(ValueError, match="global batch=-8"):
        plan("gpt2-124m", H100, -8)
    with pytest.raises(ValueError, match="model hidden=0"):
        plan(replace(MODELS["gpt2-124m"], hidden=0), H100, 64)
    with pytest.raises(ValueError, match="cluster memory"):
        evaluate(MODELS["gpt2-124m"], replace(H100, memory=-1.0), 64, Layout(tp=1, pp=1, dp=8))
    with pytest.raises(ValueError, match="layout dp=-8"):
        Layout(tp=1, pp=1, dp=-8)
    with pytest.raises(ValueError, match="unknown model"):
        plan("no-such-model")
