"""Running a schedule on paper: `simulate` checks a `Schedule` (every micro-batch and chunk computed
once, in dependency order, messages matched, no deadlock), counts the activations each rank holds
and times a step with given action costs, giving the bubble as an exact fraction. No process is
involved: the tests prove every schedule in `minipar.pipeline.schedule` this way.
"""

from __future__ import annotations

from fractions import Fraction

from .actions import KINDS, RECEIVES, Action, carries, holder, virtual_stage


def simulate(schedule: list[list[Action]], costs: dict | None = None) -> dict:
    """Run a schedule on paper: check it, count its live activations and time it.

    Each rank runs its list in order. A send is buffered (one FIFO per sending rank, receiving rank and
    kind) and costs nothing; a receive waits for its message, which must be the micro-batch and chunk
    it names; a posted receive (IRECV_ACT, IRECV_GRAD) takes its place in that FIFO when the rank
    reaches it, and only the F (B) that needs its message waits for it, so a rank computes on
    while it is in flight. Checked: every (micro-batch, chunk) runs F once, then B once, then W once if the
    schedule has any W (none otherwise), on every rank; F only after its activation arrived (or on
    the first virtual stage), B only after its output gradient arrived (or on the last); a send only
    after the compute that makes it; no deadlock; no message left unreceived.

    ``schedule``: a `Schedule`, or a plain list of per-rank lists (then "interleaved" placement with
    as many chunks as the actions name). ``costs``: time per action, e.g. {"F": 1, "B": 1, "W": 1};
    default F=1, B=2 (F=1, B=1, W=1 when the backward is split), divided by the chunks per rank so
    that every schedule gives a rank the same total work. An action starts when the rank is free and,
    for a receive, when its message was sent.

    Returns {"order": [(rank, action), ...] in one valid execution order,
    "chunks": model chunks per rank,
    "peak_live": [most (micro-batch, chunk) activations held at once, per rank] (held from F until W
        if the backward is split, else until B),
    "peak_live_stages": the same in units of a full stage (peak_live / chunks, a Fraction),
    "timeline": [[(str(action), start, end) of each F/B/W], per rank],
    "busy": [compute time per rank], "makespan": when the last rank finishes,
    "bubble": 1 - sum(busy) / (ranks * makespan), the idle share of the step,
    "bubble_in_span": 1 - sum(busy) / (sum over ranks of last end - first start): the idle share
        inside each rank's own span, 0 for a parallelogram (the zero-bubble papers' measure, for
        steps that overlap at the ramps)}.
    Times are Fractions when the costs are whole or Fractions. Raises ValueError on a deadlock, a
    receive that gets another micro-batch or chunk than it names, or any check above broken.
    """
    ranks = len(schedule)
    chunks = getattr(schedule, "chunks", None) or 1 + max((a.chunk for acts in schedule for a in acts), default=0)
    placement = getattr(schedule, "placement", "interleaved")
    last_vstage = ranks * chunks - 1
    split = any(a.kind == "W" for acts in schedule for a in acts)
    if costs is None:
        costs = {"F": 1, "B": 1, "W": 1} if split else {"F": 1, "B": 2}
        costs = {k: Fraction(c, chunks) for k, c in costs.items()}
    elif not {"F", "B"} | ({"W"} if split else set()) <= set(costs):
        raise ValueError(f"costs={costs} needs a time for each of F, B" + (", W" if split else ""))

    pos, clock = [0] * ranks, [Fraction(0)] * ranks
    channels: dict[tuple[int, int, str], list[tuple[int, int, Fraction]]] = {}  # FIFO of (mb, to vstage, sent at)
    done = [{k: set() for k in ("F", "B", "W", "RECV_ACT", "RECV_GRAD")} for _ in range(ranks)]
    posted: list[list[Action]] = [[] for _ in range(ranks)]  # each rank's posted receives not matched yet
    arrived: list[dict] = [{} for _ in range(ranks)]           # ("ACT" | "GRAD", mb, chunk) -> sent at
    live, peak = [set() for _ in range(ranks)], [0] * ranks
    timeline: list[list[tuple]] = [[] for _ in range(ranks)]
    order = []

    def step(r: int, a: Action) -> bool:
        """Run ``a`` on rank r; False if it is a receive whose message is not there yet."""
        if not 0 <= a.chunk < chunks or a.kind not in KINDS:
            raise ValueError(f"rank {r}: {a} is not an action of a {chunks}-chunk schedule")
        k, mine = virtual_stage(r, a.chunk, ranks, placement), (a.microbatch, a.chunk)
        has = done[r]
        if a.kind in RECEIVES:
            if a.kind.startswith("I"):  # posted: matched now if its message is there, else later
                posted[r].append(a)
                settle(r)
            elif any(carries(b.kind) == carries(a.kind) and src_rank(r, b) == src_rank(r, a) for b in posted[r]):
                return False  # an earlier posted receive on this channel takes the next message first
            elif not match(r, a):
                return False  # blocked
            else:
                clock[r] = max(clock[r], arrived[r][(carries(a.kind), a.microbatch, a.chunk)])
        elif a.kind in ("SEND_ACT", "SEND_GRAD"):
            dst = k + 1 if a.kind == "SEND_ACT" else k - 1
            if not 0 <= dst <= last_vstage:
                raise ValueError(f"rank {r}: {a} has no peer (virtual stage {k} of 0..{last_vstage})")
            if mine not in has["F" if a.kind == "SEND_ACT" else "B"]:
                raise ValueError(f"rank {r} runs {a} before computing it")
            channels.setdefault((r, holder(dst, ranks, placement)[0], a.kind[5:]), []).append(
                (a.microbatch, dst, clock[r]))
        else:
            needs = {"F": ("RECV_ACT", k > 0), "B": ("F", True), "W": ("B", True)}[a.kind]
            if mine in has[a.kind]:
                raise ValueError(f"rank {r} runs {a} twice")
            settle(r)
            waits = {"F": ("ACT", k > 0), "B": ("GRAD", k < last_vstage)}.get(a.kind)
            if waits and waits[1] and any(b.kind == "IRECV_" + waits[0] and (b.microbatch, b.chunk) == mine
                                          for b in posted[r]):
                return False  # its posted receive's message has not come yet
            if needs[1] and mine not in has[needs[0]]:
                raise ValueError(f"rank {r} runs {a} before its {'input' if a.kind == 'F' else needs[0]}")
            if a.kind == "B" and k < last_vstage and mine not in has["RECV_GRAD"]:
                raise ValueError(f"rank {r} runs {a} before its output gradient arrived")
            has[a.kind].add(mine)
            if a.kind == "F":
                live[r].add(mine)
                peak[r] = max(peak[r], len(live[r]))
            elif a.kind == ("W" if split else "B"):
                live[r].discard(mine)
            if waits and waits[1]:
                clock[r] = max(clock[r], arrived[r][(waits[0], a.microbatch, a.chunk)])
            start = clock[r]
            clock[r] += costs[a.kind]
            timeline[r].append((str(a), start, clock[r]))
        order.append((r, a))
        return True

    def src_rank(r: int, a: Action) -> int:
        k = virtual_stage(r, a.chunk, ranks, placement)
        src = k - 1 if carries(a.kind) == "ACT" else k + 1
        if not 0 <= src <= last_vstage:
            raise ValueError(f"rank {r}: {a} has no peer (virtual stage {k} of 0..{last_vstage})")
        return holder(src, ranks, placement)[0]

    def match(r: int, a: Action) -> bool:
        """Take receive ``a``'s message off its channel, if there; check it is the one ``a`` names."""
        what, k = carries(a.kind), virtual_stage(r, a.chunk, ranks, placement)
        queue = channels.get((src_rank(r, a), r, what), [])
        if not queue:
            return False
        mb, to, sent = queue.pop(0)
        if (mb, to) != (a.microbatch, k):
            got = f"micro-batch {mb}" + (f" for virtual stage {to}" if chunks > 1 else "")
            raise ValueError(f"rank {r} expected {a} but the channel delivers {got}")
        arrived[r][(what, a.microbatch, a.chunk)] = sent
        done[r]["RECV_" + what].add((a.microbatch, a.chunk))
        return True

    def settle(r: int) -> None:
        """Match rank r's posted receives whose messages have come, in the order they were posted."""
        stuck = set()  # channels with an earlier unmatched receive: a later one must not overtake it
        for a in list(posted[r]):
            channel = (src_rank(r, a), carries(a.kind))
            if channel not in stuck and match(r, a):
                posted[r].remove(a)
            else:
                stuck.add(channel)

    while any(pos[r] < len(schedule[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while pos[r] < len(schedule[r]) and step(r, schedule[r][pos[r]]):
                pos[r] += 1
                progressed = True
        if not progressed:
            waiting = {r: str(schedule[r][pos[r]]) for r in range(ranks) if pos[r] < len(schedule[r])}
            raise ValueError(f"deadlock: every unfinished rank waits on a receive: {waiting}")
    unmatched = {r: [str(a) for a in posted[r]] for r in range(ranks) if posted[r]}
    if unmatched:
        raise ValueError(f"receives posted but never matched: {unmatched}")
    leftovers = {k: v for k, v in channels.items() if v}
    if leftovers:
        raise ValueError(f"messages sent but never received: {leftovers}")
    m = 1 + max((a.microbatch for acts in schedule for a in acts), default=-1)
    every = {(i, c) for i in range(m) for c in range(chunks)}
    for r in range(ranks):
        for kind in ("F", "B", "W") if split else ("F", "B"):
            if done[r][kind] != every:
                missing = sorted(every - done[r][kind])
                raise ValueError(f"rank {r} never runs {kind} for (micro-batch, chunk) {missing}")

    busy = [sum((end - start for _, start, end in row), Fraction(0)) for row in timeline]
    makespan = max(clock, default=Fraction(0))
    spans = sum((row[-1][2] - row[0][1] for row in timeline if row), Fraction(0))
    work = sum(busy)
    return {"order": order, "chunks": chunks, "peak_live": peak,
            "peak_live_stages": [Fraction(n, chunks) for n in peak], "timeline": timeline,
            "busy": busy, "makespan": makespan,
            "bubble": 1 - work / (ranks * makespan) if makespan else Fraction(0),
            "bubble_in_span": 1 - work / spans if spans else Fraction(0)}

