"""Launcher of the persistent MoE kernel: tile choice, workspace, grid sizing, error records.

:func:`persistent_moe` runs one layer call (world size 1) in one launch:
x (T, N), router weight (E, N) fp32, optional selection bias (E,) fp32, w_up (E, up_width, N),
w_down (E, N, K) → out (T, N) in x's dtype. No host sync: the launch is sized from T alone
(:class:`~interlace.kernels.persistent.tasks.TaskLayout`). The counters and the epoch live in a
:class:`PersistentState` that the caller keeps across calls (nothing is reset between calls).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from interlace.kernels import alloc
from interlace.kernels.expert_gemm.tile import ACTIVATION_ID
from interlace.kernels.launch import direct_launcher, launch, next_power_of_2
from interlace.kernels.launch import hooked as launch_hooked
from interlace.kernels.persistent.args import (
    GemmTiles, MoeCall, MoeFrontTiles, MoeKernelArgs, MoeModes, MoeWorkspace, Routing, Sizes, Sync, TimelineArgs,
    check_signature, weight_tensors, weights_group,
)
from interlace.kernels.persistent.config import (
    GATE_TOKENS, PersistentKernelConfig, host_error_record, programs_per_sm, timeline_args, timeline_buffer,
)
from interlace.kernels.persistent.kernel import persistent_moe_kernel
from interlace.kernels.persistent.protocol import Word, describe_error, state_views, state_words
from interlace.kernels.persistent.tasks import TASK_ORDERS, TIMELINE_KINDS, TaskLayout
from interlace.kernels.rows import _INTERPRET

DEFAULT_SPINS = 1 << 22  # polls of one wait before it gives up (seconds on a GPU; never reached when correct)
INDEX_BLOCK = 128  # assignments per step of the index task's row loop (BLOCK_A)
_OCCUPANCY: dict = {}  # (device index, kernel key) → programs per SM, from the compiled kernel

check_signature(persistent_moe_kernel, MoeKernelArgs)


class PersistentState:
    """The kernel's persistent device state (:mod:`~interlace.kernels.persistent.protocol`: head
    words, per-tile GEMM0 counters, error record) in one int32 tensor that grows (zeroed, epoch
    restarting at 0) when a call needs more tiles, and the record's host mirror
    (:func:`~interlace.kernels.persistent.config.host_error_record`). Keep one per layer; not
    shared between streams."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.host_error: torch.Tensor | None = None

    def views(self, device: torch.device, max_tiles: int):
        """(head, per-tile counters, error record) of a buffer for ``max_tiles`` row tiles."""
        need = state_words(max_tiles)
        if self.buffer is None or self.buffer.device != device or self.buffer.numel() < need:
            self.buffer = torch.zeros(max(need, 2 * (self.buffer.numel() if self.buffer is not None else 0)),
                                      dtype=torch.int32, device=device)
        if self.host_error is None:
            self.host_error = host_error_record(device)
        return state_views(self.buffer)

    def error_record(self) -> torch.Tensor | None:
        return None if self.buffer is None else state_views(self.buffer)[2]

    def check(self) -> None:
        """Raise ``RuntimeError`` if a wait of an earlier call timed out (reads the record: a host
        sync), and clear the record and its mirror."""
        record = self.error_record()
        if record is None:
            return
        message = describe_error(record.tolist())
        if message:
            record.zero_()
            self.host_error.zero_()
            raise RuntimeError(message)


