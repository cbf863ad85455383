"""The order of competitors within rounds of interleaved timing (the bench's ``--interleave``,
``auto``'s calibration).

A GPU-bound call's time depends on the call right before it: on one H200 the same dsv3-like
forward + backward ran 5% faster right after a less power-dense call than right after itself.
Round after round in one fixed order, each competitor always follows the same one, and that
bias stays in every median. :func:`round_order` gives each round an order from a Williams
design instead, so that over a period of rounds each competitor follows each other one equally
often.
"""

from __future__ import annotations


def round_order(items: list, i: int) -> list:
    """Round ``i``'s order of ``items``: round 0 in the given order, then the rows of a Williams
    design (for an even count n, over n rounds each item comes right after each other item
    exactly once within a round; for an odd count over 2n rounds, twice)."""
    n = len(items)
    if n < 3:
        return list(items)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n−1, 2, n−2, …
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = [(x + i) % n for x in first]
    if n % 2 and (i // n) % 2:
        row.reverse()
    label = {x: j for j, x in enumerate(first)}  # (relabelled so that round 0 is the given order)
    return [items[label[x]] for x in row]
