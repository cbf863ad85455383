"""The persistent kernels' parameters by name: one frozen dataclass per kernel family,
:class:`MoeKernelArgs` for ``persistent_moe_kernel`` (world size 1) and :class:`DistKernelArgs`
for ``persistent_dist_kernel`` (W > 1), whose fields are groups of parameters (the call,
weights, workspace, state and waits, sizes, task counts, timeline, tiles, routing, modes), each
an immutable named tuple (cheap to build and to flatten: a plan builds them on a miss of its
cache, and a server's varying batch sizes make misses).

A group's field is named as the kernel's parameter, and the kernel takes the groups' fields in
the order the family lists them, constexpr groups last (:func:`check_signature`, run when a
launcher is imported, holds the two together), so ``kernel[grid](**args.as_kwargs())`` is a
launch. The launchers pass the runtime fields by position (:meth:`KernelArgs.runtime`) and the
constexprs by name (:meth:`KernelArgs.constexprs`), the way
:func:`interlace.kernels.launch.launch` caches a compiled kernel by: they build the arguments
once per call shape and, per call, only put the call group (tokens in and out, the grid, and at
W > 1 the launch's task range) before the cached rest.

Shapes: T tokens (this rank's), N hidden, K the expert's intermediate width, UP its up width
(2·K for SwiGLU, else K), E experts, E_loc this rank's experts (W > 1), k = TOP_K.
"""

import inspect
from dataclasses import dataclass, fields
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

import torch

from interlace.kernels.persistent.tasks import TaskLayout

Tensor = torch.Tensor


class MoeCall(NamedTuple):
    """Per call: x (T, N), out (T, N) in x's dtype, the grid (programs). (A plan's
    :attr:`~interlace.kernels.persistent.launch.CallPlan.args` hold this group as built, with no
    out: each launch passes its own.)"""

    x_ptr: Tensor
    out_ptr: Tensor | None
    n_programs: int


class DistCall(NamedTuple):
    """Per launch at W > 1: x (T, N), out (T, N), the grid, the launch's task numbers
    [task_lo, task_hi), and ``final`` (1: the launch ends the call, resetting the counters).
    (A plan's args hold a placeholder: each launch passes its own.)"""

    x_ptr: Tensor
    out_ptr: Tensor | None
    n_programs: int
    task_lo: int
    task_hi: int
    final: int


class Weights(NamedTuple):
    """Router (E, N) fp32, selection bias (E,) fp32 (the router weight where there is none:
    ``HAS_BIAS`` off), w_up (E or E_loc, UP, N) and w_down (E or E_loc, N, K) in x's dtype, or
    e4m3 (``W_FP8``) with their fp32 128 × 128 block scales (E or E_loc, ⌈UP/128⌉, ⌈N/128⌉) and
    (…, ⌈N/128⌉, ⌈K/128⌉) (the router weight where the weights are not FP8: never read)."""

    rw_ptr: Tensor
    bias_ptr: Tensor
    w_up_ptr: Tensor
    w_down_ptr: Tensor
    w_up_scale_ptr: Tensor
    w_down_scale_ptr: Tensor


def weights_group(router_weight: Tensor, expert_bias: Tensor | None, w_up, w_down,
                  reduction_steps: tuple[int, int]) -> tuple[Weights, bool]:
    """(the :class:`Weights` group, whether the experts are FP8). ``w_up`` / ``w_down``: dense
    tensors, or :class:`~interlace.fp8.BlockFP8Weight` pairs (their e4m3 tensors and block
    scales, dequantized in the GEMM tasks, whose reduction steps ``reduction_steps`` = (GEMM0's
    over N, GEMM1's over K) must each stay inside one 128-wide scale block: at most 128)."""
    fp8 = hasattr(w_up, "scale_inv")
    if fp8 != hasattr(w_down, "scale_inv"):
        raise TypeError("persistent: w_up and w_down must both be FP8 (BlockFP8Weight) or both dense")
    if fp8 and max(reduction_steps) > 128:
        raise ValueError(f"persistent: FP8 experts need reduction steps of at most 128 (one scale block), got "
                         f"block_n0, block_k1 = {reduction_steps}")
    bias = expert_bias if expert_bias is not None else router_weight
    if not fp8:
        return Weights(router_weight, bias, w_up, w_down, router_weight, router_weight), False
    return Weights(router_weight, bias, w_up.weight, w_down.weight, w_up.scale_inv, w_down.scale_inv), True


