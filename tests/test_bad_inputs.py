"""Bad inputs to the features added last round (issue 29, point 4): one line of `CASES` per input,
each refused on every rank with a ValueError (a `CheckpointError` is one) that says what is wrong and
what to do instead, and the world still in step afterwards (one all-reduce over it works).

Each line names the feature, what is wrong, where the error must come ("when") and a fragment of
its message; "fix" is a second fragment, the part of the message that says what to do:

    local   a config object or a single-process call: raised in this process, no process group
    mesh    the mesh's sizes: raised by ``Mesh(...)`` before it builds anything
    wrap    when the model, optimizer or server is built: no collective issued before the error
            (``with mesh.comm.counting() as stats``, then ``stats.records == []``)
    batch   in train_step, after the batch check's all-gather alone (which tells every rank that
            one rank's batch is bad) and before any activation moved
    agreed  after the small agreement that makes one rank's problem every rank's (new_group's lists,
            a checkpoint's phases); nothing else ran

Faults (file systems, killed ranks, NaN/inf) are in tests/test_faults.py; the planner's nonsense
inputs in tests/test_silent_wrong.py (test_planner_refuses_nonsense_inputs_with_a_message); the
refusals of earlier rounds in tests/test_composition.py (REFUSALS), tests/test_pipeline.py,
tests/test_context_parallel.py, tests/test_hsdp.py, tests/test_offload.py, tests/test_onebit.py and
tests/test_parameter_server.py.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from minipar import Mesh, Offload, OneBitAdam, ParameterServer, PipelineConfig, ShardedModule, checkpoint
from minipar.data_parallel.single_process import DataParallel
from minipar.models import GPT, GPTConfig
from minipar.pipeline import spec_for

CFG = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0)


def _gpt(**kw) -> GPT:
    return GPT(GPTConfig(**{**CFG, **kw}))


class _NoAttention(nn.Module):
    """A token-wise language model: an embedding and a linear head, no attention to split."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.emb(ids))


# -- the actions: each builds what it needs and returns the bad call ----------------------------------
# (module-level functions, so the pools can send them to the ranks by reference)

def cp_model_without_attention(mesh, tmp):
    return lambda: ShardedModule(_NoAttention(), mesh=mesh)


def cp_ranks_given_other_lengths(mesh, tmp):
    model = ShardedModule(_gpt(), mesh=mesh, strategy="zero2", context_parallel="ring")
    x = torch.randint(0, 16, (2, 9 if mesh.cp_rank == 0 else 5))
    return lambda: model.train_step(x[:, :-1], x[:, 1:], model.cross_entropy)


def cp_that_does_not_divide_the_world(mesh, tmp):
    return lambda: Mesh(cp=3)


def hsdp_shard_of_zero(mesh, tmp):
    return lambda: Mesh(dp_shard=0)


def hsdp_with_onebit_adam(mesh, tmp):
    model = ShardedModule(_gpt(), mesh=mesh, strategy="zero2")
    return lambda: model.build_optimizer(OneBitAdam, lr=1e-3, freeze_step=2)


def interleaved_boundaries_per_rank(mesh, tmp):
    return lambda: ShardedModule(_gpt(n_layer=4), mesh=mesh, schedule="interleaved_1f1b", microbatches=2,
                                 pipeline_boundaries=[2, 2])


def virtual_stages_zero(mesh, tmp):
    return lambda: PipelineConfig(schedule="interleaved_1f1b", virtual_stages=0)


def microbatches_true(mesh, tmp):
    return lambda: PipelineConfig(schedule="zb_h1", microbatches=True)


def _spec(**change):
    return dataclasses.replace(spec_for(_gpt()), **change)


def stage_spec_tie_that_names_nothing(mesh, tmp):
    spec = _spec(tied=("wte.weigth", "lm_head.weigth"))
    return lambda: ShardedModule(_gpt(), mesh=mesh, stage_spec=spec)


def stage_spec_width_as_text(mesh, tmp):
    spec = _spec(hidden_size="8")
    return lambda: ShardedModule(_gpt(), mesh=mesh, stage_spec=spec)


def stage_spec_example_outside_the_vocabulary(mesh, tmp):
    spec = _spec(example=torch.full((1, 2), 99))
    return lambda: ShardedModule(_gpt(), mesh=mesh, stage_spec=spec)