class CallPlan:
    """Everything of one call shape that is the same from call to call: the tile choice, the
    :class:`TaskLayout`, the grid, the workspace tensors, the state's views and the kernel's
    arguments (:attr:`args`, a :class:`~interlace.kernels.persistent.args.MoeKernelArgs`; each
    call puts its own x and out first); after its first launch, the compiled kernel's own
    launcher (:func:`interlace.kernels.launch.direct_launcher`), so that a repeated call costs
    one allocation (out) and one launch of host work.

    A plan is valid for x of its ``T``, dtype and device with the weights it was built with
    (:meth:`matches`) and while ``state`` keeps the buffer it was built on (the state grows it
    for a call with more tiles). Calls of one plan share its workspace: they run in stream order
    on one stream (as the state requires anyway).
    """

    def __init__(self, x: torch.Tensor, router_weight: torch.Tensor, expert_bias: torch.Tensor | None,
                 w_up: torch.Tensor, w_down: torch.Tensor, state: PersistentState, *, top_k: int, softmax: bool,
                 renormalize: bool, route_scale: float, activation: str, w_pieces: int,
                 config: PersistentKernelConfig, max_spins: int, order: str, timeline: int = 0,
                 round_logits: int = 0, capacity: int | None = None):
        """``capacity``: each expert's capacity in this call (``MoEConfig.capacity(T)``: the
        assignments served slot-major, the rest dropped); None: dropless."""
        if order not in TASK_ORDERS:
            raise ValueError(f"order must be one of {TASK_ORDERS}, got {order!r}")
        for name, t in (("router_weight", router_weight), ("w_up", w_up), ("w_down", w_down)):
            if not all(p.is_contiguous() for p in weight_tensors(t)):
                raise ValueError(f"persistent: {name} must be contiguous")
        T, N = x.shape
        E, up_width, _ = w_up.shape
        K = w_down.shape[2]
        self.T, self.N, self.dtype, self.device = T, N, x.dtype, x.device
        self.weights = (router_weight, expert_bias, w_up, w_down)
        self.weight_ptrs = weight_ptrs(router_weight, expert_bias, w_up, w_down)
        self.config = c = config
        self.block_m = block_m = c.rows_per_tile(T, top_k, E)
        block_k0, block_n0, block_n1, block_k1 = c.tiles(block_m)
        weights, fp8 = weights_group(router_weight, expert_bias, w_up, w_down, (block_n0, block_k1))
        self.layout = layout = TaskLayout.build(T, N, K, E, top_k, c.block_t or GATE_TOKENS, block_m, block_k0,
                                                block_n1, c.block_tc, c.block_nc)
        e_pad = max(16, next_power_of_2(E))
        TK = T * top_k
        n_hist = layout.n_gate * e_pad * (top_k if capacity is not None else 1)
        # One int32 workspace: idx, weights (as fp32), ranks, row_of, asg_of (T·k each), hist and
        # base (n_gate·E_PAD each, ·k with a capacity), offsets (E_PAD), the tile table (3·max_tiles).
        ints = alloc.empty((5 * TK + 2 * n_hist + e_pad + 3 * layout.max_tiles,), dtype=torch.int32,
                           device=x.device)
        idx, wt, lrank, row_of, asg_of = (ints[i * TK:(i + 1) * TK] for i in range(5))
        wt = wt.view(torch.float32)
        rest = ints[5 * TK:]
        hist, base, offs, tiles = (rest[:n_hist], rest[n_hist:2 * n_hist], rest[2 * n_hist:2 * n_hist + e_pad],
                                   rest[2 * n_hist + e_pad:])
        # The activations and expert outputs: scratch each call writes before reading, one buffer
        # for every plan of this shape in the process (a plan per layer and token count).
        h = alloc.shared("persistent.h", (TK, K), x.dtype, x.device)
        y = alloc.shared("persistent.y", (TK, N), x.dtype, x.device)
        self.state = state
        st, _, err = state.views(x.device, layout.max_tiles)
        self.state_buffer = state.buffer
        self.workspace = dict(idx=idx, weight=wt, row_of_assignment=row_of, assignment_of_row=asg_of, tiles=tiles,
                              state=st, block_m=block_m, layout=layout)
        self._occupancy_key = (x.device.index, block_m, e_pad, top_k, activation, x.dtype, c, timeline, round_logits,
                               capacity is not None)
        self.round_logits = round_logits
        self.programs = self._programs()
        self.timeline = timeline_buffer(x.device, timeline, layout.total)
        self.args = MoeKernelArgs(
            call=MoeCall(x_ptr=x, out_ptr=None, n_programs=self.programs),  # (x, out: each call's own, run)
            weights=weights,
            workspace=MoeWorkspace(idx_ptr=idx, wt_ptr=wt, lrank_ptr=lrank, row_of_ptr=row_of, asg_of_ptr=asg_of,
                                   hist_ptr=hist, base_ptr=base, offs_ptr=offs, tiles_ptr=tiles, h_ptr=h, y_ptr=y),
            sync=Sync(state_ptr=self.state_buffer, err_ptr=err, host_err_ptr=state.host_error,
                      max_spins=int(max_spins)),
            sizes=Sizes(T=T, N=N, K=K, E=E, UP=up_width, scale=float(route_scale), capacity=capacity or 0),
            tasks=layout,
            timeline=TimelineArgs(*timeline_args(self.timeline)),
            front_tiles=MoeFrontTiles(BLOCK_T=c.block_t or GATE_TOKENS, BLOCK_G=c.block_g or 32, BLOCK_A=INDEX_BLOCK),
            gemm_tiles=GemmTiles(BLOCK_J=max(16, min(64, 2048 // e_pad)), BLOCK_M=block_m, BLOCK_K0=block_k0,
                                 BLOCK_N0=block_n0, BLOCK_N1=block_n1, BLOCK_K1=block_k1, BLOCK_TC=c.block_tc,
                                 BLOCK_NC=c.block_nc),
            routing=Routing(TOP_K=top_k, E_PAD=e_pad, SOFTMAX=softmax, HAS_BIAS=expert_bias is not None,
                            RENORMALIZE=renormalize, W_PIECES=w_pieces, DOT_FP32=_INTERPRET,
                            ROUND_LOGITS=round_logits, CAPACITY=capacity is not None),
            modes=MoeModes(ACTIVATION=ACTIVATION_ID[activation], ORDER=TASK_ORDERS.index(order), TIMELINE=timeline,
                           W_FP8=fp8),
        )
        self.constexprs = self.args.constexprs()
        self._rest = self.args.runtime(skip_call=True)  # (the arguments after the call's x, out, grid)
        self._direct = None

    def _programs(self) -> int:
        c = self.config
        if c.programs is not None:
            programs = c.programs
        elif _INTERPRET or self.device.type != "cuda":
            programs = 3
        else:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            programs = sms * _OCCUPANCY.get(self._occupancy_key, 1)
        return max(1, min(programs, self.layout.total))

    def timeline_records(self) -> list[dict]:
        """The last call's task records (``timeline`` on; a host sync): see
        :meth:`TimelineBuffer.task_records`, kinds :data:`~tasks.TIMELINE_KINDS`."""
        return self.timeline.task_records(int(self.state_buffer[Word.EPOCH]), TIMELINE_KINDS)

    def matches(self, x: torch.Tensor, router_weight, expert_bias, w_up, w_down) -> bool:
        """Whether this plan runs ``x`` with these weights (same T, dtype, device, weight
        addresses, and the state's buffer unchanged)."""
        return (x.shape[0] == self.T and x.dtype == self.dtype and x.device == self.device
                and self.state.buffer is self.state_buffer
                and weight_ptrs(router_weight, expert_bias, w_up, w_down) == self.weight_ptrs)

    def kernel_args(self, x: torch.Tensor, out: torch.Tensor) -> tuple:
        """The kernel's non-constexpr arguments, by position, for x and out (the grid:
        ``self.programs``): the call group, then the plan's :attr:`args` past it."""
        return (x, out, self.programs, *self._rest)

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out (T, N) in x's dtype for x (T, N) contiguous, with the plan's weights (into ``out``
        when given)."""
        out = alloc.empty((self.T, self.N), dtype=self.dtype, device=self.device) if out is None else out
        if self.T == 0:
            return out
        direct = self._direct
        if direct is not None and x.data_ptr() % 16 == 0 and not launch_hooked():
            direct(self.programs, *self.kernel_args(x, out))
            return out
        args = self.kernel_args(x, out)
        kwargs = dict(num_warps=self.config.num_warps, num_stages=self.config.num_stages, **self.constexprs)
        compiled = launch(persistent_moe_kernel, (self.programs,), *args, **kwargs)
        if self.device.type == "cuda" and not _INTERPRET:
            key = self._occupancy_key
            if self.config.programs is None and key not in _OCCUPANCY:
                _OCCUPANCY[key] = programs_per_sm(compiled, self.device, self.config.num_warps)
                programs = self._programs()
                if programs != self.programs:  # (the next launch: the grid is an argument too)
                    self.programs = programs
                    self.args = replace(self.args, call=self.args.call._replace(n_programs=programs))
                    return out
            if x.data_ptr() % 16 == 0:
                self._direct = direct_launcher(persistent_moe_kernel, args, kwargs)
        return out


def weight_ptrs(router_weight, expert_bias, w_up, w_down) -> tuple:
    """The weights' addresses: what a plan (and a CUDA graph of it) holds."""
    return tuple(0 if t is None else t.data_ptr() for t in weight_tensors(router_weight, expert_bias, w_up, w_down))


def persistent_moe(x: torch.Tensor, router_weight: torch.Tensor, expert_bias: torch.Tensor | None,
                   w_up: torch.Tensor, w_down: torch.Tensor, state: PersistentState, *, top_k: int, softmax: bool,
                   renormalize: bool, route_scale: float, activation: str, w_pieces: int,
                   config: PersistentKernelConfig = PersistentKernelConfig(), max_spins: int = DEFAULT_SPINS,
                   order: str = "normal", workspace: dict | None = None, round_logits: int = 0) -> torch.Tensor:
    """One MoE layer call (world size 1) in one launch; see the module. (A caller that repeats
    a shape keeps a :class:`CallPlan` instead: this builds one per call.)

    Args:
        x: (T, N) tokens, bf16/fp16/fp32.
        router_weight: (E, N) fp32; expert_bias: (E,) fp32 selection bias, or None.
        w_up: (E, up_width, N) (SwiGLU: gate rows first); w_down: (E, N, K); x's dtype, or both
            :class:`~interlace.fp8.BlockFP8Weight` (e4m3, 128 × 128 block scales: W8A16).
        state: the caller's :class:`PersistentState` (counters and epoch, kept across calls).
        top_k, softmax, renormalize, route_scale: the routing (:class:`interlace.config.MoEConfig`).
        activation: ``"swiglu"``, ``"gelu"`` or ``"relu"``; w_pieces: :func:`router_pieces`.
        order: ``"normal"``; ``"combine_first"`` (tests) breaks the task order on purpose.
        workspace: if a dict, filled with the intermediate tensors (tests read the routing and
            the index from it).
        round_logits: 1 / 2: the router logits rounded to bf16 / fp16 before the choice (a
            router whose logits GEMM runs in that dtype; ``strategies.persistent.logits_rounding``).
    Returns:
        (T, N) in x's dtype. A timed-out wait leaves an error record in ``state`` (see
        :meth:`PersistentState.check`); nothing here reads it.
    """
    if order not in TASK_ORDERS:
        raise ValueError(f"order must be one of {TASK_ORDERS}, got {order!r}")
    x, router_weight = x.contiguous(), router_weight.contiguous()
    if x.shape[0] == 0:
        return alloc.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    plan = CallPlan(x, router_weight, expert_bias, w_up, w_down, state, top_k=top_k, softmax=softmax,
                    renormalize=renormalize, route_scale=route_scale, activation=activation, w_pieces=w_pieces,
                    config=config, max_spins=max_spins, order=order, round_logits=round_logits)
    out = plan.run(x)
    if workspace is not None:
        workspace.update(plan.workspace, programs=plan.programs)
    return out
