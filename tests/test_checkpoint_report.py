"""checkpoint.save and checkpoint.load say what they did: one line on rank 0 (the step when the
extra state has one, the number of files with the manifest, the megabytes, the seconds and the
path; a load under another mesh says it resharded), nothing on the other ranks, and nothing at
all with report=False."""

from __future__ import annotations

import contextlib
import io
import os
import re

import torch

from minipar import Mesh, ShardedModule, checkpoint
from minipar.models import GPT, GPTConfig

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _save_and_load(ctx, root: str):
    out = {}
    for report in (True, False):
        model = ShardedModule(GPT(GPTConfig(**CFG)), mesh=Mesh(), strategy="zero2")
        opt = model.build_optimizer(torch.optim.AdamW, lr=1e-3)
        other = ShardedModule(GPT(GPTConfig(**CFG)), mesh=Mesh(), strategy="zero3")
        other_opt = other.build_optimizer(torch.optim.AdamW, lr=1e-3)
        path = os.path.join(root, f"step_120_{report}")
        for what, call in (("save", lambda: checkpoint.save(path, model, opt, {"step": 120}, report=report)),
                           ("load", lambda: checkpoint.load(path, other, other_opt, report=report))):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                call()
            out[what, report] = text.getvalue()
    return out


def test_save_and_load_report_one_line_on_rank_0(pools, tmp_path):
    ranks = pools.run(2, _save_and_load, str(tmp_path))
    saved, loaded = ranks[0]["save", True], ranks[0]["load", True]
    path = tmp_path / "step_120_True"
    assert re.fullmatch(rf"checkpoint: saved step 120: 3 files, \d+\.\d MB, \d+\.\d\d s -> {re.escape(str(path))}\n",
                        saved), saved
    # (zero2 -> zero3 on the same mesh: the same rank files, so not called resharded)
    assert re.fullmatch(rf"checkpoint: loaded step 120: 3 files, \d+\.\d MB, \d+\.\d\d s <- {re.escape(str(path))}\n",
                        loaded), loaded
    assert not ranks[1]["save", True] and not ranks[1]["load", True], "only rank 0 reports"
    assert not any(r[k, False] for r in ranks for k in ("save", "load")), "report=False is silent"