def offload_with_onebit_adam(mesh, tmp):
    model = ShardedModule(_gpt(), mesh=mesh, strategy="zero2", offload=Offload(optimizer="cpu"))
    return lambda: model.build_optimizer(OneBitAdam, lr=1e-3, freeze_step=2)


def onebit_freeze_step_fraction(mesh, tmp):
    return lambda: OneBitAdam([nn.Parameter(torch.zeros(2))], freeze_step=2.5)


def ps_max_norm_as_text(mesh, tmp):
    return lambda: ParameterServer(_gpt(), mesh, torch.optim.SGD, servers=1, max_norm="1", lr=0.1)


def ps_optimizer_arguments_it_refuses(mesh, tmp):
    return lambda: ParameterServer(_gpt(), mesh, torch.optim.AdamW, servers=1, lr=-1.0)


def ps_with_onebit_adam(mesh, tmp):
    return lambda: ParameterServer(_gpt(), mesh, OneBitAdam, servers=1, lr=1e-3, freeze_step=2)


def ps_on_a_tensor_parallel_mesh(mesh, tmp):
    return lambda: ParameterServer(_gpt(), mesh, torch.optim.SGD, servers=1, lr=0.1)


def ps_async_in_half_precision(mesh, tmp):
    return lambda: ParameterServer(_gpt().half(), mesh, torch.optim.SGD, servers=1, mode="async", lr=0.1)


def ps_parameters_of_two_dtypes(mesh, tmp):
    model = _gpt()
    model.lm_head.double()
    return lambda: ParameterServer(model, mesh, torch.optim.SGD, servers=1, lr=0.1)


def dp_on_a_gpu_that_is_not_there(mesh, tmp):
    return lambda: DataParallel(nn.Linear(2, 2), devices=["cuda"])


def dp_on_gpu_numbers_without_gpus(mesh, tmp):
    return lambda: DataParallel(nn.Linear(2, 2), devices=[0, 1])


def dp_devices_of_two_types(mesh, tmp):
    return lambda: DataParallel(nn.Linear(2, 2), devices=["cpu", "meta"])


def dp_an_empty_batch(mesh, tmp):
    return lambda: DataParallel(nn.Linear(2, 2), devices=["cpu", "cpu"])(torch.zeros(0, 2))


def dp_no_tensor_to_split(mesh, tmp):
    return lambda: DataParallel(nn.Identity(), devices=["cpu", "cpu"])(3.0)


def new_group_with_an_empty_list(mesh, tmp):
    return lambda: mesh.new_group("g", [[0, 1], []])


def new_group_naming_a_rank_twice(mesh, tmp):
    return lambda: mesh.new_group("g", [[0], [0, 1]])


def new_group_on_an_unknown_backend(mesh, tmp):
    return lambda: mesh.new_group("g", [[0], [1]], backend="mpi")


def new_group_on_nccl_without_nccl(mesh, tmp):
    return lambda: mesh.new_group("g", [[0], [1]], backend="nccl")


def checkpoint_of_onebit_adam_into_adamw(mesh, tmp):
    model = ShardedModule(_gpt(), mesh=mesh, strategy="ddp")
    checkpoint.save(tmp / "onebit", model, model.build_optimizer(OneBitAdam, lr=1e-3, freeze_step=2))
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3)
    return lambda: checkpoint.load(tmp / "onebit", model, opt)


def checkpoint_path_that_does_not_exist(mesh, tmp):
    model = ShardedModule(_gpt(), mesh=mesh, strategy="zero3")
    opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3)
    return lambda: checkpoint.load(tmp / "no" / "such" / "step_00000001", model, opt)


class Case(NamedTuple):
    feature: str
    wrong: str
    world: int  # 0: in this process
    sizes: dict | None  # the mesh the action gets (None: none)
    action: Callable
    when: str
    message: str
    fix: str  # the part of the message that says what to do


