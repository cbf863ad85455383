"""``PeerBuffer``: the buffers the fused strategy's kernels read and write on other ranks.

One object owns every buffer of one expert-parallel group (in the spirit of DeepEP's
``Buffer``): a single allocation carved into fixed regions, one rendezvous per group, sized
from an explicit maximum token count, reused by every layer and step that shares the object.

Layout of the peer-visible allocation (identical on every rank, so an offset that is valid
here is valid on every peer)::

    recv    (W, cap, N)          dispatched rows, region s holds source rank s's rows for this
                                 rank's experts, expert-sorted (cap = max_tokens·min(k, E_local))
    ret     (max_tokens·k, N)    expert outputs returned to this (home) rank, in this rank's
                                 dispatch order
    flags0  (W, E_local, TPS)    layer0 readiness of (source, local expert, row tile), TPS =
                                 ceil(max_tokens / BLOCK_M)
    flags1  (W, S)               layer1 readiness of (expert rank, N-slice), S = ceil(N / BLOCK_N1)

Flags hold the **epoch** (the call counter, kept on the device and advanced by every call),
so nothing is ever reset between calls (and a replayed CUDA graph would stay correct): a waiter waits
for ``flag >= epoch``.

Kernels get peers as *address tables*: (W,) int64 device tensors with the address of each
rank's recv / ret / flags0 / flags1 region, as seen from this process.

Transports (``kind``):

* ``"symmetric"`` — torch symmetric memory (``torch.distributed._symmetric_memory``); CUDA
  backend within a node, ``backend="NVSHMEM"`` selectable for multi-node. Kernels store
  straight into peers' memory over NVLink.
* ``"simulated"`` — W ranks in one process (tests, CPU): the tables point at the other
  simulated ranks' ordinary tensors, so the kernels' peer stores and flags are exercised
  exactly; the caller runs each phase of every rank in producer-before-consumer order.
* ``"staged"`` — any process group (gloo on CPU, or NCCL across nodes without NVSHMEM): the
  tables point at local staging copies of each peer's regions, and ``exchange_*`` moves them
  with collectives between kernel phases. Same kernels, same index math, same flags.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from interlace.parallel import symmetric
from interlace.parallel.comm import WeakGroupAttribute, held_group

_ALIGN = 256


@dataclass(frozen=True)
class BufferSpec:
    """Sizes every rank of the group must agree on (checked at construction)."""

    world: int
    num_local: int  # experts per rank
    hidden: int  # N
    top_k: int
    max_tokens: int
    block_m: int  # row tile of both layers
    block_n1: int  # layer1 N-slice width
    dtype: torch.dtype

    @property
    def cap(self) -> int:
        """Rows one source can send to one rank: each token picks an expert at most once."""
        return self.max_tokens * min(self.top_k, self.num_local)

    @property
    def tiles_per_segment(self) -> int:
        return -(-self.max_tokens // self.block_m)

    @property
    def num_slices(self) -> int:
        return -(-self.hidden // self.block_n1)

    def regions(self) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
        """name → (byte offset, shape, dtype) of each region of the peer-visible allocation."""
        shapes = {
            "recv": ((self.world, self.cap, self.hidden), self.dtype),
            "ret": ((self.max_tokens * self.top_k, self.hidden), self.dtype),
            "flags0": ((self.world, self.num_local, self.tiles_per_segment), torch.int32),
            "flags1": ((self.world, self.num_slices), torch.int32),
        }
        return pack_regions(shapes)

    @property
    def nbytes(self) -> int:
        return self.regions()["_total"][0]


def pack_regions(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict:
    """name → (byte offset, shape, dtype) of regions laid out one after another in one
    allocation, each at a multiple of 256 bytes; ``"_total"``: the allocation's bytes."""
    out, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        out[name] = (offset, shape, dtype)
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        offset += -(-nbytes // _ALIGN) * _ALIGN
    out["_total"] = (offset, (), torch.uint8)
    return out


def region_views(raw: torch.Tensor, regions: dict) -> dict[str, torch.Tensor]:
    """Typed views of the :func:`pack_regions` regions of a uint8 allocation ``raw``."""
    views = {}
    for name, (offset, shape, dtype) in regions.items():
        if name.startswith("_"):
            continue
        n = 1
        for s in shape:
            n *= s
        views[name] = raw[offset:offset + n * dtype.itemsize].view(dtype).view(shape)
    return views


def _views(raw: torch.Tensor, spec: BufferSpec) -> dict[str, torch.Tensor]:
    return region_views(raw, spec.regions())


class PeerBuffer:
    """Buffers and peer address tables of one rank; see the module docstring.

    Build with :meth:`symmetric` (GPUs), :meth:`staged` (any process group) or
    :func:`simulated_world` (W ranks in one process). ``nbytes`` reports the peer-visible
    allocation's size. ``group`` is held weakly (a cached buffer must not keep it past
    ``destroy_process_group``: :class:`~interlace.parallel.comm.WeakGroupAttribute`).
    """

    group = WeakGroupAttribute()

    def __init__(self, spec: BufferSpec, rank: int, raw: torch.Tensor, kind: str, group=None):
        self.spec, self.rank, self.kind, self.group = spec, rank, kind, group
        self.raw = raw
        self.views = _views(raw, spec)
        device = raw.device
        # Call counter (the epoch flags carry) and the first timed-out wait's record; both local.
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self.error = torch.zeros(8, dtype=torch.int32, device=device)
        # Last-arriver counters of layer1, per (home rank, N-slice); local, reset by the last arriver.
        self.counters1 = torch.zeros(spec.world, spec.num_slices, dtype=torch.int32, device=device)
        # Work queues of the layer0 / layer1 kernels (see interlace.kernels.comet.flags); local.
        self.queue0 = torch.zeros(4, dtype=torch.int32, device=device)
        self.queue1 = torch.zeros(4, dtype=torch.int32, device=device)
        self.tables: dict[str, torch.Tensor] = {}
        # First row of each source's region in the receive layout, s·cap (the kernels' default h layout).
        self.region_base = torch.arange(spec.world, dtype=torch.int32, device=device) * spec.cap

    # -- construction --------------------------------------------------------------------
    @staticmethod
    def symmetric(spec: BufferSpec, group, device: torch.device, backend: str | None = None) -> "PeerBuffer":
        """One symmetric allocation + one rendezvous (a collective: call on every rank in order)."""
        def own(raw, handle):
            buf = PeerBuffer(spec, dist.get_rank(group), raw, "symmetric", group)
            buf.handle = handle
            buf._set_tables([handle.get_buffer(r, (spec.nbytes,), torch.uint8).data_ptr() for r in range(spec.world)])
            return buf

        # (zeroed on the stream: a peer's first store into it follows the first call's count all-gather)
        return symmetric.allocate(spec.nbytes, group, device, own, backend)

    @staticmethod
    def staged(spec: BufferSpec, group, device: torch.device) -> "PeerBuffer":
        """Local staging copies of every peer's regions, moved by collectives between phases."""
        rank = dist.get_rank(group)
        raw = torch.zeros(spec.nbytes, dtype=torch.uint8, device=device)
        buf = PeerBuffer(spec, rank, raw, "staged", group)
        stage = [torch.zeros(spec.nbytes, dtype=torch.uint8, device=device) for _ in range(spec.world)]
        buf.staging_raw = stage
        buf.staging_views = [_views(s, spec) for s in stage]
        ptrs = [s.data_ptr() for s in stage]
        ptrs[rank] = raw.data_ptr()  # this rank's own regions are real
        buf._set_tables(ptrs)
        return buf

    def _set_tables(self, base_ptrs: list[int]) -> None:
        regions = self.spec.regions()
        # The kernels promise the compiler 16-byte aligned regions (interlace.kernels.comet.flags.peer_region)
        # so their row stores through these addresses are vectorized: hold them to it.
        odd = [p for p in base_ptrs if p % 16]
        if odd:
            raise ValueError(f"peer buffer base addresses must be 16-byte aligned; got {[hex(p) for p in odd]} "
                             f"({self.kind} transport, rank {self.rank})")
        for name in ("recv", "ret", "flags0", "flags1"):
            offset = regions[name][0]
            self.tables[name] = torch.tensor([p + offset for p in base_ptrs], dtype=torch.int64,
                                             device=self.raw.device)

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    def advance_epoch(self) -> None:
        """Start a call: every flag written from now on carries the new epoch (device op, no sync)."""
        self.epoch.add_(1)

    # -- staged transport: collectives between kernel phases -------------------------------
    def exchange_dispatch(self) -> None:
        """Staged: move the rows and layer0 flags written for each peer into the peer's regions."""
        if self.kind != "staged":
            return
        W, me = self.spec.world, self.rank
        for name in ("recv", "flags0"):
            # staging[d][name][me] is what this rank wrote for peer d; it lands in d's [me].
            send = torch.stack([self.staging_views[d][name][me] if d != me else self.views[name][me]
                                for d in range(W)])
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)
            for s in range(W):
                if s != me:
                    self.views[name][s].copy_(recv[s])

    def exchange_return(self, dest_of_ret_row: torch.Tensor, rows: int) -> None:
        """Staged: peers wrote expert outputs into their staging copy of this rank's ``ret``
        rows (each peer the rows of the experts it owns) and layer1 flags; merge them here.

        ``dest_of_ret_row`` (rows,) int64: the rank that owns the expert of each ret row.
        """
        if self.kind != "staged":
            return
        W, me = self.spec.world, self.rank
        for name in ("ret", "flags1"):
            send = torch.stack([self.staging_views[d][name] if d != me else self.views[name] for d in range(W)])
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)
            if name == "flags1":
                for d in range(W):
                    if d != me:
                        self.views[name][d].copy_(recv[d][d])
            else:
                ret = self.views["ret"]
                r = torch.arange(rows, device=ret.device)
                ret[:rows] = recv[dest_of_ret_row[:rows], r]


