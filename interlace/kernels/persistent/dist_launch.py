"""Launcher of the persistent MoE kernel at world size W > 1: the symmetric buffer, the rank's
local state, per-shape call plans, and the phase order of the simulated and staged transports.

:class:`DistBuffer` is one rank's symmetric allocation (regions of
:mod:`interlace.kernels.persistent.dist_tasks`: ``recv``, ``amap``, ``ret``, ``counts``,
``sent``, ``done``), the (W,) address tables of every rank's regions, and the rank's local state (epoch,
counters, error record) that must live as long as the buffer: the epochs in the peers' flags
are this state's call counts. Transports (as :class:`interlace.parallel.peer_buffer.PeerBuffer`):

* ``"symmetric"`` — torch symmetric memory on CUDA: one launch per call, peers' regions
  written over NVLink by the kernel itself;
* ``"simulated"`` — W ranks in one process (:func:`simulated_world`): the tables point at the
  other ranks' tensors; :func:`run_simulated` runs each phase of every rank before the next;
* ``"staged"`` — any process group (gloo on CPU): peers' regions are local staging copies, and
  :meth:`DistBuffer.exchange` moves them with ``all_to_all`` between the phases.

Memory per rank: ``recv`` ``W · max_tokens · N`` elements (a row per source token), ``ret``
``max_tokens · k · N`` (a row per own assignment) and ``amap`` ``W · E_loc · max_tokens`` int32
(one source never sends an expert more rows than it has tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from interlace.kernels import alloc
from interlace.kernels.expert_gemm.tile import ACTIVATION_ID
from interlace.kernels.launch import cdiv, launch, next_power_of_2
from interlace.kernels.persistent import dist_tasks as dt
from interlace.kernels.persistent.args import (
    DistCall, DistFrontTiles, DistKernelArgs, DistModes, DistSync, DistTasks, DistWorkspace, GemmTiles,
    PeerTables, Routing, Sizes, TimelineArgs, World, check_signature, weight_tensors, weights_group,
)
from interlace.kernels.persistent.config import (
    ROW_TILES, WIDE_WARPS, PersistentKernelConfig, host_error_record, programs_per_sm, timeline_args,
    timeline_buffer, wide_stages,
)
from interlace.kernels.persistent.dist_kernel import persistent_dist_kernel
from interlace.kernels.persistent.protocol import Word, describe_error, state_views, state_words
from interlace.kernels.rows import _INTERPRET
from interlace.parallel import symmetric
from interlace.parallel.comm import WeakGroupAttribute
from interlace.parallel.peer_buffer import pack_regions, region_views

# Seconds a wait polls on a GPU before it gives up. Generous: a peer's first call of a shape can
# start late by a whole kernel compile on its host (this rank polls meanwhile).
DEFAULT_TIMEOUT_S = 100.0
_OCCUPANCY: dict = {}  # (device index, kernel key) → programs per SM

check_signature(persistent_dist_kernel, DistKernelArgs)


@dataclass(frozen=True)
class DistSpec:
    """What every rank must agree on: world size, experts per rank, hidden size N, top-k,
    ``max_tokens`` (per rank and call) and the token dtype."""

    world: int
    num_local: int
    hidden: int
    top_k: int
    max_tokens: int
    dtype: torch.dtype

    def regions(self) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
        """name → (byte offset, shape, dtype) of each region; ``_total`` the allocation's bytes."""
        W, L, M, N = self.world, self.num_local, self.max_tokens, self.hidden
        shapes = {"recv": ((W, M, N), self.dtype), "amap": ((W, L, M), torch.int32),
                  "ret": ((M * self.top_k, N), self.dtype), "counts": ((W, L), torch.int32),
                  "sent": ((W,), torch.int32), "done": ((W,), torch.int32)}
        return pack_regions(shapes)

    @property
    def nbytes(self) -> int:
        return self.regions()["_total"][0]

    @property
    def mt_max(self) -> int:
        """Row tiles of one rank at the smallest row tile (the local state's GEMM0 counters)."""
        return dt.max_tiles(self.world, self.max_tokens, self.top_k, self.num_local, ROW_TILES[0])