# feature, what is wrong, world, mesh, action, when, what the message says, and the fix it names
CASES = [
    Case("cp", "a model without an attention minipar wires", 2, dict(cp=2), cp_model_without_attention, "wrap",
         "context parallelism (cp=2) found no attention to split in _NoAttention", "train this model with cp=1"),
    Case("cp", "cp ranks given sequences of different lengths", 2, dict(cp=2), cp_ranks_given_other_lengths, "batch",
         "were given batches of different shapes", "give every rank of a cp group the same batch"),
    Case("cp", "cp that does not divide the world", 2, None, cp_that_does_not_divide_the_world, "mesh",
         "tp * cp * pp = 1 * 3 * 1 = 3 does not divide the world size 2", "whose product divides 2"),
    Case("HSDP", "dp_shard=0", 2, None, hsdp_shard_of_zero, "mesh", "mesh size dp_shard=0",
         "must be a positive integer"),
    Case("HSDP", "1-bit Adam (needs DDP) on a ZeRO-2 HSDP model", 4, dict(dp_shard=2), hsdp_with_onebit_adam, "wrap",
         "ZeRO (zero1/zero2/zero3) is refused", "use strategy='ddp' or torch.optim.AdamW"),
    Case("interleaved_1f1b", "boundaries for 2 stages where 2 x 2 chunks are cut", 2, dict(pp=2),
         interleaved_boundaries_per_rank, "wrap", "pipeline_boundaries=[2, 2] for 4 stages",
         "give 4 block counts or 5 cut points"),
    Case("virtual stages", "virtual_stages=0", 0, None, virtual_stages_zero, "local", "virtual_stages=0",
         "must be a positive integer"),
    Case("zb_h1", "microbatches=True", 0, None, microbatches_true, "local", "microbatches=True",
         "must be a positive integer"),
    Case("StageSpec", "a tie whose paths name no parameter", 2, dict(pp=2), stage_spec_tie_that_names_nothing,
         "wrap", "GPT has no parameter at 'wte.weigth'", "StageSpec(tied=(embedding weight, head weight))"),
    Case("StageSpec", "hidden_size given as text", 2, dict(pp=2), stage_spec_width_as_text, "wrap",
         "StageSpec(hidden_size='8')", "must be a positive integer"),
    Case("StageSpec", "an example the model cannot take", 2, dict(pp=2), stage_spec_example_outside_the_vocabulary,
         "wrap", "forward fails on token ids of shape (1, 2) (IndexError", "pass StageSpec(example=...)"),
    Case("offload", "offload (ZeRO) with 1-bit Adam (DDP)", 2, {}, offload_with_onebit_adam, "wrap",
         "OneBitAdam communicates the momentum itself and needs the DDP strategy", "use strategy='ddp'"),
    Case("1-bit Adam", "freeze_step=2.5", 0, None, onebit_freeze_step_fraction, "local", "freeze_step=2.5",
         "must be an int >= 1"),
    Case("parameter server", "max_norm given as text", 2, {}, ps_max_norm_as_text, "wrap", "max_norm='1'",
         "must be a number > 0 (or None: no clipping)"),
    Case("parameter server", "optimizer arguments the optimizer refuses", 2, {}, ps_optimizer_arguments_it_refuses,
         "wrap", "AdamW(params, **{'lr': -1.0}) cannot be built (ValueError: Invalid learning rate: -1.0)",
         "fix the optimizer's arguments"),
    Case("parameter server", "1-bit Adam as the servers' optimizer", 2, {}, ps_with_onebit_adam, "wrap",
         "OneBitAdam communicates the momentum itself and needs the DDP strategy", "use strategy='ddp'"),
    Case("parameter server", "a tensor-parallel mesh", 2, dict(tp=2), ps_on_a_tensor_parallel_mesh, "wrap",
         "ParameterServer needs a purely data-parallel mesh", "build Mesh()"),
    Case("parameter server", "async with fp16 parameters", 2, {}, ps_async_in_half_precision, "wrap",
         "torch.float16 cannot count exactly", "keep float32 parameters"),
    Case("parameter server", "parameters of two dtypes", 2, {}, ps_parameters_of_two_dtypes, "wrap",
         "every parameter must have the same dtype", "torch.float64"),
    Case("DataParallel", "a CUDA device on a machine without one", 0, None, dp_on_a_gpu_that_is_not_there, "local",
         "devices=['cuda'] name a GPU, but torch sees none", "devices=['cpu', 'cpu']"),
    Case("DataParallel", "GPU numbers on a machine without GPUs", 0, None, dp_on_gpu_numbers_without_gpus, "local",
         "devices=[0, 1] name a GPU, but torch sees none", "devices=['cpu', 'cpu']"),
    Case("DataParallel", "devices of two types", 0, None, dp_devices_of_two_types, "local", "mix device types",
         "use only CUDA devices or only 'cpu'"),
    Case("DataParallel", "an empty batch", 0, None, dp_an_empty_batch, "local", "DataParallel got an empty batch",
         "dim 0 has size 0"),
    Case("DataParallel", "no tensor to split", 0, None, dp_no_tensor_to_split, "local",
         "no argument is a tensor with a batch dimension", "splits its inputs along dim 0"),
    Case("Mesh.new_group", "an empty rank list", 2, {}, new_group_with_an_empty_list, "agreed",
         "new_group('g'): [[0, 1], []]", "every rank of the world (0 to 1) exactly once, in lists of at least one"),
    Case("Mesh.new_group", "a rank in two lists", 2, {}, new_group_naming_a_rank_twice, "agreed",
         "new_group('g'): [[0], [0, 1]]", "exactly once"),
    Case("Mesh.new_group", "a backend torch does not have", 2, {}, new_group_on_an_unknown_backend, "agreed",
         "new_group('g'): backend='mpi' is not in this torch build", "use 'gloo' or 'nccl', or None (the world's)"),
    Case("Mesh.new_group", "nccl in a torch built without it", 2, {}, new_group_on_nccl_without_nccl, "agreed",
         "new_group('g'): backend='nccl' is not in this torch build", "use 'gloo' or 'nccl', or None (the world's)"),
    Case("checkpoints", "1-bit Adam's checkpoint loaded into AdamW", 2, {}, checkpoint_of_onebit_adam_into_adamw,
         "agreed", "the checkpoint's optimizer is OneBitAdam, this one is AdamW",
         "build the optimizer the checkpoint was saved with"),
    Case("checkpoints", "a path that does not exist", 2, {}, checkpoint_path_that_does_not_exist, "agreed",
         "step_00000001 is not a checkpoint directory", "find_latest(root)"),
]


