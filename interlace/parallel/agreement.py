"""What the ranks of an expert-parallel group agree on before a call, on the host.

A strategy whose choice depends on every rank's call (``auto`` picks a strategy from the group's
largest token count; ``persistent`` at W > 1 must not launch a call some rank cannot run) posts,
once per call, this rank's token count and the kind of its call (:class:`CallKind`: training or
inference, routed inside the strategy or routed by the layer), and reads every rank's post.

Where the ranks can part, and what the agreement does about it:

* **Mode.** A training call (an autograd graph whose backward runs collectives) on one rank
  and an inference call on another would run different programs: every rank raises, naming
  the ranks of each kind.
* **Routing.** A call routed inside the strategy (``forward_layer``, e.g. ``persistent``'s
  kernel) on one rank and routed by the layer on another (``expert_indices`` given, or a balance
  loss to compute) would run different strategies: every rank raises, naming them. A rank with
  no tokens has nothing to route: it posts no preference and follows the group
  (:meth:`CallAgreement.routed`; where no rank has tokens, each takes its strategy's own way,
  the same on every rank), so ``expert_indices`` on the ranks that have tokens and none on a rank
  that has none is fine.
* **Tokens.** The group's largest count is what every rank keys its choice on.

Every rank reads the same row, so every rank reaches the same result or raises the same error
(the counter's sequence stays in step either way). Waits are bounded (``timeout_s``): a peer
that never posts makes the wait raise, naming the rank, the layer and the call.

The counter behind it (:func:`group_counter`) is shared by every layer over the same ranks: the
shared-memory board (:class:`~interlace.parallel.host_board.HostBoard`: a post is one store, a
read a few loads) where every rank runs on one host, else an asynchronous ``all_gather`` on a
gloo side channel (:func:`side_channel`). Neither touches a GPU stream.

Nothing here keeps a process group past ``destroy_process_group``: the side channels (groups
interlace makes itself, which torch destroys with the rest) and every holder's group are held
weakly (:class:`~interlace.parallel.comm.WeakGroupAttribute`), and a counter's collective still
pending when its group goes is dropped with it (:class:`GroupValues`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from interlace.parallel.comm import ExpertParallel, WeakGroupAttribute, hold_group
from interlace.parallel.host_board import HostBoard
from interlace.parallel.peer_buffer import on_release

TOKEN_BITS = 28  # a posted word: the token count in its low bits, the call's kind above
MAX_TOKENS = (1 << TOKEN_BITS) - 1
_TRAIN, _INFER, _ROUTED, _UNROUTED = 1, 2, 4, 8


@dataclass(frozen=True)
class CallKind:
    """What a rank's call is, besides its token count.

    ``train``: the call builds an autograd graph (its backward runs collectives).
    ``routed``: True where the strategy routes the call itself (``forward_layer``), False where
    the layer routes first; None where the rank has no tokens and can take either path.
    """

    train: bool
    routed: bool | None

    def flags(self) -> int:
        routed = 0 if self.routed is None else (_ROUTED if self.routed else _UNROUTED)
        return (_TRAIN if self.train else _INFER) | routed


class Agreed(NamedTuple):
    """The group's answer for one call: its largest token count, whether it is a training
    call, and whether it goes routed (the ranks with tokens agree on it; None where no rank has
    tokens: each rank then takes its own way, the same on every rank of one strategy)."""

    tokens: int
    train: bool
    routed: bool | None


def _routing(flags: int) -> bool | None:
    return True if flags & _ROUTED else False if flags & _UNROUTED else None


def _ranks(flags: list[int], bit: int) -> list[int]:
    return [r for r, f in enumerate(flags) if f & bit]


def decide(values: tuple[int, ...], where: str) -> Agreed:
    """Every rank's posted word → :class:`Agreed`, or ``RuntimeError`` (the same on every rank)
    where the ranks' kinds of call differ."""
    kind = values[0] >> TOKEN_BITS
    if all(v >> TOKEN_BITS == kind for v in values):  # (the usual call: every rank's kind alike)
        return Agreed(max(values) & MAX_TOKENS, bool(kind & _TRAIN), _routing(kind))
    tokens = [v & MAX_TOKENS for v in values]
    flags = [v >> TOKEN_BITS for v in values]
    train, infer = _ranks(flags, _TRAIN), _ranks(flags, _INFER)
    if train and infer:
        raise RuntimeError(f"{where}: ranks {train} make a training call (an autograd graph) and ranks {infer} an "
                           f"inference call: every rank of the group must make the same kind of call (the backward "
                           f"runs collectives). Enable or disable gradients alike on every rank.")
    routed, unrouted = _ranks(flags, _ROUTED), _ranks(flags, _UNROUTED)
    if routed and unrouted:
        raise RuntimeError(f"{where}: ranks {routed} hand the call over with the router and ranks {unrouted} route it "
                           f"first (expert_indices given, a balance loss, or torch.compile): every rank that has "
                           f"tokens must route alike, or the ranks would run different strategies")
    return Agreed(max(tokens), bool(train), True if routed else False if unrouted else None)


