"""Pipeline parallelism. For now: schedules as data (`schedule.py`); the executor and stages come next."""

from .schedule import KINDS, SCHEDULES, Action, gpipe, one_f_one_b, simulate

__all__ = ["Action", "KINDS", "SCHEDULES", "gpipe", "one_f_one_b", "simulate"]
