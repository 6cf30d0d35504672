"""Pipeline parallelism: schedules as data, stages of any block-sequential model, and the executor that runs a schedule."""

from .executor import run_schedule
from .schedule import KINDS, SCHEDULES, Action, gpipe, one_f_one_b, simulate
from .spec import StageSpec, gpt_spec, hf_gpt2_spec, hf_llama_spec, spec_for
from .stage import GPTStage, Stage, balanced_boundaries, default_boundaries, resolve_boundaries, stage_params, sync_tied_grads
from .step import Pipeline, PipelineConfig
from .timeline import RankTimeline, chrome_trace, draw_timeline, write_trace

__all__ = ["Action", "KINDS", "SCHEDULES", "gpipe", "one_f_one_b", "simulate", "GPTStage", "Stage", "StageSpec", "spec_for",
           "gpt_spec", "hf_gpt2_spec", "hf_llama_spec", "balanced_boundaries",
           "default_boundaries", "resolve_boundaries", "stage_params", "sync_tied_grads", "run_schedule",
           "RankTimeline", "chrome_trace", "draw_timeline", "write_trace", "Pipeline", "PipelineConfig"]