def _views(raw: torch.Tensor, spec: DistSpec) -> dict[str, torch.Tensor]:
    return region_views(raw, spec.regions())


class DistBuffer:
    """One rank's symmetric regions, address tables and local state; see the module. Its group
    is held weakly (a cached buffer must not keep it past ``destroy_process_group``:
    :class:`~interlace.parallel.comm.WeakGroupAttribute`)."""

    group = WeakGroupAttribute()

    def __init__(self, spec: DistSpec, rank: int, raw: torch.Tensor, kind: str, group=None):
        self.spec, self.rank, self.raw, self.kind, self.group = spec, rank, raw, kind, group
        self.views = _views(raw, spec)
        self.state = torch.zeros(state_words(spec.mt_max), dtype=torch.int32, device=raw.device)
        self.error = state_views(self.state)[2]  # (the error record)
        self.host_error = host_error_record(raw.device)  # (the record's host mirror)
        self.tables: dict[str, torch.Tensor] = {}

    @staticmethod
    def symmetric(spec: DistSpec, group, device: torch.device) -> DistBuffer:
        """One symmetric allocation and one rendezvous (a collective: every rank, same order)."""
        def own(raw, handle):
            buf = DistBuffer(spec, dist.get_rank(group), raw, "symmetric", group)
            buf.handle = handle
            return buf

        buf = symmetric.allocate(spec.nbytes, group, device, own)
        # NOTE: a host sync, once: no peer may store into this rank's memory before it is zeroed.
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        buf._set_tables([buf.handle.get_buffer(r, (spec.nbytes,), torch.uint8).data_ptr() for r in range(spec.world)])
        return buf

    @staticmethod
    def staged(spec: DistSpec, group, device: torch.device) -> DistBuffer:
        rank = dist.get_rank(group)
        buf = DistBuffer(spec, rank, torch.zeros(spec.nbytes, dtype=torch.uint8, device=device), "staged", group)
        buf.staging = [torch.zeros(spec.nbytes, dtype=torch.uint8, device=device) for _ in range(spec.world)]
        buf.staging_views = [_views(s, spec) for s in buf.staging]
        ptrs = [s.data_ptr() for s in buf.staging]
        ptrs[rank] = buf.raw.data_ptr()
        buf._set_tables(ptrs)
        return buf

    def _set_tables(self, base_ptrs: list[int]) -> None:
        odd = [hex(p) for p in base_ptrs if p % 16]
        if odd:
            raise ValueError(f"symmetric buffer base addresses must be 16-byte aligned; got {odd}")
        for name, (offset, _, _) in self.spec.regions().items():
            if not name.startswith("_"):
                self.tables[name] = torch.tensor([p + offset for p in base_ptrs], dtype=torch.int64,
                                                 device=self.raw.device)

    def exchange(self, names: tuple[str, ...], ret_owner: torch.Tensor | None = None) -> None:
        """Staged transport: what this rank wrote into its staging copy of peer d's region
        ``name[me]`` lands in d's ``name[me]`` (a region's leading index is its writer), and
        for ``"ret"`` (rows by this rank's assignment, each written by its owner) the rows
        whose ``ret_owner`` (per row: the owner rank, −1 for rows of no assignment) is d come
        from d's copy."""
        if self.kind != "staged":
            return
        W, me = self.spec.world, self.rank
        for name in names:
            if name == "ret":
                self._exchange_ret(ret_owner)
                continue
            send = torch.stack([self.views[name][me] if d == me else self.staging_views[d][name][me]
                                for d in range(W)])
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)
            for s in range(W):
                if s != me:
                    self.views[name][s].copy_(recv[s])

    def _exchange_ret(self, ret_owner: torch.Tensor) -> None:
        W, me = self.spec.world, self.rank
        send = torch.stack([self.views["ret"] if d == me else self.staging_views[d]["ret"] for d in range(W)])
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        for s in range(W):
            rows = (ret_owner == s).nonzero()[:, 0]
            if s != me and rows.numel():
                self.views["ret"][rows] = recv[s][rows]

    @property
    def buffer(self) -> torch.Tensor:
        """The local state tensor (as :class:`~interlace.kernels.persistent.launch.PersistentState`'s)."""
        return self.state

    def error_record(self) -> torch.Tensor:
        return self.error

    def check(self) -> None:
        """Raise ``RuntimeError`` if a wait timed out (reads the record: a host sync); clear it
        and its mirror."""
        message = describe_error(self.error.tolist())
        if message:
            self.error.zero_()
            self.host_error.zero_()
            raise RuntimeError(message)


