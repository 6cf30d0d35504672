"""A progress line for long searches: silent for short ones, then how far, how long, and an ETA.

`minipar.plan.plan(..., progress=Progress(...))` calls it after each layout it predicts. Nothing is
written until ``after`` seconds have passed (a search of a few seconds stays quiet); then at most one
line every ``every`` seconds, and a closing line once the search is done. On a terminal the line is
rewritten in place (carriage return); into a file or a pipe each update is its own line. It writes to
stderr by default, so ``--json`` on stdout stays parseable.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from .readable import seconds


class Progress:
    """Call with (layouts done, layouts in all); the ETA assumes the rest take as long on average as
    those done (cache hits make later layouts cheaper, so it errs long)."""

    def __init__(self, what: str, after: float = 3.0, every: float = 1.0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not after >= 0 or not every >= 0:  # nan fails both comparisons
            raise ValueError(f"progress after={after!r} and every={every!r} must be seconds >= 0 (inf: never)")
        self.what, self.after, self.every, self.clock = what, after, every, clock
        self.stream = stream if stream is not None else sys.stderr
        self.start = clock()
        self.last_shown: float | None = None  # when the last line was written (None: not yet)

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        elapsed = now - self.start
        if elapsed < self.after:
            return
        if done < total and self.last_shown is not None and now - self.last_shown < self.every:
            return
        if done < total:
            eta = elapsed * (total - done) / max(done, 1)
            line = (f"{self.what}: {done}/{total} layouts ({done / total:.0%}), {seconds(elapsed)} so far, "
                    f"ETA {seconds(eta)}")
        else:
            line = f"{self.what}: {total} layouts in {seconds(elapsed)}"
        terminal = self.stream.isatty()
        end = "\n" if done >= total or not terminal else ""
        self.stream.write(("\r\033[K" if terminal else "") + line + end)
        self.stream.flush()
        self.last_shown = now
