"""A same-host board in shared memory: the ranks of a group exchange one small integer per call
(each rank reads every rank's) in microseconds, without a collective.

``auto`` must know, before it runs a call, the largest token count any rank of the group passes
and what kind of call each rank makes (so that every rank runs the same strategy). A CPU collective (gloo over loopback TCP) answers in
about a hundred microseconds, which is most of a decode-sized layer call; when every rank of the
group runs on one host, a page of shared memory answers as soon as the last rank has posted.

Layout: ``slots`` (2, W) int64, mapped by every rank from one file under ``/dev/shm`` (removed as
soon as all ranks have mapped it, so nothing outlives the processes). Call ``s`` (1, 2, ...; the
same sequence on every rank, as with any collective) writes ``(s << 32) | value`` into
``slots[s % 2, rank]``: one aligned 8-byte store, so a reader sees either the old word or the new
one, never a torn mix (also on ARM, where 8-byte aligned accesses are single-copy atomic), and no
ordering between two stores matters. A rank's result for call ``s`` is the row's values (rank
order) once every slot carries ``s``.

Why two rows are enough: a rank posts call ``s + 1`` only after its read of call ``s`` finished
(:meth:`HostBoard.post` first completes a read still pending). So when any rank has seen every
slot at ``s + 1``, every rank is done reading row ``s % 2``, and overwriting it with ``s + 2`` is
safe.
"""

from __future__ import annotations

import os
import time
import uuid

import torch
import torch.distributed as dist

from interlace.parallel.comm import host_identity

_SEQ_MASK = (1 << 31) - 1
_VALUE_MASK = (1 << 32) - 1


class HostBoard:
    """The board of one group (every rank of ``group`` builds it alike; a collective of ``group``).

    Use :meth:`create`, which returns None (on every rank alike) where the ranks are not all on
    one host or shared memory cannot be mapped; the caller then agrees over the group instead.
    """

    def __init__(self, page: torch.Tensor, rank: int, world: int, timeout_s: float):
        self.page = page  # (2W,) int64 mapped from the shared file; kept alive with the board
        self.slots = page.numpy().reshape(2, world)  # its (2, W) view for fast element access
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.seq = 0
        self._unread: int | None = None  # this rank's last posted call, until it is read
        self.last: tuple[int, tuple[int, ...]] | None = None  # (call, every rank's value) of the last call read

    @classmethod
    def create(cls, group, timeout_s: float) -> HostBoard | None:
        """The board for the CPU (gloo) ``group``, or None where it cannot serve."""
        usable = os.path.isdir("/dev/shm")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        identities = [None] * world
        dist.all_gather_object(identities, (usable, host_identity()), group=group)
        if not all(u for u, _ in identities) or len({h for _, h in identities}) != 1:
            return None
        box = [f"/dev/shm/interlace-board-{uuid.uuid4().hex}" if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        path = box[0]
        page, ok = None, True
        try:
            if rank == 0:
                with open(path, "wb") as f:
                    f.write(bytes(2 * world * 8))
        except OSError:
            ok = False
        dist.barrier(group=group)
        try:
            page = torch.from_file(path, shared=True, size=2 * world, dtype=torch.int64)
        except (OSError, RuntimeError):
            ok = False
        flags = [None] * world
        dist.all_gather_object(flags, ok, group=group)  # every rank mapped it: now the name can go
        if rank == 0:
            try:
                os.unlink(path)
            except OSError:
                pass
        if not all(flags):
            return None
        return cls(page, rank, world, timeout_s)

    def post(self, value: int) -> int:
        """Write this rank's ``value`` (0 ≤ value < 2³²) for the next call; returns its sequence
        number, for :meth:`wait`. The previous call is read first if it was not (it waits only
        where a rank has not posted that call yet)."""
        if not 0 <= value <= _VALUE_MASK:
            raise ValueError(f"HostBoard: value {value} out of [0, 2^32)")
        if self._unread is not None:  # keep "read s before posting s + 1" (module docstring)
            self._read(self._unread)
        self.seq = self.seq % _SEQ_MASK + 1
        self._unread = self.seq
        self.slots[self.seq & 1, self.rank] = (self.seq << 32) | value
        return self.seq

    def wait(self, seq: int, timeout_s: float | None = None) -> tuple[int, ...]:
        """Every rank's value (rank order) for call ``seq`` (the last one posted or the one
        before it) once every rank has posted it (spins, then yields; raises ``TimeoutError``
        after ``timeout_s``, default the board's)."""
        if self.last is not None and self.last[0] == seq:
            return self.last[1]
        if seq != self._unread:
            raise RuntimeError(f"HostBoard: call {seq} is neither the last posted ({self._unread}) nor the last read")
        return self._read(seq, timeout_s)

    def _read(self, seq: int, timeout_s: float | None = None) -> tuple[int, ...]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        row = self.slots[seq & 1]
        spins, start, deadline = 0, None, None
        while True:
            # (one aligned 8-byte load per word; Python ints: a handful of numpy ufuncs on a row
            # of W words cost several microseconds a call, most of the board's host time)
            words = row.tolist()
            if all(w >> 32 == seq for w in words):
                if seq == self._unread:
                    self._unread = None
                self.last = (seq, tuple(w & _VALUE_MASK for w in words))
                return self.last[1]
            spins += 1
            if spins >= 64:
                now = time.monotonic()
                if start is None:
                    start, deadline = now, now + timeout_s
                elif now > deadline:
                    missing = [r for r in range(self.world) if words[r] >> 32 != seq]
                    raise TimeoutError(f"HostBoard: rank {self.rank} waited {timeout_s:.0f} s for call {seq} "
                                       f"of ranks {missing} of the group (did they reach this layer call?)")
                # Spin briefly (ranks on their own cores post within microseconds), then yield the
                # core, then sleep: ranks can outnumber cores (CPU tests), and a spinning rank must
                # not starve the one it waits for.
                if now - start < 1e-3:
                    os.sched_yield()
                else:
                    time.sleep(5e-5)
