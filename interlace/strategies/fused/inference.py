"""``fused``: COMET's fine-grained overlap — dispatch fused into GEMM0, GEMM1 fused into combine.

Per call, on every rank (no host sync anywhere after the first call; the epoch lives on the
device, so CUDA-graph capture should work, but it has not been tried yet):

1. counting sort of the routing (``build_dispatch_index``) and **one all-gather** of every
   rank's kept rows per expert (a device collective; nothing is read back to the host);
2. the index plan on the device (:mod:`interlace.kernels.comet.plan`);
3. layer0 (:mod:`interlace.kernels.comet.layer0`): communication programs push rows into the
   experts' owners' symmetric buffers while GEMM programs compute local tiles, then remote
   tiles as their flags arrive;
4. layer1 (:mod:`interlace.kernels.comet.layer1`): GEMM1 column-wise with its tiles stored at the
   home ranks, and combine programs reducing each token's top-k rows per N-slice as slices land.

Transports (:class:`interlace.parallel.PeerBuffer`): ``symmetric`` on CUDA (torch symmetric
memory), ``staged`` on other process groups (gloo in CI: the same kernels, with collectives
moving the staged regions between the kernel phases).

Training (a call that builds an autograd graph). ``train_path`` says what such a call runs:
* ``"sequential"`` (default) runs the ``sequential`` strategy's forward and backward;
* ``"fused"`` (``"fused:train"``) runs the fused kernels forward *and* backward
  (:mod:`interlace.strategies.fused.train`: the backward's dispatch is the forward's combine and
  vice versa, the same two kernels with their roles swapped, weight gradients by the expert
  kernels' weight-gradient kernel). With CUDA graphs (below) it is 1.05–1.23× ``sequential``
  on qwen2-moe, qwen3-30b-a3b and flashdmoe-cfg at 4096–16384 tokens (2× H200, docs/benchmarks.md
  run 151) and 0.93–1.02× on the GEMM-bound mixtral-8x7b, phi3.5-moe and dsv3-like; it keeps
  more activation memory (up to 1.4× ``sequential``'s peak). ``auto`` picks it per shape from
  the measured profile;
* ``"recompute"`` (``"fused:recompute"``) runs the fused kernels forward, saves only the
  layer's inputs, and recomputes the forward through ``sequential`` in the backward
  (activation checkpointing: less activation memory, one extra forward of time).
``no_grad`` / inference calls always run the fused kernels.

Deadlock freedom: communication work never waits; every wait is on work that was claimed
earlier from an in-order queue by a running program (interlace.kernels.comet.flags), so progress does
not depend on which programs the GPU schedules first; the grid is the device's SM count (read,
never assumed) and a peer that never runs the layer makes the bounded waits record an error
(raised on this rank's next call, or by :meth:`FusedStrategy.synchronize_and_check`).

Options: ``max_tokens`` (tokens per rank the buffers are sized for; default: the first call's
largest T over ranks — that first call's all-reduce is the one host sync this strategy makes),
``n_comm`` / ``n_comm1`` (communication/combine programs of layer0/layer1: an int, or "auto"
for the tuned value, see ``interlace tune``), ``max_spins`` (bound of every wait),
``transport`` ("auto", "symmetric", "staged"), ``symm_backend`` (None/"CUDA"/"NVSHMEM"),
``timeline`` (record every work item's start/wait/end, read by :meth:`FusedStrategy.timeline_records`;
off by default and then compiled out of the kernels), ``cuda_graph`` (default True; ``"fused:eager"``
turns it off: inference calls replay a CUDA graph per token count, see below).

CUDA graphs: nothing between the routing and the output needs the host (the epoch, the plan and
every flag live on the device; the count exchange is a device collective), so an inference call
with CUDA symmetric memory captures that part once per token count T (on its second call with
that T; the first one runs eagerly and compiles the kernels) and replays it afterwards: inputs
are copied into the graph's static buffers and the output is copied out. 2× H200: 1.07–1.43×
faster than the eager fused call on qwen2-moe, qwen3-30b-a3b and flashdmoe-cfg at 4096–16384
tokens (docs/benchmarks.md, run 25; the most at small T, where the eager call is bound by the
host's kernel launches).
The graph holds the weights' addresses: it is re-captured when ``w_up``/``w_down`` are different
tensors (in-place optimizer updates need nothing). At most ``MAX_GRAPHS`` token counts keep a
graph (least recently used dropped); a capture synchronizes the device once, so a workload that
cycles through more token counts than that pays a sync per returning T — use ``"fused:eager"``
there. Inside a caller's own CUDA-graph capture the kernels run eagerly (and are captured by
the caller). The error record is checked after every replay.
``fused:train`` does the same for training calls (:class:`~interlace.strategies.fused.train.TrainGraph`):
the forward and the backward up to the weight gradients are captured per token count; the
saved state lives in the graph's buffers, so while one call's backward is pending, other
calls with that token count run eagerly. Eager, that call was bound by the host (2× H200,
run 150: 3.3–4.3 ms of host work per qwen2-moe/flashdmoe-cfg/qwen3-30b-a3b 4096 step against
2.8–3.8 ms of kernels); replayed, its host time is 1.6–2.1 ms (run 151).
A live graph with a captured NCCL collective makes the communicator's destruction wait forever
(run 151), so once a strategy captures, ``dist.destroy_process_group`` is wrapped to drop every
fused graph first (:func:`guard_destroy_process_group`); call
:func:`interlace.parallel.release_shared_buffers` before it as well (it drops the graphs and the
buffers, and covers a ``destroy_process_group`` imported before the wrapping).
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from interlace.kernels import alloc
from interlace.kernels.comet.flags import describe_error
from interlace.kernels.comet.layer1 import gemm1_combine
from interlace.kernels.comet.layer0 import dispatch_gemm0
from interlace.kernels.comet.plan import build_plan
from interlace.kernels.routing_index import build_dispatch_index
from interlace.kernels.timeline import CLOCK_GPU, CLOCK_LOGICAL, TimelineBuffer, layer_capacities
from interlace.kernels.rows import _INTERPRET
from interlace.strategies.base import Strategy, register_strategy
from interlace.strategies.graphs import CudaGraphRecorder
from interlace.strategies.sequential import SequentialStrategy
from interlace.parallel.peer_buffer import BufferSpec, PeerBuffer, on_release, shared_buffer


_LIVE = weakref.WeakSet()  # every FusedStrategy: release_shared_buffers drops their graphs


def release_graphs() -> int:
    """Drop the captured CUDA graphs of every live ``fused`` strategy (run by
    :func:`interlace.parallel.release_shared_buffers`, before the process group goes);
    returns how many. A strategy captures again on its next calls."""
    n = 0
    for strategy in list(_LIVE):
        n += strategy.release_graphs()
    return n


on_release(release_graphs)


def guard_destroy_process_group() -> None:
    """Make ``torch.distributed.destroy_process_group`` drop interlace's CUDA graphs first.

    A live graph with a captured NCCL collective keeps ``ncclCommDestroy`` waiting forever
    (pytorch/pytorch#115388; run 151): a script that destroys its group while a layer still
    holds a graph would hang at exit. Installed once, at a strategy's first capture. A
    reference to the function taken before that (``from torch.distributed import
    destroy_process_group``) is not covered: call :func:`interlace.parallel.release_shared_buffers`
    before it, which also frees the buffers."""
    from torch.distributed import distributed_c10d

    current = dist.destroy_process_group
    if getattr(current, "interlace_releases_graphs", False):
        return

    def destroy_process_group(*args, **kwargs):
        release_graphs()
        return current(*args, **kwargs)

    destroy_process_group.__doc__ = current.__doc__
    destroy_process_group.__wrapped__ = current
    destroy_process_group.interlace_releases_graphs = True
    dist.destroy_process_group = destroy_process_group
    if distributed_c10d.destroy_process_group is current:
        distributed_c10d.destroy_process_group = destroy_process_group


TRAIN_PATHS = ("sequential", "recompute", "fused")  # what a call that builds an autograd graph runs
MAX_GRAPHS = 8  # token counts that keep a captured CUDA graph (each holds its own memory pool)


# interleave0 = -1: the interleaved layer0 order where owners receive at most this many rows per
# local expert (see FusedKernelConfig.interleave0).
AUTO_INTERLEAVE0_MAX_ROWS = 1024


@dataclass(frozen=True)
class FusedKernelConfig:
    """Tile sizes of the two fused kernels (tuning configs live beside the kernels' users)."""

    block_m: int = 128  # row tile of both layers (= the unit of layer0 readiness)
    block_n: int = 128  # layer0 GEMM column block (over K)
    block_n1: int = 256  # layer1 N-slice (= the unit of layer1 readiness); 256 beat 128 (fewer h re-reads)
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4
    copy_rows: int = 16  # rows per load/store step of a communication program (32/64: no gain, runs 53/56/62)
    copy_cols: int = 512
    block_t: int = 32  # tokens per combine task (64/128: no gain, run 53)
    group_m: int = 8  # row tiles sharing a weight block in L2 (both layers)
    slice_group: int = 4  # layer1: N-slices per group (1: COMET's column-wise order; 0: all)
    # A rows through a TMA descriptor (Hopper+; ignored where TMA is off): layer0's remote tiles
    # (a_tma0; local rows are gathered, and Hopper has no TMA gather) and layer1's h rows (a_tma1).
    # layer1: count a finished tile (a system-scope release that waits for its peer stores to land)
    # after the next tile's main loop, so the stores drain under it (defer_count). The three
    # together ran 0.6-4.1% faster than without on 9 of the 12 BENCHMARKS rows at 8192/16384 and
    # 0.7-2.2% slower on 3 (dsv3-like 8192/16384, phi3.5-moe 8192) in run 46, 3-8% faster on the
    # six small-expert rows in run 47 (interleaved A/B); off: INTERLACE_FUSED="a_tma0=0,a_tma1=0,defer_count=0".
    a_tma0: int = 1
    a_tma1: int = 1
    defer_count: int = 1
    # TMA stores for the rows that cross NVLink (Hopper+, where TMA is on): layer1's expert-output
    # tiles (ret_tma) and layer0's sends (send_tma; copy_cols ≤ 256). Both are correct (interpreter
    # tests; gpu_check with ret_tma, run 55) and slower on H200: ret_tma 1.00-1.05× the time of the
    # register stores (run 55), send_tma 0.99-1.27× (run 57). Triton waits after each descriptor
    # store until TMA has read the staged tile, and TMA stores reach about half a program's
    # register-store rate over NVLink (run 61). Kept as options for other GPUs and Triton versions.
    ret_tma: int = 0
    send_tma: int = 0
    # layer1 in pull mode (interlace.kernels.comet.layer1): GEMM tiles store locally and the home's
    # combine programs load the rows from their owners, so no GEMM program pushes over NVLink.
    # Inference forward on peer-load transports only (training saves the returned rows, which
    # pull mode never gathers; the staged transport has no peer loads). Measured 3–11% slower (run 64):
    # the GEMM tiles stop stalling, but the pulls wait for whole tokens and land after GEMM1.
    combine_pull: int = 0
    # layer1 in push mode (interlace.kernels.comet.layer1): GEMM tiles with a remote home are staged
    # locally and the combine programs push them to their homes as they become ready (same
    # limits as pull mode: inference forward on peer-store transports). Measured 0.97–1.12× the
    # default's time (runs 72–75): GEMM1 stops stalling, but under GEMM1 a push program moves only
    # 6–12 GB/s, so half the bytes cross after it. Off.
    combine_push: int = 0
    push_batch: int = 8  # push mode: items a program claims and pushes before counting them (one wait)
    push_rows: int = 128  # push mode: rows per load/store step of a push (capped at block_m)
    # layer0 with SwiGLU and TMA weights: a tile's gate and up rows as one 3-D TMA block and one
    # BLOCK_M × 2·block_n dot, as the expert kernels' ``joint`` (interlace.kernels.expert_gemm.tile). Run 86
    # (alone): the local-only time 0.3–3.2% shorter on 10 of 12 rows, the layer 0.930–1.017×.
    # layer0: this rank's own rows are first gathered (one copy kernel) into its own region of
    # recv, which no peer writes, so the local tiles read contiguous rows through TMA like the
    # remote ones instead of a pointer gather (Hopper has no TMA gather; gather0, needs a_tma0).
    # -1 (auto) turns each on where the hidden size is at least AUTO_GATHER0_MIN_HIDDEN
    # (interlace.kernels.comet.layer0, which gives the measurements); 0 / 1 force it.
    joint0: int = -1
    gather0: int = -1
    # layer1's GEMM items as one flat loop over (item, k step), statically dealt to the GEMM
    # programs, each tile's rows stored to its home by TMA (interlace.kernels.comet.layer1._gemm1_flat):
    # the pipeline runs across tiles. Needs TMA and a_tma1; the default layer1 mode, forward only.
    # Run 127: layer1 3–5% shorter without remote traffic (dsv3-like 8192: 3.935 → 3.724 ms), but
    # not with it (4.440 → 4.358 ms; the layer 0.996–1.045× the default over the 12 rows): a
    # tile's TMA store to a peer holds the loop until NVLink has taken it. 2: the same loop with
    # register stores (every thread counts its own; 4 stages fit). Run 130: layer1 4–9% shorter in
    # the phase measurement, the graph-replayed layer 0.993–1.052× (9 of 12 rows slower). Off.
    flat1: int = 0
    # layer0's receive order (interlace.kernels.comet.plan, "interleaved order"): the first 1/k of the
    # experts run their local rows alone, then every later expert's local and first remote
    # source's rows back to back, so their weights are read once per layer0 instead of twice.
    # k ≥ 1: always; 0: local rows first (every expert's weights read twice); -1 (auto): k = 8
    # where an owner receives at most AUTO_INTERLEAVE0_MAX_ROWS rows per local expert in the call
    # (decided on the device from the counts). Run 164 (2× H200, interleaved A/B, k = 8 against
    # local-first): 0.93–0.99× the time at 512–1024 rows per expert (dsv3-like, qwen3-30b-a3b 8192,
    # qwen2-moe 8192, flashdmoe-cfg), 1.00–1.03× at 2048–8192 (mixtral-8x7b, phi3.5-moe, qwen2-moe
    # 16384) but for qwen3-30b-a3b 16384 (0.97×).
    interleave0: int = -1

    def interleave0_args(self) -> tuple[int, int]:
        """(k, max_rows) of the plan's interleaved order (:attr:`interleave0`)."""
        if self.interleave0 < 0:
            return 8, AUTO_INTERLEAVE0_MAX_ROWS
        return self.interleave0, 2**31 - 1

    def __post_init__(self):
        """Refuse a config the kernels cannot compile or would run wrongly, naming the field (the
        compiler's own errors for these come late and name none)."""
        pow2 = ("block_m", "block_n", "block_n1", "block_k", "num_warps", "copy_rows", "copy_cols", "block_t",
                "push_rows")
        for name in pow2:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"fused kernel config: {name} must be a power of two ≥ 1, got {v!r}")
        if not isinstance(self.interleave0, int) or self.interleave0 < -1:
            raise ValueError(f"fused kernel config: interleave0 is -1 (auto), 0 (local rows first) or k ≥ 1, got "
                             f"{self.interleave0!r}")
        if self.push_batch < 1:
            raise ValueError(f"fused kernel config: push_batch must be ≥ 1, got {self.push_batch!r}")
        if self.num_stages < 1 or self.group_m < 1 or self.slice_group < 0:
            raise ValueError(f"fused kernel config: num_stages and group_m must be ≥ 1 and slice_group ≥ 0, got "
                             f"{self.num_stages}, {self.group_m}, {self.slice_group}")
        for name in ("a_tma0", "a_tma1", "defer_count", "ret_tma", "send_tma", "combine_pull", "combine_push"):
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"fused kernel config: {name} is a switch (0 or 1), got {getattr(self, name)!r}")
        for name in ("joint0", "gather0"):
            if getattr(self, name) not in (-1, 0, 1):
                raise ValueError(f"fused kernel config: {name} is -1 (auto), 0 or 1, got {getattr(self, name)!r}")
        if self.flat1 not in (0, 1, 2):
            raise ValueError(f"fused kernel config: flat1 is 0 (off), 1 (TMA stores) or 2 (register stores), "
                             f"got {self.flat1!r}")
        # A TMA box is at most 256 elements along each dimension.
        if self.send_tma and max(self.copy_rows, self.copy_cols) > 256:
            raise ValueError(f"fused kernel config: send_tma stores copy_rows × copy_cols boxes, each side ≤ 256; got "
                             f"{self.copy_rows} × {self.copy_cols} (e.g. INTERLACE_FUSED=send_tma=1,copy_cols=256)")
        if self.combine_pull and self.combine_push:
            raise ValueError("fused kernel config: combine_pull and combine_push are two layer1 modes; pick one")
        if self.ret_tma and max(self.block_m, self.block_n1) > 256:
            raise ValueError(f"fused kernel config: ret_tma stores block_m × block_n1 boxes, each side ≤ 256; got "
                             f"{self.block_m} × {self.block_n1}")


