"""Opt-in per-work-item timeline of the fused kernels (``FusedStrategy(timeline=True)``).

With the kernels' constexpr ``TIMELINE`` off (0, the default) every helper below compiles to
nothing. On, every work item a program executes writes one record of 8 int64 into a slot of
its own — no atomic cursor: a work item is claimed exactly once, so its index is its slot:

    layer0: send tile ``task`` → slot ``task``; GEMM0 item ``work`` → ``n_send + work``
    layer1: GEMM1 item ``work`` → slot ``work``; combine task → ``n_gemm1 + task``; push mode's
            push of item ``p`` → ``n_gemm1 + n_combine + p``

Record: ``[epoch, program id, SM id, kind, item, start, waited, end]``. ``waited`` is the
time the item's flag wait ended (= ``start`` for items that do not wait), so ``waited −
start`` is the wait and ``end − waited`` the work. The epoch tells this call's records from
stale ones of earlier calls (slots are reused, never cleared).

Clocks (``TIMELINE`` value): 1 = the GPU's ``%globaltimer`` (ns, one clock for all SMs;
its update granularity is hardware dependent, about 1 µs on some parts) and ``%smid``;
2 = a logical clock for the Triton interpreter, where inline asm does not run: an atomic
counter bumped at every reading (monotone, so start ≤ waited ≤ end holds), SM id −1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer, smid

from interlace.kernels.launch import cdiv

# gemm1: a GEMM1 tile whose rows' home is this rank; gemm1_remote: home elsewhere (its output
# crosses NVLink from this program).
KINDS = ("send", "gemm0_local", "gemm0_remote", "gemm1", "combine", "gemm1_remote")
KIND_SEND = tl.constexpr(0)
KIND_GEMM0_LOCAL = tl.constexpr(1)
KIND_GEMM0_REMOTE = tl.constexpr(2)
KIND_GEMM1 = tl.constexpr(3)
KIND_COMBINE = tl.constexpr(4)
KIND_GEMM1_REMOTE = tl.constexpr(5)
FIELDS = ("epoch", "pid", "sm", "kind", "item", "start", "waited", "end")
CLOCK_GPU, CLOCK_LOGICAL = 1, 2


@triton.jit
def timeline_now(clock_ptr, TIMELINE: tl.constexpr):
    """The clock (int64) of the chosen mode; 0 when the timeline is off."""
    if TIMELINE == 1:
        return globaltimer()
    elif TIMELINE == 2:
        return tl.atomic_add(clock_ptr, 1, sem="relaxed").to(tl.int64)
    else:
        return tl.zeros((), dtype=tl.int64)


@triton.jit
def timeline_record(rec_ptr, cap, slot, epoch, pid, kind, item, start, waited, end, TIMELINE: tl.constexpr):
    """Store one record into ``rec_ptr[slot]`` (a (cap, 8) int64 table) if ``slot < cap``."""
    if TIMELINE != 0:
        if TIMELINE == 1:
            sm = smid().to(tl.int64)
        else:
            sm = tl.full((), -1, tl.int64)
        f = tl.arange(0, 8)
        # One 8-wide store; the integer operands promote to int64 through the selects.
        v = tl.where(f == 0, epoch, tl.where(f == 1, pid, tl.where(f == 2, sm, tl.where(f == 3, kind, tl.where(
            f == 4, item, tl.where(f == 5, start, tl.where(f == 6, waited, end)))))))
        tl.store(rec_ptr + slot.to(tl.int64) * 8 + f, v, mask=(f < 8) & (slot < cap))


class TimelineBuffer:
    """Device storage of one rank's records: header (clock counter) + layer0 + layer1 slots.

    Sized per call from the plan's bounds (:meth:`args`); it only grows, so the records of
    the last call stay readable after it (:meth:`records`, one host sync).
    """

    def __init__(self, device: torch.device, mode: int):
        self.device, self.mode = device, mode
        self.cap0 = self.cap1 = 0
        self.data = torch.zeros(1, 8, dtype=torch.int64, device=device)

    def ensure(self, cap0: int, cap1: int) -> None:
        if cap0 > self.cap0 or cap1 > self.cap1:
            self.cap0, self.cap1 = max(cap0, self.cap0), max(cap1, self.cap1)
            self.data = torch.zeros(1 + self.cap0 + self.cap1, 8, dtype=torch.int64, device=self.device)

    def args(self, layer: int) -> tuple:
        """``(records, clock, cap, TIMELINE)`` for the launcher of ``layer`` (0 or 1)."""
        clock = self.data[0]
        if layer == 0:
            return self.data[1:1 + self.cap0], clock, self.cap0, self.mode
        return self.data[1 + self.cap0:], clock, self.cap1, self.mode

    def records(self, epoch: int) -> list[dict]:
        """This call's records (host sync: copies the buffer), times relative to the call's
        first start, sorted by (layer, slot). Each: layer, kind (name), pid, sm, item, start,
        waited, end (ns on GPUs, ticks under the interpreter)."""
        data = self.data.cpu()
        out = []
        for layer, rows in ((0, data[1:1 + self.cap0]), (1, data[1 + self.cap0:])):
            for r in rows[rows[:, 0] == epoch].tolist():
                out.append({"layer": layer, **{k: v for k, v in zip(FIELDS[1:], r[1:])}})
        t0 = min((r["start"] for r in out), default=0)
        for r in out:
            r["kind"] = KINDS[r["kind"]]
            for k in ("start", "waited", "end"):
                r[k] -= t0
        return out


    def task_records(self, epoch: int, kinds: tuple[str, ...]) -> list[dict]:
        """One table of task records (the persistent kernels: ``ensure(n_tasks, 0)``, slot = task
        number): this call's records (host sync), sorted by task, each ``kind`` (its name in
        ``kinds``), ``pid``, ``sm``, ``task``, ``start``, ``waited``, ``end``, times relative to the
        call's first start (ns on GPUs, ticks under the interpreter)."""
        data = self.data[1:1 + self.cap0].cpu()
        rows = data[data[:, 0] == epoch].tolist()
        t0 = min((r[5] for r in rows), default=0)
        return [{"kind": kinds[r[3]], "pid": r[1], "sm": r[2], "task": r[4], "start": r[5] - t0,
                 "waited": r[6] - t0, "end": r[7] - t0} for r in rows]


def layer_capacities(plan, n_blocks0: int, n_slices: int, tokens: int, block_t: int) -> tuple[int, int]:
    """Upper bounds of the work items of layer0 (send tiles + GEMM0 items) and layer1 (GEMM1
    items + combine tasks + push mode's pushes) of a call, from the plan's tile-list sizes (host
    ints, no sync)."""
    send_max, recv_max = plan.send_tiles[3], plan.recv_tiles[3]
    return send_max + recv_max * n_blocks0, n_slices * (2 * recv_max + cdiv(max(tokens, 1), block_t))