def weight_tensors(*weights) -> tuple:
    """Every tensor behind ``weights`` (None kept; an FP8 weight: its e4m3 tensor and scales)."""
    return tuple(t for w in weights for t in ((w.weight, w.scale_inv) if hasattr(w, "scale_inv") else (w,)))


class MoeWorkspace(NamedTuple):
    """Per call shape (world size 1): per assignment (T·k,) the expert (int32), weight (fp32),
    rank within its gate block, row and (by row) assignment; per gate block (n_gate·E_PAD, ·k
    with a capacity) histograms and bases; offsets (E_PAD,); the tile table (3, max_tiles);
    h (T·k, K) and y (T·k, N) in x's dtype."""

    idx_ptr: Tensor
    wt_ptr: Tensor
    lrank_ptr: Tensor
    row_of_ptr: Tensor
    asg_of_ptr: Tensor
    hist_ptr: Tensor
    base_ptr: Tensor
    offs_ptr: Tensor
    tiles_ptr: Tensor
    h_ptr: Tensor
    y_ptr: Tensor


class DistWorkspace(NamedTuple):
    """Per call shape (W > 1): logits parts (n_ls·T, E_PAD) fp32; per assignment (T·k,) the
    expert, weight (fp32), rank within its block and slot; histograms and bases per top-k
    block; counts per expert (E_PAD,), offsets per (source, local expert) (W·EL_PAD,), the tile
    table (3, mt); h (mt·BLOCK_M, K) in x's dtype."""

    logits_ptr: Tensor
    idx_ptr: Tensor
    wt_ptr: Tensor
    lrank_ptr: Tensor
    slot_ptr: Tensor
    hist_ptr: Tensor
    base_ptr: Tensor
    counts_ptr: Tensor
    offs_ptr: Tensor
    tiles_ptr: Tensor
    h_ptr: Tensor


class PeerTables(NamedTuple):
    """(W,) int64 each: every rank's address of a symmetric region (dist_tasks: recv, amap,
    ret, counts, sent, done)."""

    recv_table: Tensor
    amap_table: Tensor
    ret_table: Tensor
    counts_table: Tensor
    sent_table: Tensor
    done_table: Tensor


class Sync(NamedTuple):
    """The rank's state (:mod:`~interlace.kernels.persistent.protocol`; int32, kept across
    calls), its error record, the record's host mirror (ERROR_WORDS int32, page-locked on CUDA),
    and the polls a wait makes before it gives up."""

    state_ptr: Tensor
    err_ptr: Tensor
    host_err_ptr: Tensor
    max_spins: int


class DistSync(NamedTuple):
    """:class:`Sync`, and the nanoseconds a wait polls before it gives up (GPU clock)."""

    state_ptr: Tensor
    err_ptr: Tensor
    host_err_ptr: Tensor
    max_spins: int
    timeout_ns: int


class World(NamedTuple):
    """At W > 1: this rank, the world size, experts per rank, and the tokens per rank and call
    that the symmetric regions hold."""

    me: int
    W: int
    E_loc: int
    max_tokens: int


class Sizes(NamedTuple):
    """Problem sizes and routing scalars (both world sizes): T, N, K, E, UP, the routing
    weights' scale, and each expert's capacity (0 without one)."""

    T: int
    N: int
    K: int
    E: int
    UP: int
    scale: float
    capacity: int


