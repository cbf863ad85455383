"""What the persistent kernels of both world sizes and their launchers agree on: the layout of
a rank's state words, the wait kinds and the error record, the first task number of each task
kind, the activation codes, and the bounded wait every task uses.

State (one int32 tensor per rank, kept across calls, never shared with a peer)::

    [0, STATE_HEAD)                 head words, :class:`Word` (the same index at either world
                                    size; a word a world size has no task for stays 0)
    [STATE_HEAD, STATE_HEAD + MT)   per-row-tile GEMM0 counters (MT: the call's row tile bound)
    the last ERROR_WORDS            the error record of the first timed-out wait

The flags (``INDEX_FLAG``, ``READY``, ``EPOCH``) hold epochs and are never reset; the counters
are zeroed by the last program to leave the launch that ends a call.

Task ranges. Tasks are numbered kind by kind (:class:`Kind`: logits, gate, index, send,
receive, GEMM0, GEMM1, combine; world size 1 has no logits, send or receive task). The kernel
needs each kind's first number at run time (to decode a task number) and the host needs them
for the grid, the timeline's size and the phases of the simulated transports: both call
:func:`kind_starts`, a Triton function of integer sums that the host runs as plain Python
(``kind_starts.fn``), so there is one source for the numbering.
"""

from __future__ import annotations

import enum

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from interlace.kernels.comet.flags import record_error_fields


class Word(enum.IntEnum):
    """Index of each head word of a rank's state."""

    EPOCH = 0  # calls finished; a call's epoch is this + 1
    QUEUE = 1  # the next task number to hand out (relative to the launch's first task)
    DONE = 2  # programs that left their loop
    GATE_DONE = 3  # gate tasks finished
    SEND_DONE = 4  # send tasks finished (W > 1)
    INDEX_FLAG = 5  # the index task's flag: the call's epoch once the index is written
    RECV_DONE = 6  # receive tasks finished (W > 1)
    READY = 7  # the tile table's flag (W > 1): the epoch once every source's rows arrived
    N_TILES = 8  # the call's real number of row tiles
    GEMM1_DONE = 9  # GEMM1 tasks finished
    LOGITS_DONE = 10  # logits tasks finished (W > 1)


STATE_HEAD = 16  # head words (room for more, so the per-tile counters do not move)
ERROR_WORDS = 8  # [set, rank, wait kind, task, what (tile or peer rank), value, target, epoch]


class Wait(enum.IntEnum):
    """What a timed-out wait was for (the error record's kind)."""

    GATE = 1
    INDEX = 2
    SENT = 3
    READY = 4
    GEMM0 = 5
    DONE = 6
    LOGITS = 7
    GEMM1 = 8


_WAIT_NAMES = {
    Wait.LOGITS: "its logits tasks' counter (a gate task waits for every logits task)",
    Wait.GATE: "its gate tasks' counter (the index task waits for every gate task)",
    Wait.INDEX: "its index flag (expert offsets, slots and the row list)",
    Wait.SENT: "the dispatch flag of source rank {what} (rows and counts sent here)",
    Wait.READY: "its tile table (built after every source's rows arrived)",
    Wait.GEMM0: "a row tile's GEMM0 counter (tile {what}: a GEMM1 task waits for every K-slice of its tile)",
    Wait.GEMM1: "the GEMM1 counter (a combine task waits for every GEMM1 task of a real tile)",
    Wait.DONE: "the return flag of owner rank {what} (expert outputs returned here)",
}


class Kind(enum.IntEnum):
    """Task kinds, in task-number order (also the timeline's record kinds at W > 1)."""

    LOGITS = 0
    GATE = 1
    INDEX = 2
    SEND = 3
    RECEIVE = 4
    GEMM0 = 5
    GEMM1 = 6
    COMBINE = 7


class Activation(enum.IntEnum):
    """The kernels' ACTIVATION codes (those of :mod:`interlace.kernels.expert_gemm.tile`)."""

    SWIGLU = 0
    GELU = 1
    RELU = 2
    PLAIN = 3  # no activation: the plain product (GEMM1's tiles)