_SIDE_CHANNELS: dict[tuple, object] = {}  # rank tuple key → GroupReference of its gloo group
_COUNTERS: dict[tuple, object] = {}


def group_backend(group) -> str:
    """``group``'s backend name (a seam for tests, which fake a non-gloo group on the CPU)."""
    return dist.get_backend(group)


def _group_key(group) -> tuple:
    """A cache key for ``group``'s ranks under the current default group; the caches are
    emptied when that default group is replaced (:func:`_watch_default_group`), so a later
    group never inherits an entry."""
    return (id(dist.group.WORLD), tuple(dist.get_process_group_ranks(group)))


def side_channel(ep: ExpertParallel, timeout_s: float) -> dist.ProcessGroup:
    """The CPU (gloo) process group the agreement uses for ``ep``'s group: the group itself
    when it is gloo, else one gloo group per rank tuple, created once and shared by every layer
    over those ranks. Creating it is a collective of the group's ranks (of every rank when the
    group is the whole world): call it on each of them alike, as when building the layer."""
    if group_backend(ep.group) == "gloo":
        return ep.group
    _watch_default_group()
    key = _group_key(ep.group)
    reference = _SIDE_CHANNELS.get(key)
    group = None if reference is None else reference()
    if group is None:
        # (held weakly: torch holds the group until destroy_process_group, which destroys it with the rest)
        ranks = key[1]
        whole = len(ranks) == dist.get_world_size()
        group = dist.new_group(list(ranks), backend="gloo", timeout=timedelta(seconds=timeout_s),
                               use_local_synchronization=not whole)
        _SIDE_CHANNELS[key] = hold_group(group)
    return group