GPU_CONFIG = FusedKernelConfig()
# Under the interpreter each op costs the same whatever its size: wide blocks, few programs.
INTERPRETER_CONFIG = FusedKernelConfig(16, 32, 32, 32, 4, 1, 16, 64, 16, group_m=2, slice_group=1)
DEFAULT_SPINS = 1 << 26  # ~seconds of polling: far beyond any healthy wait, short of a hang


def kernel_config_from_env(base: FusedKernelConfig) -> FusedKernelConfig:
    """``INTERLACE_FUSED="block_n1=256,slice_group=0"`` overrides fields (tuning experiments)."""
    value = os.environ.get("INTERLACE_FUSED")
    if not value:
        return base
    fields = {}
    for item in value.split(","):
        key, _, v = item.partition("=")
        if not hasattr(base, key.strip()):
            raise ValueError(f"INTERLACE_FUSED: unknown field {key!r}")
        fields[key.strip()] = int(v)
    return replace(base, **fields)


def default_split(num_programs: int) -> tuple[int, int]:
    """Untuned (n_comm, n_comm1): about 1/8 of the programs move data. ``interlace tune`` measures."""
    n = max(1, num_programs // 8)
    return n, n


@dataclass
class ForwardGraph:
    """One token count's captured inference call: its recorder, static inputs (x, expert
    indices, routing weights) and static output, and the weights' addresses it was captured
    with. Nothing holds it between calls (``owner`` is always None)."""

    weights: tuple
    recorder: object
    static: tuple
    out: torch.Tensor
    owner = None


@dataclass
class FusedCall:
    """One rank's state of one call between the kernel phases."""

    x: torch.Tensor
    topk_weight: torch.Tensor
    row_of_assignment: torch.Tensor
    assignment_of_row: torch.Tensor
    plan: object
    h: torch.Tensor
    out: torch.Tensor
    kept: torch.Tensor | None = None  # (E,) rows kept per expert (the staged return exchange)


class FusedEngine:
    """The fused layer of one rank over one :class:`PeerBuffer` (any transport).

    :meth:`prepare` → :meth:`layer0` → :meth:`layer1`; each layer takes ``role`` ``"all"``
    (one launch, GPU) or runs its two program roles as separate launches (``"comm"``,
    ``"gemm"``): simulated ranks in one process and the staged transport call those in
    producer-before-consumer order across ranks.
    """

    def __init__(self, cfg, buf: PeerBuffer, kernel: FusedKernelConfig, n_programs: int, n_comm: int,
                 n_comm1: int, max_spins: int = DEFAULT_SPINS, timeline: bool = False):
        self.cfg, self.buf, self.kernel = cfg, buf, kernel
        self.n_programs, self.n_comm, self.n_comm1, self.max_spins = n_programs, n_comm, n_comm1, max_spins
        # ---- timeline (opt-in): per-work-item records, see interlace.kernels.timeline ----
        device = buf.epoch.device
        self.timeline = TimelineBuffer(device, CLOCK_GPU if device.type == "cuda" and not _INTERPRET
                                       else CLOCK_LOGICAL) if timeline else None

    def _timeline_args(self, call: FusedCall, layer: int):
        if self.timeline is None:
            return None
        n_blocks0 = -(-call.h.shape[1] // self.kernel.block_n)
        self.timeline.ensure(*layer_capacities(call.plan, n_blocks0, self.buf.spec.num_slices, call.out.shape[0],
                                               self.kernel.block_t))
        return self.timeline.args(layer)

    def timeline_records(self) -> list[dict]:
        """Records of this rank's last call (host sync); see :meth:`TimelineBuffer.records`."""
        if self.timeline is None:
            raise RuntimeError("the timeline is off: build the strategy with timeline=True")
        return self.timeline.records(int(self.buf.epoch.item()))

    def dispatch_index(self, topk_idx: torch.Tensor):
        cfg = self.cfg
        T = topk_idx.shape[0]
        if T > self.buf.spec.max_tokens:
            raise ValueError(f"{T} tokens exceed the fused buffers' max_tokens={self.buf.spec.max_tokens}; "
                             f"build the strategy with strategy_options={{'max_tokens': ...}}")
        return build_dispatch_index(topk_idx, cfg.num_experts, cfg.capacity(T))

    def prepare(self, x, topk_weight, index, counts_all) -> FusedCall:
        """Plan and buffers of a call; ``counts_all`` (W, E) int32 is every rank's ``kept``."""
        row_of_assignment, assignment_of_row, _, _ = index
        spec = self.buf.spec
        plan = build_plan(counts_all, self.buf.rank, spec.num_local, spec.max_tokens, spec.top_k, spec.block_m,
                          interleave=self.kernel.interleave0_args())
        K = self.cfg.ffn
        h = alloc.empty((spec.world * spec.cap, K), x.dtype, x.device)
        out = alloc.empty(x.shape, x.dtype, x.device)
        return FusedCall(x, topk_weight.contiguous(), row_of_assignment, assignment_of_row, plan, h, out, index[2])

    def layer0(self, call: FusedCall, w_up: torch.Tensor, role: str = "all", pre: torch.Tensor | None = None,
               backward: bool = False) -> None:
        """Forward: h = act(x rows @ W_upᵀ) (and the pre-activation into ``pre``). Backward
        (``call.x`` the weighted output-gradient rows, ``w_up`` = W_down): h = rows @ W_down."""
        dispatch_gemm0(call.x, call.assignment_of_row, w_up, call.h, self.buf, call.plan,
                       activation="none" if backward else self.cfg.activation, n_comm=self.n_comm,
                       n_programs=self.n_programs, config=self.kernel, max_spins=self.max_spins, role=role,
                       timeline=self._timeline_args(call, 0), pre=pre, w_kmajor=backward)

    def layer1(self, call: FusedCall, w_down: torch.Tensor, role: str = "all", backward: bool = False,
               keep_rows: bool = False) -> None:
        """Forward: out = combine(h @ W_downᵀ). Backward (``call.h`` = d_h, ``w_down`` = W_up,
        weights 1): out = Σ_j (d_h @ W_up)[row(t, j)] = dx. ``keep_rows``: the caller reads the
        returned rows (``ret``) afterwards, so pull mode is off for this call."""
        gemm1_combine(call.h, w_down, call.out, call.topk_weight, call.row_of_assignment, self.buf, call.plan,
                      n_comm=self.n_comm1, n_programs=self.n_programs, config=self.kernel,
                      max_spins=self.max_spins, role=role, timeline=self._timeline_args(call, 1), w_kmajor=backward,
                      pull=self.pulls(backward or keep_rows), push=self.pushes(backward or keep_rows))

    def pulls(self, keep_rows: bool = False) -> bool:
        """Whether layer1 runs in pull mode: asked for (``combine_pull``), on a transport with
        peer loads, and no returned rows wanted afterwards (training, the backward)."""
        return bool(self.kernel.combine_pull) and self.buf.kind != "staged" and not keep_rows

    def pushes(self, keep_rows: bool = False) -> bool:
        """Whether layer1 runs in push mode: asked for (``combine_push``), on a transport with
        peer stores, and the receive buffer not read after the call (training reads the rows
        it received there; the backward's weight gradients read its layer0 rows)."""
        return bool(self.kernel.combine_push) and self.buf.kind != "staged" and not keep_rows


def run_simulated(engines: list[FusedEngine], xs, topk_idxs, topk_weights, w_ups, w_downs) -> list[torch.Tensor]:
    """All ranks of a simulated world (one process), each phase of every rank before the next."""
    indices = [eng.dispatch_index(t) for eng, t in zip(engines, topk_idxs)]
    counts_all = torch.stack([ix[2] for ix in indices]).to(torch.int32)
    for eng in engines:
        eng.buf.advance_epoch()
    calls = [eng.prepare(x, w, ix, counts_all) for eng, x, w, ix in zip(engines, xs, topk_weights, indices)]
    for phase in (("layer0", "comm"), ("layer0", "gemm"), ("layer1", "gemm"), ("layer1", "push"), ("layer1", "comm")):
        for eng, call, wu, wd in zip(engines, calls, w_ups, w_downs):
            if phase[0] == "layer0":
                eng.layer0(call, wu, phase[1])
            elif phase[1] != "push" or eng.pushes():
                eng.layer1(call, wd, phase[1])
    for eng in engines:
        check_error_record(eng.buf)
    return [c.out for c in calls]


def check_error_record(buf: PeerBuffer) -> None:
    """Raise if a wait of this rank timed out (reads the record: a host sync)."""
    message = describe_error(buf.error.tolist())
    if message:
        buf.error.zero_()
        raise RuntimeError(message)


class _FusedMoE(torch.autograd.Function):
    """Forward: the fused kernels. Backward: recompute through ``sequential`` and differentiate."""

    @staticmethod
    def forward(ctx, x, topk_weight, w_up, w_down, strategy, topk_idx):
        ctx.strategy = strategy
        ctx.save_for_backward(x, topk_weight, w_up, w_down, topk_idx)
        return strategy._forward(x, topk_idx, topk_weight, w_up, w_down)

    @staticmethod
    def backward(ctx, grad):
        x, topk_weight, w_up, w_down, topk_idx = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (x, topk_weight, w_up, w_down)]
        with torch.enable_grad():
            out = ctx.strategy.recompute(inputs[0], topk_idx, *inputs[1:])
            need = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, need, grad, allow_unused=True))
        return (*[next(grads) if t.requires_grad else None for t in inputs], None, None)