# The same numbers as constexprs: a Triton kernel reads only constexpr globals.
EPOCH, QUEUE, DONE, GATE_DONE, SEND_DONE, INDEX_FLAG, RECV_DONE, READY, N_TILES, GEMM1_DONE, LOGITS_DONE = (
    tl.constexpr(int(w)) for w in Word)
HEAD = tl.constexpr(STATE_HEAD)
WAIT_GATE, WAIT_INDEX, WAIT_SENT, WAIT_READY, WAIT_GEMM0, WAIT_DONE, WAIT_LOGITS, WAIT_GEMM1 = (
    tl.constexpr(int(w)) for w in Wait)
PLAIN = tl.constexpr(int(Activation.PLAIN))


def state_words(max_tiles: int) -> int:
    """int32 words of a rank's state with per-tile counters for ``max_tiles`` row tiles."""
    return STATE_HEAD + max_tiles + ERROR_WORDS


def state_views(state):
    """(head, per-tile GEMM0 counters, error record) views of a state tensor (see the module)."""
    return state[:STATE_HEAD], state[STATE_HEAD:-ERROR_WORDS], state[-ERROR_WORDS:]


def describe_error(record: list[int]) -> str | None:
    """The message of an error record (:data:`ERROR_WORDS` words), or None if no wait timed out."""
    if not record or record[0] == 0:
        return None
    _, rank, kind, task, what, value, target, epoch = record[:ERROR_WORDS]
    waited = _WAIT_NAMES.get(kind, f"wait kind {kind}").format(what=what)
    return (f"persistent MoE kernel, rank {rank}: task {task} timed out waiting for {waited}: value {value}, "
            f"expected ≥ {target} (call epoch {epoch}); a peer did not run the same call, the task or phase order "
            f"is broken, or a program stopped (raise max_spins if the GPU is only slow)")


@triton.jit
def kind_starts(n_logits, n_gate, n_send, n_receive, n_gemm0, n_gemm1, n_combine):
    """The first task number of each kind after LOGITS (whose first is 0), and the total:
    (gate, index, send, receive, GEMM0, GEMM1, combine, total). Integer sums only: the host
    runs this same source as ``kind_starts.fn`` (see the module)."""
    gate = n_logits
    index = gate + n_gate
    send = index + 1
    receive = send + n_send
    gemm0 = receive + n_receive
    gemm1 = gemm0 + n_gemm0
    combine = gemm1 + n_gemm1
    return gate, index, send, receive, gemm0, gemm1, combine, combine + n_combine


@triton.jit
def record_timeout(err_ptr, host_err_ptr, rank, kind, task, what, value, target, epoch):
    """A timed-out wait's error record, if it is the first: claimed on the device (the record
    other waits poll), then written there and into its host mirror."""
    if tl.atomic_cas(err_ptr, 0, 1) == 0:
        record_error_fields(err_ptr, rank, kind, task, what, value, target, epoch)
        record_error_fields(host_err_ptr, rank, kind, task, what, value, target, epoch)
        tl.store(host_err_ptr, 1)


@triton.jit
def wait_at_least(ptr, target, max_spins, timeout_ns, err_ptr, host_err_ptr, me, task, kind, what, epoch,
                  SCOPE: tl.constexpr, CLOCK: tl.constexpr):
    """Acquire-poll ``*ptr`` (at ``SCOPE``) until ≥ ``target``; False after ``max_spins`` polls,
    after ``timeout_ns`` of the GPU's global timer (``CLOCK``; the interpreter has no timer), or
    once another wait timed out. The first timed-out wait writes the error record
    [1, me, kind, task, what, value, target, epoch], on the device and into its host mirror.

    The time bound is what matters across ranks: a peer's launch can be seconds late (its host
    compiling a kernel specialization this rank has cached), and a poll of system-scope memory
    takes a time no poll count can promise."""
    value = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    spins = 0
    if CLOCK:
        start = globaltimer()
    while (value < target) & (spins < max_spins):
        value = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
        spins += 1
        if CLOCK:
            if globaltimer() - start > timeout_ns:
                spins = max_spins
        if tl.load(err_ptr, volatile=True) != 0:
            spins = max_spins
    ok = value >= target
    if not ok:
        record_timeout(err_ptr, host_err_ptr, me, kind, task, what, value, target, epoch)
    return ok
