"""Pipeline parallelism: schedules as data, stages of any block-sequential model, and the executor that runs a schedule."""

from .abort import PipelineAborted
from .dualpipe import dualpipe_v, without_overlap
from .executor import run_schedule
from .schedule import (KINDS, SCHEDULES, Action, Schedule, chunks_per_rank, gpipe, holder, interleaved_1f1b,
                       one_f_one_b, virtual_stage, zb_h1, zb_v)
from .simulator import simulate
from .spec import StageSpec, gpt_spec, hf_gpt2_spec, hf_llama_spec, spec_for
from .stage import GPTStage, Stage, balanced_boundaries, default_boundaries, resolve_boundaries, stage_params, sync_tied_grads
from .step import Pipeline, PipelineConfig
from .split_backward import WeightGrad, backward_input
from .timeline import RankTimeline, chrome_trace, draw_timeline, measured_bubble, timeline_title, write_trace

__all__ = ["Action", "KINDS", "SCHEDULES", "Schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zb_v",
           "dualpipe_v", "without_overlap",           "chunks_per_rank", "virtual_stage", "holder", "simulate", "GPTStage", "Stage", "StageSpec", "spec_for",
           "gpt_spec", "hf_gpt2_spec", "hf_llama_spec", "balanced_boundaries",
           "default_boundaries", "resolve_boundaries", "stage_params", "sync_tied_grads", "run_schedule",
           "RankTimeline", "chrome_trace", "draw_timeline", "measured_bubble", "timeline_title", "write_trace",
           "backward_input", "WeightGrad", "Pipeline", "PipelineConfig", "PipelineAborted"]