def simulated_world(spec: DistSpec, device: torch.device | str = "cpu") -> list[DistBuffer]:
    """W ranks' buffers in one process, each rank's tables pointing at the others' tensors."""
    bufs = [DistBuffer(spec, r, torch.zeros(spec.nbytes, dtype=torch.uint8, device=device), "simulated")
            for r in range(spec.world)]
    for b in bufs:
        b._set_tables([o.raw.data_ptr() for o in bufs])
    return bufs


# After which phase the staged transport moves which regions (dist_tasks.PHASES).
EXCHANGES = (("recv", "amap", "counts", "sent"), ("ret", "done"), ())


DIST_BLOCK_G = 128  # the W > 1 router GEMM's step over N (PersistentKernelConfig.block_g None)
# Narrow tiles: GEMM1's wider output slice, where there are enough tasks for it (narrow_gemm1_slice).
NARROW_N1_WIDER = 128


def expected_tiles(T: int, top_k: int, num_local: int, block_m: int) -> int:
    """Row tiles of a call under balanced routing: a rank receives about T·k rows, on at most
    min(E_loc, T·k) local experts."""
    rows = T * top_k
    return max(min(num_local, rows), cdiv(rows, block_m))


def narrow_gemm1_slice(T: int, N: int, num_local: int, top_k: int, block_m: int, block_n1: int,
                       device: torch.device) -> int:
    """GEMM1's N-slice of narrow tiles: :data:`NARROW_N1_WIDER` where the call's expected GEMM1
    tasks at that width still number at least four per SM, else ``block_n1``. A wider slice
    halves the tasks (and the h tile's reloads) per tile; with few tiles (few local experts, each
    one tile: e.g. 4 experts of a 4096-wide layer) it would leave SMs idle."""
    tiles = expected_tiles(T, top_k, num_local, block_m)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wider = NARROW_N1_WIDER > block_n1 and tiles * cdiv(N, NARROW_N1_WIDER) >= 4 * sms
    return NARROW_N1_WIDER if wider else block_n1


INDEX_BLOCK = 2048  # assignments per step of the index task's slot loop (at 512 tokens of top-8: 2 steps)
MAX_LOGITS_SPLITS = 8
# (tokens, experts) of a logits task: narrow tiles (two programs per SM) and wide tiles (one
# 8-warp program per SM). A logits task is a chain of steps over N, each about a memory round
# trip whatever its tile, so wide tiles take 4× the tile in a quarter of the steps (measured:
# docs/persistent.md). Narrow builds keep the small tile: the large one doubles their shared
# memory, leaving one program per SM.
LOGITS_TILE = (16, 32)
WIDE_LOGITS_TILE = (32, 64)
TOP_K_TASKS = 32  # top-k tasks a call aims at (top_k_block)


def top_k_block(T: int) -> int:
    """Tokens per W > 1 top-k task: a power of 2 from 4 to 16 that makes about
    :data:`TOP_K_TASKS` tasks. A top-k task is a chain of k reductions over the experts whose
    cost grows with the (tokens × experts) elements each thread holds: at decode a few large
    tasks would sit on the critical path of every call, while small ones run side by side on
    more SMs (measured: docs/persistent.md). More tasks than about 32 would lengthen the
    index's running sum over their histograms."""
    return max(4, min(16, next_power_of_2(cdiv(max(T, 1), TOP_K_TASKS))))


