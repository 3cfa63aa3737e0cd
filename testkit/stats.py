"""The one percentile definition of the tests, benchmarks and load tests."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q from 0 to 100) of `values`, by linear interpolation between the closest ranks:
    numpy's default (`method="linear"`, Hyndman and Fan's type 7, Excel's PERCENTILE.INC). With the n values
    sorted as v[0] <= ... <= v[n-1], the rank is h = (n - 1) * q / 100 and the result
    v[floor(h)] + (h - floor(h)) * (v[floor(h) + 1] - v[floor(h)]): the 0th is the minimum, the 100th the
    maximum, the 50th the median. NaN when there are no values; ValueError when q is outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be within [0, 100], not {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    if rank == lo:  # on a rank (also keeps an infinite value from turning into nan)
        return ordered[lo]
    return ordered[lo] + (ordered[lo + 1] - ordered[lo]) * (rank - lo)
