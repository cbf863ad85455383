"""Pin each torchrun rank to its own block of physical CPU cores (``ab_trees.py --pin``).

Put this folder on ``PYTHONPATH`` and every Python process started with a ``LOCAL_RANK`` in its
environment (the ranks torchrun starts, not torchrun itself) restricts itself, before anything else
runs, to the ``1/LOCAL_WORLD_SIZE``-th block of the machine's physical cores (with their SMT
siblings), blocks in core order. Why: a host-bound call's time depends on where its rank runs; when
the scheduler moves ranks between cores, or puts two on one core's siblings, a row's median moves
between processes far more than between calls of one process. It works on any checkout (it is not
part of the package), so an A/B of two trees pins both alike.
"""

import os


def _physical_cores(allowed: set[int]) -> list[list[int]]:
    """Allowed CPUs grouped by physical core (SMT siblings together), in core order."""
    seen, cores = set(), []
    for cpu in sorted(allowed):
        if cpu in seen:
            continue
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            text = open(path).read().strip()
            siblings = set()
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                siblings.update(range(int(lo), int(hi or lo) + 1))
        except OSError:
            siblings = {cpu}
        group = sorted(siblings & allowed) or [cpu]
        seen.update(group)
        cores.append(group)
    return cores


def _pin() -> None:
    if "LOCAL_RANK" not in os.environ or not hasattr(os, "sched_setaffinity"):
        return
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = _physical_cores(os.sched_getaffinity(0))
    per = len(cores) // max(world, 1)
    if per < 1:
        return
    block = cores[rank * per:(rank + 1) * per]
    os.sched_setaffinity(0, {cpu for core in block for cpu in core})


_pin()