class GroupValues:
    """The gloo side channel's answer to the board's question (every rank's integer per call,
    calls numbered alike on every rank), for ranks on several hosts: one asynchronous
    ``all_gather`` per call, finished at the latest when the next call posts. Same interface
    as :class:`~interlace.parallel.host_board.HostBoard`.

    The group is held weakly, and the last call's collective, still pending, is dropped when the
    group goes: its work keeps the gloo backend (and its threads) alive, which would outlive
    ``destroy_process_group`` until the interpreter's exit."""

    group = WeakGroupAttribute()

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout = group, timedelta(seconds=timeout_s)
        self.world = dist.get_world_size(group)
        self.seq = 0
        self._pending: tuple | None = None  # (call, gathered tensors, work) of the last call posted
        self.last: tuple[int, tuple[int, ...]] | None = None  # (call, every rank's value) of the last call finished
        try:
            weakref.finalize(group, _drop_pending, weakref.ref(self)).atexit = False
        except TypeError:  # (a stand-in without weak references: it is held, and so is the work)
            pass

    def post(self, value: int) -> int:
        if self._pending is not None:
            self._finish()
        self.seq += 1
        mine = torch.tensor([int(value)], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        self._pending = (self.seq, gathered, dist.all_gather(gathered, mine, group=self.group, async_op=True))
        return self.seq

    def _finish(self, timeout_s: float | None = None) -> None:
        seq, gathered, work = self._pending
        self._pending = None
        work.wait(self.timeout if timeout_s is None else timedelta(seconds=timeout_s))
        self.last = (seq, tuple(int(t.item()) for t in gathered))  # CPU tensors: no device sync

    def wait(self, seq: int, timeout_s: float | None = None) -> tuple[int, ...]:
        if self._pending is not None and self._pending[0] == seq:
            self._finish(timeout_s)
        if self.last is None or self.last[0] != seq:
            raise RuntimeError(f"GroupValues: call {seq} is neither the last posted nor the last finished")
        return self.last[1]


def _drop_pending(values_ref) -> None:
    """(the group of a :class:`GroupValues` is gone) Its pending collective goes too."""
    values = values_ref()
    if values is not None:
        values._pending = None


def group_counter(ep: ExpertParallel, group, timeout_s: float):
    """Every rank's value per call for ``ep``'s ranks, one object per rank tuple shared by
    every layer over them: the shared-memory board where all ranks are on one host, else
    :class:`GroupValues` over the gloo side channel. Built with the side channel, on every rank
    alike."""
    _watch_default_group()
    key = _group_key(ep.group)
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = HostBoard.create(group, timeout_s) or GroupValues(group, timeout_s)
    return counter


def forget_groups() -> None:
    """Drop the side channels and counters (:func:`interlace.parallel.release_shared_buffers`
    does, and the first layer built under a new default group: :func:`_watch_default_group`).
    Neither holds a group (weak references), so the groups go with ``destroy_process_group``
    either way."""
    _SIDE_CHANNELS.clear()
    _COUNTERS.clear()


on_release(forget_groups)


_WATCHED: list = []  # a weak reference to the default group the caches were filled under


def _watch_default_group() -> None:
    """Empty the caches when the default group they were made under is no longer the current
    one (destroyed, and perhaps initialized again): a new group must never reuse them."""
    world = dist.group.WORLD
    if _WATCHED and _WATCHED[0]() is not world:
        forget_groups()
        _WATCHED.clear()
    if not _WATCHED:
        _WATCHED.append(_weak(world))


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:  # (an object without weak references: hold it; its id then stays unique)
        return lambda: obj


class CallAgreement:
    """One layer's agreement with its peers, call by call.

    Each call :meth:`post`\\ s this rank's token count and :class:`CallKind` (the layer does it
    before the router runs: ``Strategy.begin_call``); :meth:`wait` returns the group's
    :class:`Agreed` (a host wait for the last rank's post: microseconds on the board), the same
    answer on every rank, or raises the same error on every rank.

    ``label`` names the layer in errors (``MoELayer`` sets it). ``group`` (the side channel)
    is held weakly, as ``ep``'s.
    """

    group = WeakGroupAttribute()

    def __init__(self, ep: ExpertParallel, timeout_s: float = 300.0, label: str = "layer"):
        self.ep = ep
        self.timeout = timedelta(seconds=timeout_s)
        self.label = label
        self.group = side_channel(ep, timeout_s)
        self.counter = group_counter(ep, self.group, timeout_s)
        self.calls = 0  # calls agreed on by this layer
        self._pending: tuple[int, int, CallKind] | None = None  # (call on the counter, this rank's count, kind)
        self._answer: Agreed | None = None  # the posted call's answer, once read

    @property
    def board(self) -> HostBoard | None:
        return self.counter if isinstance(self.counter, HostBoard) else None

    @property
    def posted(self) -> bool:
        return self._pending is not None

    @property
    def posted_tokens(self) -> int | None:
        return None if self._pending is None else self._pending[1]

    def post(self, tokens: int, kind: CallKind) -> None:
        """Post this rank's call. A post whose call never came (an exception in between, on
        every rank alike) is simply replaced: the counter's sequence is the same on every rank."""
        tokens = int(tokens)
        if not 0 <= tokens <= MAX_TOKENS:
            raise ValueError(f"{self.label}: {tokens} tokens in one call; at most {MAX_TOKENS} per rank")
        seq = self._guard(lambda: self.counter.post(tokens | kind.flags() << TOKEN_BITS), None)
        self._pending, self._answer = (seq, tokens, kind), None

    def routed(self, mine: bool) -> bool:
        """Whether the posted call goes routed, ``mine`` being this rank's own way: that, where
        this rank has tokens; else (a wait) the way of the ranks that have tokens, or ``mine``
        where none has (every rank without tokens takes the same way: its strategy's)."""
        if self._pending[2].routed is not None:
            return self._pending[2].routed
        group = self.wait().routed
        return mine if group is None else group

    def wait(self) -> Agreed:
        """The group's answer for the posted call (waits for the last rank's post once; later
        calls of the same call return it at once)."""
        if self._answer is None:
            seq = self._pending[0]
            where = f"{self.label}, call {seq} on the group's counter, rank {self.ep.rank} of {self.ep.world}"
            values = self._guard(lambda: self.counter.wait(seq, self.timeout.total_seconds()), seq)
            self._answer = decide(values, where)
        return self._answer

    def begin(self, tokens: int, train: bool, routed: bool) -> bool:
        """Post this call (``Strategy.begin_call``: before the router runs) and return whether
        it goes routed (a rank without tokens posts no preference and follows the group)."""
        self.post(tokens, CallKind(train, routed if tokens else None))
        return self.routed(routed)

    def settle(self, tokens: int, train: bool, routed: bool) -> Agreed:
        """The group's answer for this call, which ends here on every rank alike (the answer or
        the same error). Posted here where the caller did not (a compiled call); where it did,
        ``tokens`` must be the count it posted."""
        try:
            if self._pending is None:
                self.post(tokens, CallKind(train, routed))
            elif self._pending[1] != tokens:
                raise RuntimeError(f"{self.label}: begin_call announced {self._pending[1]} tokens but the call has "
                                   f"{tokens}")
            return self.wait()
        finally:
            self.finish()

    def finish(self) -> None:
        """End the posted call (the next call posts anew)."""
        self._pending, self._answer = None, None
        self.calls += 1

    def _guard(self, fn, seq):
        try:
            return fn()
        except (RuntimeError, TimeoutError) as err:
            call = "" if seq is None else f" call {seq} on the group's counter,"
            raise RuntimeError(f"{self.label}:{call} the agreement with the group's ranks failed or timed out after "
                               f"{self.timeout} on rank {self.ep.rank} of {self.ep.world} (a peer did not reach this "
                               f"layer call, or raised before it?): {err}") from err