class DistTasks(NamedTuple):
    """Task counts at W > 1 (:class:`~interlace.kernels.persistent.dist_tasks.DistLayout`):
    logits tasks, expert blocks and column parts of the router GEMM (``ls_chunk`` columns each),
    gate (top-k) and send tasks, column slices of a send, row tiles (mt), GEMM0 and GEMM1
    slices per tile, combine token blocks × column tasks and the slices of a combine task."""

    n_logits: int
    n_eb: int
    n_ls: int
    ls_chunk: int
    n_gate: int
    n_send: int
    n_ns: int
    mt: int
    n_k0: int
    n_n1: int
    n_comb_t: int
    n_comb_n: int
    comb_slices: int


class TimelineArgs(NamedTuple):
    """The timeline's (cap, 8) int64 records, (1,) int64 clock and capacity (None, None, 0 off)."""

    timeline_ptr: Tensor | None
    timeline_clock: Tensor | None
    timeline_cap: int


class MoeFrontTiles(NamedTuple):
    """Constexpr block sizes of the gate and the index (world size 1): tokens per gate task
    (BLOCK_T), the gate's step over N (BLOCK_G), the index's assignments per step (BLOCK_A)."""

    BLOCK_T: int
    BLOCK_G: int
    BLOCK_A: int


class DistFrontTiles(NamedTuple):
    """Constexpr block sizes of the front at W > 1: a logits task's tokens × experts (BLOCK_T,
    BLOCK_E) and step over N (BLOCK_G), tokens per top-k task (BLOCK_TK), a send task's tokens ×
    columns (BLOCK_S, BLOCK_NS), the index's assignments and histogram rows per step (BLOCK_A,
    G_CHUNK), the most column parts (LS_MAX), k and E_loc padded to powers of 2 (E_loc ≥ 16)."""

    BLOCK_T: int
    BLOCK_TK: int
    BLOCK_E: int
    BLOCK_G: int
    BLOCK_S: int
    BLOCK_NS: int
    BLOCK_A: int
    G_CHUNK: int
    LS_MAX: int
    K_PAD: int
    EL_PAD: int


class GemmTiles(NamedTuple):
    """Constexpr block sizes of the tile table and the expert tasks (both world sizes): tiles
    per step of the table (BLOCK_J), rows per tile (BLOCK_M), GEMM0's K-slice and step over N
    (BLOCK_K0, BLOCK_N0), GEMM1's N-slice and step over K (BLOCK_N1, BLOCK_K1), a combine task's
    tokens × columns (BLOCK_TC, BLOCK_NC)."""

    BLOCK_J: int
    BLOCK_M: int
    BLOCK_K0: int
    BLOCK_N0: int
    BLOCK_N1: int
    BLOCK_K1: int
    BLOCK_TC: int
    BLOCK_NC: int


class Routing(NamedTuple):
    """Constexpr routing choices: k, E padded to a power of 2 (≥ 16), softmax scores, a
    selection bias, renormalized weights, the router GEMM's bf16 pieces (0: an fp32 dot), fp32
    dots (the interpreter), logits rounding (0 off, 1 bf16, 2 fp16), a capacity factor."""

    TOP_K: int
    E_PAD: int
    SOFTMAX: bool
    HAS_BIAS: bool
    RENORMALIZE: bool
    W_PIECES: int
    DOT_FP32: bool
    ROUND_LOGITS: int
    CAPACITY: bool


class MoeModes(NamedTuple):
    """Constexpr: the activation (:class:`~interlace.kernels.persistent.protocol.Activation`),
    the task order (0 normal, 1 combine first: tests), the timeline (0 off, 1 GPU clock, 2
    logical clock), FP8 expert weights (W_FP8: dequantized in registers, W8A16)."""

    ACTIVATION: int
    ORDER: int
    TIMELINE: int
    W_FP8: bool


class DistModes(NamedTuple):
    """Constexpr at W > 1: the activation, the GPU's global timer in waits (CLOCK), the
    timeline, wide tiles (W_TMA: the weights through TMA descriptors), the joint SwiGLU load
    (JOINT) and FP8 expert weights (W_FP8; never with JOINT)."""

    ACTIVATION: int
    CLOCK: bool
    TIMELINE: int
    W_TMA: bool
    JOINT: bool
    W_FP8: bool