def _attempt(mesh, action, tmp) -> tuple[str, str, list[str]]:
    """(error type or "no error", message, the tags of the collectives the bad call issued)."""
    call = action(mesh, tmp)
    stats = None
    try:
        if mesh is None:
            call()
        else:
            with mesh.comm.counting() as stats:
                call()
        return "no error", "", []
    except Exception as e:  # noqa: BLE001 -- the test says which type it wants
        return type(e).__name__, str(e), [r.tag for r in stats.records] if stats is not None else []


def _on_ranks(ctx, sizes, action, tmp):
    mesh = Mesh(**sizes) if sizes is not None else None
    try:
        out = _attempt(mesh, action, tmp)
    finally:
        if mesh is not None:
            mesh.destroy()
    ones = torch.ones(1)
    dist.all_reduce(ones)  # every rank raised and left: the world is still in step
    return out + (ones.item() == ctx.world_size,)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.feature}: {c.wrong}" for c in CASES])
def test_a_bad_input_is_refused_on_every_rank_with_the_fix(pools, tmp_path, case):
    if case.action in (dp_on_a_gpu_that_is_not_there, dp_on_gpu_numbers_without_gpus) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if case.action is new_group_on_nccl_without_nccl and dist.is_nccl_available():
        pytest.skip("this torch has NCCL")
    if case.world == 0:
        assert not dist.is_initialized()  # a collective here would fail: nothing is issued
        results = [_attempt(None, case.action, tmp_path) + (True,)]
    else:
        results = pools.run(case.world, _on_ranks, case.sizes, case.action, tmp_path, timeout=60)
    for rank, (kind, message, issued, healthy) in enumerate(results):
        assert kind in ("ValueError", "CheckpointError"), (rank, kind, message)
        assert case.message in message and case.fix in message, (rank, message)
        assert healthy, rank
        if case.when in ("wrap", "mesh", "local"):
            assert issued == [], (rank, issued)
        elif case.when == "batch":
            assert issued == ["batch_check"], (rank, issued)