_CACHE: dict[tuple, PeerBuffer] = {}


def shared_buffer(spec: BufferSpec, kind: str, group, device: torch.device, backend: str | None = None) -> PeerBuffer:
    """A buffer for ``spec``, shared by every layer of the process on this group and transport.

    A cached buffer is reused when it matches ``spec`` in everything but ``max_tokens`` and is
    at least as large (layers run one after another on the stream, so they can share it);
    otherwise a new one replaces it. Every rank makes the same decision (same specs, same
    order), as the symmetric rendezvous requires. Each call counts one more user of the buffer
    (:func:`leave_shared`).
    """
    key = (kind, id(group), str(device))  # (a destroyed group's id may come again: the entry's group is checked)
    cached = _CACHE.get(key)
    if cached is not None and held_group(cached) is group and cached.spec.max_tokens >= spec.max_tokens and \
            replace(cached.spec, max_tokens=spec.max_tokens) == spec:
        return take_shared(cached)
    _CACHE.pop(key, None)
    if kind == "symmetric":
        buf = PeerBuffer.symmetric(spec, group, device, backend)
    elif kind == "staged":
        buf = PeerBuffer.staged(spec, group, device)
    else:
        buf = simulated_world(spec, device)[0]
    _CACHE[key] = buf
    return take_shared(buf)