class KernelArgs:
    """A kernel's arguments: its groups (the subclass's dataclass fields, in the kernel's
    order), the runtime groups first, the constexpr groups (:attr:`CONSTEXPR_GROUPS`) last."""

    CONSTEXPR_GROUPS: tuple[str, ...] = ()

    def runtime(self, skip_call: bool = False) -> tuple:
        """The non-constexpr arguments in the kernel's order (``skip_call``: without the first
        group, the call, which a launcher prepends per call)."""
        groups = _layout(type(self))[0](self)
        return tuple(chain.from_iterable(groups[1:] if skip_call else groups))

    def constexprs(self) -> dict:
        """The constexpr arguments by name."""
        _, get, names = _layout(type(self))
        return dict(zip(names, chain.from_iterable(get(self))))

    def as_kwargs(self) -> dict:
        """Every argument by name: ``kernel[grid](**args.as_kwargs())``."""
        groups = [getattr(self, f.name) for f in fields(self)]
        return {name: value for g in groups for name, value in zip(g._fields, g)}


@dataclass(frozen=True)
class MoeKernelArgs(KernelArgs):
    """``persistent_moe_kernel``'s arguments (world size 1)."""

    call: MoeCall
    weights: Weights
    workspace: MoeWorkspace
    sync: Sync
    sizes: Sizes
    tasks: TaskLayout
    timeline: TimelineArgs
    front_tiles: MoeFrontTiles
    gemm_tiles: GemmTiles
    routing: Routing
    modes: MoeModes

    CONSTEXPR_GROUPS = ("front_tiles", "gemm_tiles", "routing", "modes")


@dataclass(frozen=True)
class DistKernelArgs(KernelArgs):
    """``persistent_dist_kernel``'s arguments (W > 1)."""

    call: DistCall
    weights: Weights
    workspace: DistWorkspace
    peers: PeerTables
    sync: DistSync
    world: World
    sizes: Sizes
    tasks: DistTasks
    timeline: TimelineArgs
    front_tiles: DistFrontTiles
    gemm_tiles: GemmTiles
    routing: Routing
    modes: DistModes

    CONSTEXPR_GROUPS = ("front_tiles", "gemm_tiles", "routing", "modes")


_LAYOUTS: dict = {}


def _groups(args_type: type[KernelArgs]) -> dict[str, type]:
    return {f.name: f.type for f in fields(args_type)}


def _layout(args_type: type[KernelArgs]) -> tuple:
    """(the runtime groups, the constexpr groups, the constexprs' names) of ``args_type``, the
    groups as :func:`operator.attrgetter` s; made once per class (a plan flattens its groups,
    tuples, in a few microseconds)."""
    found = _LAYOUTS.get(args_type)
    if found is None:
        groups = _groups(args_type)
        runtime = [g for g in groups if g not in args_type.CONSTEXPR_GROUPS]
        consts = [g for g in groups if g in args_type.CONSTEXPR_GROUPS]
        found = _LAYOUTS[args_type] = (attrgetter(*runtime), attrgetter(*consts),
                                       [n for g in consts for n in groups[g]._fields])
    return found


def check_signature(kernel, args_type: type[KernelArgs]) -> None:
    """Raise ``TypeError`` unless ``kernel``'s parameters are ``args_type``'s fields, in order,
    constexpr exactly where the group is."""
    params = [(p.name, "constexpr" in str(p.annotation))  # (the interpreter's kernels have no .params)
              for p in inspect.signature(kernel.fn).parameters.values()]
    expected = [(field, name in args_type.CONSTEXPR_GROUPS)
                for name, group in _groups(args_type).items() for field in group._fields]
    if params != expected:
        raise TypeError(f"{kernel.fn.__name__}'s parameters do not match {args_type.__name__}: "
                        f"{params} != {expected}")
