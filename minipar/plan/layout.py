"""A layout the planner predicts: its axes, data-parallel strategy, micro-batch and recomputation, and
its name (``tp4.pp2.dp4.cp2.ep1.zero3.mbs1.norc``, which `Layout.parse` reads back); the strategies
it tries."""

from __future__ import annotations

from dataclasses import dataclass

from ..data_parallel.strategy import planned_strategies
from . import formulas as F


def strategies() -> tuple[str, ...]:
    """The data-parallel strategies the planner tries: every registered one that declared what it shards
    (`minipar.data_parallel.strategy.register_strategy`), then "hsdp": the strategy that shards the
    parameters too, sharded within a node and replicated across (a mesh, not a registered name)."""
    return planned_strategies() + ("hsdp",)


def hsdp_strategy() -> str:
    """The registered strategy "hsdp" stands for: the first that shards the parameters (zero3)."""
    return next(s for s in planned_strategies() if "params" in F.shards(s))


def registered(strategy: str) -> str:
    """A layout's strategy as registered: "hsdp" read as `hsdp_strategy`, any other as it is."""
    return hsdp_strategy() if strategy == "hsdp" else strategy


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    strategy: str = "zero1"
    micro_batch: int = 1
    recompute: bool = False

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "cp", "ep", "micro_batch"):
            positive_int(f"layout {key}", getattr(self, key))
        if self.strategy not in strategies():
            raise ValueError(f"layout strategy {self.strategy!r}; choose one of {', '.join(strategies())}")

    @property
    def name(self) -> str:
        return (f"tp{self.tp}.pp{self.pp}.dp{self.dp}.cp{self.cp}.ep{self.ep}.{self.strategy}."
                f"mbs{self.micro_batch}.{'rc' if self.recompute else 'norc'}")

    @classmethod
    def parse(cls, name: str) -> "Layout":
        """The inverse of ``name``: "tp8.pp16.dp8.cp1.ep1.zero1.mbs1.norc" (missing axes default to 1)."""
        fields: dict = {}
        for part in name.split("."):
            for key in ("tp", "pp", "dp", "cp", "ep", "mbs"):
                if part.startswith(key) and part[len(key):].isdigit():
                    fields["micro_batch" if key == "mbs" else key] = int(part[len(key):])
                    break
            else:
                if part in strategies():
                    fields["strategy"] = part
                elif part in ("rc", "norc"):
                    fields["recompute"] = part == "rc"
                else:
                    raise ValueError(f"cannot read {part!r} in layout {name!r}; write e.g. "
                                     "tp8.pp16.dp8.cp1.ep1.zero1.mbs1.norc")
        if "tp" not in fields or "pp" not in fields or "dp" not in fields:
            raise ValueError(f"layout {name!r} must give tp, pp and dp (e.g. tp8.pp16.dp8.zero1)")
        return cls(**fields)


def positive_int(what: str, value) -> None:
    """ValueError unless ``value`` is an int >= 1 (a bool is not), naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}={value!r} must be a positive integer")
