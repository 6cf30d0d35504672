"""Times and byte counts as a person reads them: "48.3 ms", "2.66 GB", never "0.01" or 2660000000.

Bytes are decimal (1 GB = 10^9 bytes), like the cluster's ``--memory-gb`` and its link rates in
GB/s, so a layout's memory compares with the card's size at a glance. Four significant digits:
enough to tell apart layouts whose step times differ by a tenth of a percent.
"""

from __future__ import annotations

import math

_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
_BYTE_UNITS = (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0))
_COUNT_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0))


def seconds(value: float) -> str:
    """A duration in the largest of s, ms, us, ns that keeps it >= 1: seconds(0.0483) == "48.3 ms"."""
    return _scaled(value, _TIME_UNITS, "s")


def size(value: float) -> str:
    """A byte count in the largest of PB, TB, GB, MB, KB, B that keeps it >= 1: size(2.66e9) == "2.66 GB"."""
    return _scaled(value, _BYTE_UNITS, "B")


def count(value: float) -> str:
    """A count (parameters) in T, B, M, K: count(124_439_808) == "124.4M"."""
    return _scaled(value, _COUNT_UNITS, "").replace(" ", "")


def _scaled(value: float, units: tuple[tuple[str, float], ...], base: str) -> str:
    if value == 0 or not math.isfinite(value):
        return f"{value:g} {base}".rstrip()
    i = next((i for i, (_, f) in enumerate(units) if abs(value) >= f), len(units) - 1)  # below the smallest: in it
    if i > 0 and abs(float(f"{value / units[i][1]:.4g}")) >= 1000:
        i -= 1  # 999.96 rounds to "1000" at four digits: that is 1 of the next unit
    name, factor = units[i]
    number = value / factor
    # .4g writes 1234.5 as "1234" but 12345 as "1.234e+04": past 9999 (only in the largest unit) use digits
    return f"{number:.4g} {name}" if abs(number) < 1e4 else f"{number:.0f} {name}"
