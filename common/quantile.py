"""The one percentile definition of phaselens: linear interpolation between closest ranks.

For an ascending list x[0..n−1] and q in [0, 1]:

    h = q · (n − 1),   quantile(q) = x[⌊h⌋] + (h − ⌊h⌋) · (x[⌊h⌋ + 1] − x[⌊h⌋])

This is Hyndman & Fan's definition 7, numpy's default (`method="linear"`), and exactly what
ClickHouse's `quantileExactInclusive` computes, so a p99 from the server's span attributes, from the
client's, from `phaselens bench` and from the SQL of `phaselens budget` agree on the same values.
"""

from __future__ import annotations

from collections.abc import Sequence

INF = float("inf")


def quantile(sorted_values: Sequence[float], q: float) -> float | None:
    """Quantile `q` of an ascending list (formula above); None for an empty list. An infinite
    neighbour makes the result infinite (no inf − inf = nan): failures counted as +∞ stay +∞."""
    if not sorted_values:
        return None
    h = q * (len(sorted_values) - 1)
    lo = int(h)
    hi = min(lo + 1, len(sorted_values) - 1)
    a, b = sorted_values[lo], sorted_values[hi]
    if a == b or h == lo:
        return a
    if b == INF:
        return b
    return a + (b - a) * (h - lo)