def take_shared(buf):
    """Count one more strategy using ``buf``, a buffer of a process-wide cache."""
    buf.users = getattr(buf, "users", 0) + 1
    return buf


def leave_shared(buf, cache: dict | None = None) -> bool:
    """A strategy that took ``buf`` from ``cache`` (default: :func:`shared_buffer`'s) is done
    with it (``Strategy.release_buffers``). The last user to leave takes it out of the cache, so
    it is freed once nothing references it; returns whether it did. Counts, not garbage
    collection, decide: every rank forgets the buffer at the same call, so the next allocation
    (a collective rendezvous) happens on every rank alike."""
    buf.users = getattr(buf, "users", 1) - 1
    if buf.users > 0:
        return False
    cache = _CACHE if cache is None else cache
    for key in [k for k, v in cache.items() if v is buf]:
        del cache[key]
    return True


_RELEASE_HOOKS: list = []  # callables run first by release_shared_buffers (e.g. dropping CUDA graphs)


def on_release(fn) -> None:
    """Run ``fn()`` at the start of every :func:`release_shared_buffers` (once per ``fn``)."""
    if fn not in _RELEASE_HOOKS:
        _RELEASE_HOOKS.append(fn)


def release_shared_buffers() -> int:
    """Drop every buffer :func:`shared_buffer` holds and, first, every captured CUDA graph of
    the fused strategies (a graph with a captured NCCL collective makes ``ncclCommDestroy`` wait
    forever: pytorch/pytorch#115388); returns how many buffers. Call it before
    ``dist.destroy_process_group()``: a cached buffer otherwise keeps its memory (on GPUs,
    symmetric memory) until the interpreter exits; not its group, which every holder in
    interlace holds weakly (:class:`~interlace.parallel.comm.WeakGroupAttribute`), so that
    ``destroy_process_group`` frees it in any case. (``destroy_process_group`` itself
    drops the graphs too once a fused strategy has captured one, see
    :func:`interlace.strategies.fused.inference.guard_destroy_process_group`.) Layers that still hold a
    buffer keep it; the next new layer makes a fresh one, and the next call of a layer captures
    its graphs again."""
    for fn in _RELEASE_HOOKS:
        fn()
    n = len(_CACHE)
    _CACHE.clear()
    symmetric.free_unowned()
    return n


def simulated_world(spec: BufferSpec, device: torch.device | str = "cpu") -> list[PeerBuffer]:
    """W ranks' buffers in one process, each rank's tables pointing at the others' tensors."""
    device = torch.device(device)
    raws = [torch.zeros(spec.nbytes, dtype=torch.uint8, device=device) for _ in range(spec.world)]
    bufs = [PeerBuffer(spec, r, raws[r], "simulated") for r in range(spec.world)]
    ptrs = [raw.data_ptr() for raw in raws]
    for b in bufs:
        b._set_tables(ptrs)
    return bufs