@register_strategy
class FusedStrategy(Strategy):
    name = "fused"
    fused_routing = True

    def __init__(self, config, ep, max_tokens: int | None = None, n_comm: int | str = "auto",
                 n_comm1: int | str = "auto", max_spins: int = DEFAULT_SPINS, transport: str = "auto",
                 symm_backend: str | None = None, kernel: FusedKernelConfig | None = None, timeline: bool = False,
                 train_path: str = "sequential", cuda_graph: bool = True):
        super().__init__(config, ep)
        self.cuda_graph = bool(cuda_graph)
        self._graphs: OrderedDict = OrderedDict()  # T → ForwardGraph (inference calls)
        self._graph_seen: set = set()
        # fused:train's graphs: T → TrainGraph; token counts seen by an eager forward / backward.
        self._train_graphs: OrderedDict = OrderedDict()
        self._train_seen: set = set()
        self._train_backward_seen: set = set()
        self.graph_recorder = None  # None: CUDA graphs where possible; tests put an EagerRecorder here
        _LIVE.add(self)
        if train_path not in TRAIN_PATHS:
            raise ValueError(f"train_path must be one of {TRAIN_PATHS}, got {train_path!r}")
        self.train_path = train_path
        self.timeline = bool(timeline)
        if transport not in ("auto", "symmetric", "staged"):
            raise ValueError(f"transport must be 'auto', 'symmetric' or 'staged', got {transport!r}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        for name, v in (("n_comm", n_comm), ("n_comm1", n_comm1)):
            if v != "auto" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or 'auto', got {v!r}")
        self.max_tokens, self.transport, self.symm_backend = max_tokens, transport, symm_backend
        self._n_comm_opt, self._n_comm1_opt, self.max_spins = n_comm, n_comm1, max_spins
        self.kernel = kernel
        self.buf: PeerBuffer | None = None
        self.engine: FusedEngine | None = None
        self.split_source = "unset"  # "option", "tuned" or "default": where n_comm came from
        self._recompute = SequentialStrategy(config, ep)
        self._pending_error: tuple | None = None

    # -- set-up (first call) ---------------------------------------------------------------
    def _setup(self, x: torch.Tensor) -> None:
        cfg, ep = self.config, self.ep
        max_tokens = self.max_tokens
        if max_tokens is None:
            # First call only: agree on a size for the symmetric buffers (a host sync).
            t = torch.tensor([x.shape[0]], dtype=torch.int64, device=ep.collective_device())
            if ep.world > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ep.group)
            max_tokens = max(1, int(t.item()))
        on_gpu = x.is_cuda
        kernel = self.kernel or kernel_config_from_env(GPU_CONFIG if on_gpu and not _INTERPRET else INTERPRETER_CONFIG)
        spec = BufferSpec(ep.world, ep.num_local, cfg.hidden, cfg.top_k, max_tokens, kernel.block_m,
                          kernel.block_n1, cfg.dtype)
        transport = self.transport
        if transport == "auto":
            transport = "symmetric" if on_gpu and ep.world > 1 else "staged"
        if ep.world == 1:
            transport = "local"
        self.buf = shared_buffer(spec, "simulated" if transport == "local" else transport, ep.group, x.device,
                                 self.symm_backend)
        self.transport_used = transport
        n_programs = torch.cuda.get_device_properties(x.device).multi_processor_count if on_gpu else 4
        n_comm, n_comm1 = self._resolve_split(n_programs, x.shape[0], tuned_tables=on_gpu)
        self.engine = FusedEngine(cfg, self.buf, kernel, n_programs, n_comm, n_comm1, self.max_spins, self.timeline)

    def _resolve_split(self, n_programs: int, tokens: int, tuned_tables: bool = True) -> tuple[int, int]:
        from interlace.tuning.fused_split import lookup_split

        tuned = None
        if tuned_tables and "auto" in (self._n_comm_opt, self._n_comm1_opt):  # tables exist for GPUs only
            tuned = lookup_split(self.config, tokens, self.ep.world, n_programs)
        default = tuned or default_split(n_programs)
        n_comm = default[0] if self._n_comm_opt == "auto" else self._n_comm_opt
        n_comm1 = default[1] if self._n_comm1_opt == "auto" else self._n_comm1_opt
        self.split_source = "option" if "auto" not in (self._n_comm_opt, self._n_comm1_opt) else (
            "tuned" if tuned else "default")
        if not (0 < n_comm < n_programs and 0 < n_comm1 < n_programs):
            raise ValueError(f"n_comm={n_comm}, n_comm1={n_comm1} must be in [1, {n_programs - 1}] "
                             f"({n_programs} programs on this device)")
        return n_comm, n_comm1

    @property
    def split(self) -> tuple[int, int] | None:
        """(n_comm, n_comm1) in use, once set up; ``split_source`` says where they came from."""
        return None if self.engine is None else (self.engine.n_comm, self.engine.n_comm1)

    @classmethod
    def parse_arg(cls, arg: str) -> dict:
        if arg in ("graph", "eager"):  # "fused:eager": no CUDA graphs
            return {"cuda_graph": arg == "graph"}
        if arg == "train":  # "fused:train": training through the fused kernels too
            return {"train_path": "fused"}
        return {"train_path": arg}  # "fused:recompute"

    # -- calls --------------------------------------------------------------------------------
    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weight, w_up, w_down))
        if training and self.train_path == "sequential":
            return self._recompute(x, topk_idx, topk_weight, w_up, w_down)  # sequential's graph, no recompute
        if self.engine is None:
            self._setup(x)
        self._raise_pending_error()
        if training and self.train_path == "fused":
            from interlace.strategies.fused.train import FusedTrain

            return FusedTrain.apply(x, topk_weight, w_up, w_down, self, topk_idx)
        if training:
            return _FusedMoE.apply(x, topk_weight, w_up, w_down, self, topk_idx)
        recorder = self._recorder(x)
        if recorder is not None:
            return self._graph_forward(x, topk_idx, topk_weight, w_up, w_down, recorder)
        return self._forward(x, topk_idx, topk_weight, w_up, w_down)

    def _graphable(self) -> bool:
        return (self.buf.kind == "symmetric" and not _INTERPRET and self.engine.timeline is None
                and not getattr(self, "profile_phases", False) and not torch.cuda.is_current_stream_capturing())

    def release_graphs(self) -> int:
        """Drop this strategy's captured CUDA graphs (inference and training); returns how many.
        A call whose backward is still to come keeps its saved state and runs that backward
        eagerly."""
        n = len(self._graphs) + len(self._train_graphs)
        for entry in self._train_graphs.values():
            entry.retire()
        self._graphs.clear()
        self._train_graphs.clear()
        return n

    def _recorder(self, x):
        """The graph recorder for this call, or None to run it eagerly (CUDA graphs off or
        impossible here, or an empty batch: nothing to gain). Tests set ``graph_recorder``."""
        if x.shape[0] == 0 or getattr(self, "profile_phases", False) or self.engine.timeline is not None:
            return None
        if self.graph_recorder is not None:
            return self.graph_recorder
        if not (self.cuda_graph and self._graphable()):
            return None
        guard_destroy_process_group()
        return CudaGraphRecorder

    def _graph_entry(self, table: OrderedDict, seen: set, T: int, weights: tuple, make):
        """Token count T's graph in ``table`` (least recently used first), made by ``make()``
        when there is none for these weights, or None to run eagerly: the first call with T
        (it compiles the kernels and warms NCCL), T's graph held by a call whose backward has
        not run (``owner``), or no room that an idle graph could free."""
        entry = table.get(T)
        if entry is not None and entry.owner is not None:
            return None
        if entry is None or entry.weights != weights:
            if T not in seen:
                seen.add(T)
                return None
            if entry is not None:
                del table[T]
            while len(table) >= MAX_GRAPHS:  # drop the least recently used idle one
                idle = next((t for t, e in table.items() if e.owner is None), None)
                if idle is None:
                    return None
                del table[idle]
            entry = table[T] = make()
        table.move_to_end(T)
        return entry

    def _train_graph(self, x, w_up, w_down):
        """This training call's :class:`~interlace.strategies.fused.train.TrainGraph`, or None
        to run it eagerly (:meth:`_recorder`, :meth:`_graph_entry`)."""
        from interlace.strategies.fused.train import TrainGraph

        recorder = self._recorder(x)
        if recorder is None:
            return None
        weights = (w_up.data_ptr(), w_down.data_ptr())
        return self._graph_entry(self._train_graphs, self._train_seen, x.shape[0], weights,
                                 lambda: TrainGraph(weights, recorder))

    def _graph_forward(self, x, topk_idx, topk_weight, w_up, w_down, recorder):
        weights = (w_up.data_ptr(), w_down.data_ptr())

        def capture():
            static = (x.clone(), topk_idx.clone(), topk_weight.clone())
            rec = recorder()
            out = rec.capture(lambda: self._forward_kernels(*static, w_up, w_down), x.device)
            return ForwardGraph(weights, rec, static, out)

        entry = self._graph_entry(self._graphs, self._graph_seen, x.shape[0], weights, capture)
        if entry is None:
            return self._forward(x, topk_idx, topk_weight, w_up, w_down)
        sx, sidx, sw = entry.static
        sx.copy_(x)
        sidx.copy_(topk_idx)
        sw.copy_(topk_weight)
        entry.recorder.replay()  # (after a capture too: capture records the work without running it)
        self._check_errors()
        return entry.out.clone()  # the static output is overwritten by the next replay

    def recompute(self, x, topk_idx, topk_weight, w_up, w_down):
        return self._recompute(x, topk_idx, topk_weight, w_up, w_down)

    def _forward(self, x, topk_idx, topk_weight, w_up, w_down):
        out = self._forward_kernels(x, topk_idx, topk_weight, w_up, w_down)
        self._check_errors()
        return out

    def _order_after_peers(self) -> None:
        """A one-element all-reduce (a device collective: no host sync) before a call that
        does not start with the count exchange (the backward): no peer writes into this rank's
        shared buffers for it until this rank is done with its previous use of them."""
        if self.ep.world > 1:
            dist.all_reduce(torch.zeros(1, device=self.ep.collective_device()), group=self.ep.group)

    def _check_errors(self) -> None:
        """After the kernels: a timed-out wait raises (on the symmetric transport at the next
        call, without a host sync now)."""
        if self.buf.kind == "symmetric" and not _INTERPRET:
            self._record_error_check()
        else:
            check_error_record(self.buf)

    def _forward_kernels(self, x, topk_idx, topk_weight, w_up, w_down):
        """Everything from the routing to the output, on the device (capturable on CUDA)."""
        call, _ = self._prepare_call(x, topk_idx, topk_weight)
        self._run_layers(call, w_up, w_down)
        return call.out

    def _prepare_call(self, x, topk_idx, topk_weight):
        """Dispatch index, count exchange, epoch and plan of a call: ``(FusedCall, index)``."""
        eng, buf, ep = self.engine, self.buf, self.ep
        index = eng.dispatch_index(topk_idx)
        kept = index[2]
        counts_all = torch.empty(ep.world * kept.numel(), dtype=torch.int32, device=kept.device)
        if ep.world > 1:
            # Device collective, no host sync; also orders this call after every rank's
            # previous call (buffers are reused only once all peers are done with them).
            dist.all_gather_into_tensor(counts_all, kept.to(torch.int32), group=ep.group)
        else:
            counts_all.copy_(kept)
        counts_all = counts_all.view(ep.world, -1)
        buf.advance_epoch()
        return eng.prepare(x, topk_weight, index, counts_all), index

    def _run_layers(self, call, w0, w1, pre=None, backward=False, between=None):
        """layer0 with ``w0`` then layer1 with ``w1`` on this buffer's transport. ``between``
        runs after layer0 (the backward's activation derivative)."""
        eng, buf = self.engine, self.buf
        if buf.kind == "symmetric" and not _INTERPRET:
            marks = self._phase_marks()
            eng.layer0(call, w0, pre=pre, backward=backward)
            marks and marks[1].record()
            if between is not None:
                between()
            eng.layer1(call, w1, backward=backward, keep_rows=pre is not None)
            marks and marks[2].record()
        else:
            eng.layer0(call, w0, "comm", pre=pre, backward=backward)
            buf.exchange_dispatch()
            eng.layer0(call, w0, "gemm", pre=pre, backward=backward)
            if between is not None:
                between()
            eng.layer1(call, w1, "gemm", backward=backward, keep_rows=pre is not None)
            if buf.kind == "staged":
                buf.exchange_return(self._owner_of_rows(call.kept, call.out.shape[0]), int(call.kept.sum()))
            eng.layer1(call, w1, "comm", backward=backward, keep_rows=pre is not None)

    def _phase_marks(self):
        """With ``profile_phases = True``: CUDA events (start, after layer0, after layer1) of the
        last call, for :meth:`phase_ms` (debugging and the GPU check script)."""
        if not getattr(self, "profile_phases", False):
            return None
        self._marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self._marks[0].record()
        return self._marks

    def phase_ms(self) -> dict:
        """(prepare excluded) layer0 and layer1 times of the last profiled call; syncs."""
        a, b, c = self._marks
        c.synchronize()
        return {"layer0": a.elapsed_time(b), "layer1": b.elapsed_time(c)}

    def _owner_of_rows(self, kept: torch.Tensor, tokens: int) -> torch.Tensor:
        """Staged transport: rank owning the expert of each dispatch row (R,) int64."""
        owner = torch.arange(kept.numel(), device=kept.device) // self.ep.num_local
        return torch.repeat_interleave(owner, kept.long())

    def _record_error_check(self) -> None:
        # No host sync: copy the error record to pinned memory behind the kernels; the next
        # call raises if that copy has landed and shows a timed-out wait.
        if self._pending_error is None:
            host = torch.zeros(8, dtype=torch.int32, pin_memory=True)
            self._pending_error = (host, torch.cuda.Event())
        host, event = self._pending_error
        host.copy_(self.buf.error, non_blocking=True)
        event.record()

    def _raise_pending_error(self) -> None:
        if self._pending_error is None:
            return
        host, event = self._pending_error
        if event.query():
            message = describe_error(host.tolist())
            if message:
                self.buf.error.zero_()
                host.zero_()
                raise RuntimeError(message)

    def timeline_records(self) -> list[dict]:
        """With ``timeline=True``: one dict per work item of this rank's last call (layer, kind,
        pid, sm, item, start/waited/end in ns from the call's first start); a host sync.
        Drawn by :mod:`interlace.tools.timeline`."""
        if self.engine is None:
            raise RuntimeError("no call yet: the timeline holds the records of the last call")
        return self.engine.timeline_records()

    def synchronize_and_check(self) -> None:
        """Wait for this rank's work and raise if any wait timed out (tests, stress runs)."""
        if self.buf is not None:
            check_error_record(self.buf)