def sm_count(device: torch.device) -> int | None:
    """SMs of a CUDA device; None off the GPU (the interpreter included)."""
    if device.type != "cuda" or _INTERPRET:
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def logits_splits(n_blocks: int, N: int, block_g: int, programs: int | None) -> int:
    """Parts of the router GEMM's sum over N (logits tasks per (token block, expert block)): the
    most, a power of 2 up to :data:`MAX_LOGITS_SPLITS`, with each part at least two ``block_g``
    steps and the logits tasks no more than the grid's ``programs``. The gate heads the chain
    every expert tile waits for, and a logits task is a latency-bound chain of N / block_g loads:
    at decode sizes few token blocks would leave most SMs idle while a few walk the whole of N.
    The parts are summed in order by the gate task (deterministic). 1 off the GPU (``programs``
    None)."""
    if not programs:
        return 1
    splits = 1
    while 2 * splits <= MAX_LOGITS_SPLITS and n_blocks * 2 * splits <= programs and cdiv(N, 2 * splits) >= 2 * block_g:
        splits *= 2
    return splits


class DistPlan:
    """One rank's call shape (T tokens): tiles, :class:`~dist_tasks.DistLayout`, workspace and
    kernel arguments, over a :class:`DistBuffer`. ``run(x)`` is the whole call (one launch);
    :meth:`launch_phase` runs one phase (simulated and staged transports)."""

    def __init__(self, x: torch.Tensor, router_weight: torch.Tensor, expert_bias: torch.Tensor | None,
                 w_up: torch.Tensor, w_down: torch.Tensor, buf: DistBuffer, *, top_k: int, softmax: bool,
                 renormalize: bool, route_scale: float, activation: str, w_pieces: int,
                 config: PersistentKernelConfig, max_spins: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 timeline: int = 0, round_logits: int = 0, capacity: int | None = None):
        """``capacity``: each expert's capacity for this rank's tokens (``MoEConfig.capacity(T)``:
        its assignments served slot-major, the rest dropped before the send); None: dropless."""
        spec = buf.spec
        T, N = x.shape
        if T > spec.max_tokens:
            raise ValueError(f"persistent: {T} tokens exceed max_tokens={spec.max_tokens} (strategy option)")
        for name, t in (("router_weight", router_weight), ("w_up", w_up), ("w_down", w_down)):
            if not all(p.is_contiguous() for p in weight_tensors(t)):
                raise ValueError(f"persistent: {name} must be contiguous")
        E = router_weight.shape[0]
        L, up_width, _ = w_up.shape
        K = w_down.shape[2]
        if L != spec.num_local or E != L * spec.world or N != spec.hidden or x.dtype != spec.dtype:
            raise ValueError(f"persistent: x {tuple(x.shape)} {x.dtype}, {E} experts, {L} local do not fit the "
                             f"buffer's {spec}")
        self.T, self.N, self.dtype, self.device, self.buf = T, N, x.dtype, x.device, buf
        self.weights = (router_weight, expert_bias, w_up, w_down)
        self.weight_ptrs = tuple(0 if w is None else w.data_ptr() for w in weight_tensors(*self.weights))
        c = self.config = config
        # (a tile holds one expert's rows from all W sources; each rank expects W·T·k/E rows per
        # expert from its own T: decode ranks see similar counts)
        block_m = max(ROW_TILES[0], c.rows_per_tile(spec.world * T, top_k, E))
        rows_per_expert = spec.world * T * top_k / E
        self.wide = c.wide_tiles(rows_per_expert, *(getattr(w, "weight", w) for w in (w_up, w_down)))
        self.num_warps, self.num_stages = c.num_warps, c.num_stages
        if self.wide:
            block_m, block_k0, block_n0, block_n1, block_k1 = c.wide_tiles_for(
                rows_per_expert, expected_tiles(T, top_k, L, 128) * cdiv(N, 256), sm_count(x.device))
            self.num_warps, self.num_stages = WIDE_WARPS, wide_stages(block_m)
        else:
            block_k0, block_n0, block_n1, block_k1 = c.tiles(block_m)
            if c.block_n1 is None and x.device.type == "cuda" and not _INTERPRET:
                block_n1 = narrow_gemm1_slice(T, N, L, top_k, block_m, block_n1, x.device)
        self.block_m = block_m
        weights, fp8 = weights_group(router_weight, expert_bias, w_up, w_down, (block_n0, block_k1))
        tile = WIDE_LOGITS_TILE if self.wide else LOGITS_TILE
        block_t, block_e = c.block_t or tile[0], c.block_e or tile[1]
        block_s, block_ns = c.block_s, min(c.block_ns, next_power_of_2(N))
        block_gl = c.block_g or DIST_BLOCK_G  # the router GEMM's step over N: a (block_gl, block_e) fp32 weight tile
        n_eb = cdiv(E, block_e)
        sms = sm_count(x.device)
        programs = sms * (1 if self.wide else 2) if sms else None  # (wide tiles: one program per SM; narrow: two)
        n_ls = c.logits_splits or logits_splits(cdiv(T, block_t) * n_eb, N, block_gl, programs)
        ls_chunk = cdiv(cdiv(N, n_ls), block_gl) * block_gl
        self.logits_splits = n_ls
        n_slices_c = cdiv(N, c.block_nc)
        comb_slices = c.combine_slices or (max(1, cdiv(cdiv(T, c.block_tc) * n_slices_c, sms)) if sms else 1)
        self.comb_slices = comb_slices = min(comb_slices, n_slices_c)
        block_tk = c.block_tk or top_k_block(T)
        self.layout = layout = dt.DistLayout.build(
            T, N, K, spec.world, L, top_k, spec.max_tokens, block_t=block_t, block_tk=block_tk, block_e=block_e,
            block_s=block_s, block_ns=block_ns, block_m=block_m, block_k0=block_k0, block_n1=block_n1,
            block_tc=c.block_tc, block_nc=c.block_nc, num_experts=E, logits_splits=n_ls, comb_slices=comb_slices)
        e_pad, el_pad = max(16, next_power_of_2(E)), max(16, next_power_of_2(L))
        TK = max(1, T * top_k)
        n_hist = max(1, layout.n_gate) * e_pad * (top_k if capacity is not None else 1)
        ints = alloc.empty((4 * TK + 2 * n_hist + e_pad + spec.world * el_pad + 3 * layout.mt,), dtype=torch.int32,
                           device=x.device)
        logits = alloc.empty((n_ls * max(1, T), e_pad), dtype=torch.float32, device=x.device)
        idx, wt, lrank, slot = (ints[i * TK:(i + 1) * TK] for i in range(4))
        rest = ints[4 * TK:]
        hist, base = rest[:n_hist], rest[n_hist:2 * n_hist]
        rest = rest[2 * n_hist:]
        counts, offs, tiles = rest[:e_pad], rest[e_pad:e_pad + spec.world * el_pad], rest[e_pad + spec.world * el_pad:]
        # The activation rows, sized for every row the peers could send (max_tokens, not T): scratch
        # each call writes before reading, one buffer for every plan of this shape in the process
        # (a plan per layer and token count would otherwise keep its own).
        h = alloc.shared("persistent.dist_h", (layout.mt * block_m, K), x.dtype, x.device)
        self.workspace = dict(idx=idx, weight=wt.view(torch.float32), slot=slot, counts=counts, tiles=tiles,
                              block_m=block_m, layout=layout)
        self.timeline = timeline_buffer(x.device, timeline, layout.total)
        tb = buf.tables
        self.args = DistKernelArgs(
            call=DistCall(x_ptr=x, out_ptr=None, n_programs=0, task_lo=0, task_hi=0, final=0),  # (set per launch)
            weights=weights,
            workspace=DistWorkspace(logits_ptr=logits, idx_ptr=idx, wt_ptr=wt.view(torch.float32), lrank_ptr=lrank,
                                    slot_ptr=slot, hist_ptr=hist, base_ptr=base, counts_ptr=counts, offs_ptr=offs,
                                    tiles_ptr=tiles, h_ptr=h),
            peers=PeerTables(recv_table=tb["recv"], amap_table=tb["amap"], ret_table=tb["ret"],
                             counts_table=tb["counts"], sent_table=tb["sent"], done_table=tb["done"]),
            sync=DistSync(state_ptr=buf.state, err_ptr=buf.error, host_err_ptr=buf.host_error,
                          max_spins=int(max_spins), timeout_ns=int(timeout_s * 1e9)),
            world=World(me=buf.rank, W=spec.world, E_loc=L, max_tokens=spec.max_tokens),
            sizes=Sizes(T=T, N=N, K=K, E=E, UP=up_width, scale=float(route_scale), capacity=capacity or 0),
            tasks=DistTasks(n_logits=layout.n_logits, n_eb=n_eb, n_ls=n_ls, ls_chunk=ls_chunk, n_gate=layout.n_gate,
                            n_send=layout.n_send, n_ns=cdiv(N, block_ns), mt=layout.mt, n_k0=layout.n_k0,
                            n_n1=layout.n_n1, n_comb_t=layout.n_comb_t, n_comb_n=layout.n_comb_n,
                            comb_slices=comb_slices),
            timeline=TimelineArgs(*timeline_args(self.timeline)),
            front_tiles=DistFrontTiles(BLOCK_T=block_t, BLOCK_TK=block_tk, BLOCK_E=block_e, BLOCK_G=block_gl,
                                       BLOCK_S=block_s, BLOCK_NS=block_ns, BLOCK_A=INDEX_BLOCK,
                                       G_CHUNK=max(1, min(16, 4096 // e_pad)),
                                       LS_MAX=max(MAX_LOGITS_SPLITS, c.logits_splits or 1),
                                       K_PAD=next_power_of_2(top_k), EL_PAD=el_pad),
            gemm_tiles=GemmTiles(BLOCK_J=max(16, min(64, 2048 // el_pad)), BLOCK_M=block_m, BLOCK_K0=block_k0,
                                 BLOCK_N0=block_n0, BLOCK_N1=block_n1, BLOCK_K1=block_k1, BLOCK_TC=c.block_tc,
                                 BLOCK_NC=c.block_nc),
            routing=Routing(TOP_K=top_k, E_PAD=e_pad, SOFTMAX=softmax, HAS_BIAS=expert_bias is not None,
                            RENORMALIZE=renormalize, W_PIECES=w_pieces, DOT_FP32=_INTERPRET, ROUND_LOGITS=round_logits,
                            CAPACITY=capacity is not None),
            modes=DistModes(ACTIVATION=ACTIVATION_ID[activation], CLOCK=x.device.type == "cuda" and not _INTERPRET,
                            TIMELINE=timeline, W_TMA=self.wide, JOINT=self.wide and activation == "swiglu" and not fp8,
                            W_FP8=fp8),
        )
        self.constexprs = self.args.constexprs()
        self._rest = self.args.runtime(skip_call=True)  # (the arguments after the launch's call group)
        self._dummy = alloc.empty((1, N), dtype=x.dtype, device=x.device) if T == 0 else None
        self._occupancy_key = (x.device.index, block_m, block_n1, e_pad, el_pad, top_k, activation, x.dtype, c,
                               timeline, round_logits, self.wide, capacity is not None)
        self.round_logits = round_logits

    def timeline_records(self) -> list[dict]:
        """The last call's task records (``timeline`` on; a host sync): see
        :meth:`~interlace.kernels.timeline.TimelineBuffer.task_records`, kinds
        :data:`~dist_tasks.TIMELINE_KINDS`."""
        return self.timeline.task_records(int(self.buf.state[Word.EPOCH]), dt.TIMELINE_KINDS)

    def matches(self, x: torch.Tensor, router_weight, expert_bias, w_up, w_down) -> bool:
        return (x.shape[0] == self.T and x.dtype == self.dtype and x.device == self.device
                and tuple(0 if w is None else w.data_ptr() for w in weight_tensors(router_weight, expert_bias, w_up,
                                                                                  w_down))
                == self.weight_ptrs)

    def _programs(self, n_tasks: int) -> int:
        if self.config.programs is not None:
            programs = self.config.programs
        elif _INTERPRET or self.device.type != "cuda":
            programs = 3
        else:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            programs = sms * _OCCUPANCY.get(self._occupancy_key, 1)
        return max(1, min(programs, n_tasks))

    @property
    def grid(self) -> int:
        """Programs of a one-launch call (all tasks)."""
        return self._programs(self.layout.total)

    def kernel_args(self, x: torch.Tensor, out: torch.Tensor, phase: tuple[int, int] | None):
        """(programs, the kernel's positional arguments) of the launch of kinds ``phase``; None
        where the phase has no task."""
        task_lo, task_hi = self.layout.task_range(phase)
        if task_hi <= task_lo:
            return None
        if self.T == 0:
            x = out = self._dummy
        programs = self._programs(task_hi - task_lo)
        final = int(task_hi == self.layout.total)
        return programs, (x, out, programs, task_lo, task_hi, final, *self._rest)

    def launch_phase(self, x: torch.Tensor, out: torch.Tensor, phase: tuple[int, int] | None) -> None:
        """Tasks of kinds ``phase`` = (first kind, last kind) (None: all, one launch per call)."""
        launch_args = self.kernel_args(x, out, phase)
        if launch_args is None:
            return
        programs, args = launch_args
        compiled = launch(persistent_dist_kernel, (programs,), *args, num_warps=self.num_warps,
                          num_stages=self.num_stages, **self.constexprs)
        if self.device.type == "cuda" and not _INTERPRET and self.config.programs is None:
            _OCCUPANCY.setdefault(self._occupancy_key, programs_per_sm(compiled, self.device, self.num_warps))

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out (T, N): the whole call in one launch (symmetric transport; into ``out`` when given)."""
        out = alloc.empty((self.T, self.N), dtype=self.dtype, device=self.device) if out is None else out
        self.launch_phase(x, out, None)
        return out

    def run_phases(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The call as three launches with the staged exchanges between (one rank of a process
        group; into ``out`` when given)."""
        out = alloc.empty((self.T, self.N), dtype=self.dtype, device=self.device) if out is None else out
        spec = self.buf.spec
        for phase, names in zip(dt.PHASES, EXCHANGES):
            self.launch_phase(x, out, phase)
            ret_owner = None
            if "ret" in names:
                ret_owner = torch.full((spec.max_tokens * spec.top_k,), -1, dtype=torch.int64, device=self.device)
                tk = self.T * spec.top_k
                ret_owner[:tk] = self.workspace["idx"][:tk].long() // spec.num_local
            self.buf.exchange(names, ret_owner)
        return out


def run_simulated(plans: list[DistPlan], xs: list[torch.Tensor], phases=dt.PHASES) -> list[torch.Tensor]:
    """All ranks of a simulated world (one process): each phase of every rank before the next.
    ``phases`` (tests) may reorder or drop phases to break the protocol on purpose."""
    outs = [alloc.empty((p.T, p.N), dtype=p.dtype, device=p.device) for p in plans]
    for phase in phases:
        for plan, x, out in zip(plans, xs, outs):
            plan.launch_phase(x.contiguous(), out, phase)
    return outs
