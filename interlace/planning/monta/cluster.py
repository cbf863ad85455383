"""Cluster descriptions and the five presets of ``interlace plan``.

A :class:`Cluster` is what the planner needs to know about hardware it may never have seen:
GPUs per node, node count, GPU memory, the grouped-GEMM speed (:class:`Compute`), and three link
classes (:class:`Link`): intra-node, inter-node (per GPU: a node's NIC bandwidth divided by the
GPUs sharing it) and HBM for device copies. Every number cites its source; where a number is
derived rather than measured, the source says how.

Rank order follows MoNTA Fig. 12: [TP, EP, CP, PP, DP] from the innermost (fastest-varying)
outwards, so a group of ``size`` ranks whose members are ``stride`` ranks apart has
``min(size, gpus_per_node // stride)`` members on each node (:meth:`Cluster.group`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from interlace.planning.monta.primitives import Compute, Group, Link

GIB = 1024 ** 3
# Host time per extra chunk of interlace's pipelined strategy (forward): the median of
# (ms at degree r − ms at degree 1)/(r − 1) over the host-bound (T = 3000) raw layer timings of the
# 2×H200 profile in interlace/tuning/profiles/runs/. The op microbenchmarks (host_ms index + prep +
# combine) see only a fraction of it; the rest is autograd, NCCL wrappers and stream waits.
CHUNK_HOST_US = 900.0


@dataclass(frozen=True)
class Cluster:
    """A training cluster as the planner sees it.

    Args:
        name: preset name or file stem.
        gpu: GPU model, in words.
        gpus_per_node, nodes: the shape; world = gpus_per_node · nodes.
        memory_gib: memory of one GPU (GiB).
        compute: grouped-GEMM model of one GPU.
        intra: intra-node link per GPU; inter: inter-node link per GPU (None for one node).
        hbm: device memory as a link (device-to-device copies).
        dtype: ``bf16`` or ``fp16`` (GPUs without bf16, e.g. Turing, train in fp16).
        host_op_us: host time to issue one GPU op (kernel or collective).
        sync_us: one host sync (the all-to-all split sizes) including the count exchange.
        chunk_host_us: host time of one more chunk's bookkeeping (counting sort, re-layout index,
            gathers, autograd and NCCL wrappers) in a chunked schedule. This is interlace's own
            Python, so every preset uses the value measured on the 2×H200 node (see
            ``CHUNK_HOST_US``).
        source: where the numbers come from.
    """

    name: str
    gpu: str
    gpus_per_node: int
    nodes: int
    memory_gib: float
    compute: Compute
    intra: Link
    inter: Link | None
    hbm: Link
    dtype: str = "bf16"
    host_op_us: float = 8.0
    sync_us: float = 40.0
    chunk_host_us: float = CHUNK_HOST_US
    source: str = ""

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"cluster {self.name}: gpus_per_node and nodes must be >= 1")
        if self.nodes > 1 and self.inter is None:
            raise ValueError(f"cluster {self.name}: {self.nodes} nodes need an inter-node link")
        if self.memory_gib <= 0:
            raise ValueError(f"cluster {self.name}: memory_gib must be > 0")
        if self.dtype not in ("bf16", "fp16"):
            raise ValueError(f"cluster {self.name}: dtype must be bf16 or fp16, got {self.dtype!r}")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def group(self, size: int, stride: int) -> Group:
        """The group of ``size`` ranks ``stride`` apart (see the module docstring)."""
        if size <= 1:
            return Group(1, 1)
        if size * stride > self.world:
            raise ValueError(f"group of {size} ranks with stride {stride} does not fit {self.world} GPUs")
        per_node = 1 if stride >= self.gpus_per_node else max(1, min(size, self.gpus_per_node // stride))
        return Group(size, per_node)

    def to_json(self) -> dict:
        return {"name": self.name, "gpu": self.gpu, "gpus_per_node": self.gpus_per_node, "nodes": self.nodes,
                "memory_gib": self.memory_gib, "compute": self.compute.to_json(), "intra": self.intra.to_json(),
                "inter": self.inter.to_json() if self.inter else None, "hbm": self.hbm.to_json(),
                "dtype": self.dtype, "host_op_us": self.host_op_us, "sync_us": self.sync_us,
                "chunk_host_us": self.chunk_host_us, "source": self.source}

    @staticmethod
    def from_json(d: dict) -> "Cluster":
        missing = [k for k in ("name", "gpu", "gpus_per_node", "nodes", "memory_gib", "compute", "intra", "hbm")
                   if k not in d]
        if missing:
            raise ValueError(f"cluster description lacks {missing}")
        return Cluster(d["name"], d["gpu"], int(d["gpus_per_node"]), int(d["nodes"]), float(d["memory_gib"]),
                       Compute.from_json(d["compute"]), Link.from_json(d["intra"]),
                       Link.from_json(d["inter"]) if d.get("inter") else None, Link.from_json(d["hbm"]),
                       d.get("dtype", "bf16"), float(d.get("host_op_us", 8.0)), float(d.get("sync_us", 40.0)),
                       float(d.get("chunk_host_us", CHUNK_HOST_US)), d.get("source", ""))


# ----------------------------------------------------------------------------- presets
# Measured grouped-GEMM efficiency on H200 (torch._grouped_mm bf16, balanced groups, against the
# measured dense matmul peak; docs/performance.md), as (FLOPs of one GEMM per expert, efficiency)
# for Mixtral-, Qwen2-, DeepSeek-V3- and FlashDMoE-like shapes.
_H200_GEMM_POINTS = (
    (2 * 2048 * 4096 * 14336, 755 / 769), (2 * 512 * 2048 * 1408, 446 / 769),
    (2 * 512 * 7168 * 2048, 661 / 769), (2 * 512 * 2048 * 2048, 509 / 769),
)
_H200_COMPUTE = Compute(769.0, points=_H200_GEMM_POINTS, launch_us=15.0,
                        source="measured on an H200: bf16 matmul 8192³ 769 TFLOP/s; grouped_mm points fitted")


def _compute_like_h200(peak_tflops: float, peak_efficiency: float, source: str) -> Compute:
    """A GPU we have not measured: H200's efficiency curve shape, the half-efficiency work scaled
    with the peak (a GEMM needs peak·latency FLOPs to hide its fixed cost)."""
    w_half = _H200_COMPUTE.half_work_flops * peak_tflops / _H200_COMPUTE.peak_tflops
    return Compute(peak_tflops, peak_efficiency, w_half, 15.0, source=source)


def _hopper_sxm(name: str, gpu: str, nodes: int, intra: Link, inter: Link | None, source: str) -> Cluster:
    """8 Hopper SXM GPUs (80 GB) per node: H100/H800 share the compute and HBM numbers."""
    return Cluster(name, gpu, 8, nodes, 80.0,
                   _compute_like_h200(989.0, 0.75, "H100/H800 SXM bf16 dense 989 TFLOP/s (NVIDIA datasheet); "
                                      "efficiency curve shape from H200, r_max 0.75 assumed"),
                   intra, inter,
                   Link("hbm", 3350.0, latency_us=4.0, peak_efficiency=0.8,
                        source="HBM3 3.35 TB/s (H100 SXM datasheet); copy efficiency 0.8 as MoNTA Table 8"),
                   source=source)


def _h200_nvlink_points() -> tuple:
    """Efficiency of the NVLink all-to-all from the shipped 2×H200 profile: with W = 2 half of the
    bytes a rank sends cross the link, so r = (x/2) / (450 GB/s · t(x))."""
    path = Path(__file__).resolve().parent.parent.parent / "tuning" / "profiles" / "NVIDIA_H200-sm132-w2-n1-p2p.json"
    d = json.loads(path.read_text())
    return tuple((x, min(1.0, (x / 2) / (450e9 * t * 1e-3))) for x, t in zip(d["a2a"]["sizes"], d["a2a"]["times_ms"]))


def _presets() -> dict[str, Cluster]:
    nvlink4 = "NVLink 4: 18 links × 25 GB/s = 450 GB/s per direction (H100/H200 SXM; MoNTA Table 5: H100 450)"
    return {
        "h200x2": Cluster(
            "h200x2", "NVIDIA H200 (141 GB HBM3e)", 2, 1, 139.8, _H200_COMPUTE,
            Link("nvlink", 450.0, points=_h200_nvlink_points(),
                 source=nvlink4 + "; efficiency points from the shipped profile's all-to-all curve "
                 "(interlace/tuning/profiles/NVIDIA_H200-sm132-w2-n1-p2p.json)"),
            None,
            Link("hbm", 4800.0, latency_us=4.0, peak_efficiency=2042 / 4800,
                 source="H200 HBM3e 4.8 TB/s spec; measured device copy 4084 GB/s read+write "
                 "= 2042 GB/s of bytes copied"),
            host_op_us=10.0, sync_us=40.0,
            source="the measured 2×H200 node (2026-11-21) and the shipped profile"),
        "h800x8": _hopper_sxm("h800x8", "NVIDIA H800 SXM (80 GB HBM3)", 1, Link(
            "nvlink", 200.0, latency_us=12.0, peak_efficiency=0.8,
            source="MoNTA Table 5: H800 200 GB/s one direction; r_max 0.8 as MoNTA's 8-card AllGather (0.803)"),
            None, "8×H800 NVLink node"),
        "a800x16": Cluster(
            "a800x16", "NVIDIA A800 SXM4 (80 GB HBM2e)", 8, 2, 80.0,
            _compute_like_h200(312.0, 0.75, "A100/A800 bf16 dense 312 TFLOP/s (NVIDIA datasheet); "
                               "efficiency curve shape from H200, r_max 0.75 assumed"),
            Link("nvlink", 200.0, points=((64e6, 0.726), (256e6, 0.776), (2.147e9, 0.803)),
                 source="MoNTA §Experiment Settings (NVLink 400 GB/s bidirectional) and Table 5 (A800 200 GB/s); "
                 "8-card AllGather efficiency: Table 8 (64 MB 72.6%, 256 MB 77.6%) and §Discussions (0.803 at 256K)"),
            Link("ib", 25.0, points=((8e6, 0.427), (32e6, 0.633), (256e6, 0.741)),
                 source="MoNTA: IB 200 Gb/s = 25 GB/s one direction per GPU; 16-card AllToAll efficiency "
                 "Table 8 (8 MB 42.7%, 32 MB 63.3%, 256 MB 74.1%)"),
            Link("hbm", 1600.0, points=((64e6, 0.8),),
                 source="MoNTA Table 8: D2D copy of 64 MB at 80% in 0.05 ms ⇒ B₃ = 1.6 TB/s"),
            source="MoNTA's evaluation cluster: 2 nodes × 8 A800, IB 200 Gb/s"),
        "rtx2080ti-64": Cluster(
            "rtx2080ti-64", "NVIDIA GeForce RTX 2080 Ti (11 GB GDDR6)", 4, 16, 11.0,
            _compute_like_h200(53.8, 0.7, "Turing TU102: fp16 tensor cores with fp32 accumulate 53.8 TFLOP/s "
                               "on GeForce (Turing whitepaper); no bf16, the plan uses fp16"),
            Link("pcie", 15.75, latency_us=15.0, peak_efficiency=0.75,
                 source="PipeMoE Table III: PCIe 3.0 x16 (15.75 GB/s one direction)"),
            Link("ib", 12.5 / 4, latency_us=25.0, peak_efficiency=0.85,
                 source="PipeMoE Table III: one ConnectX-5 100 Gb/s NIC per node = 12.5 GB/s, shared by 4 GPUs"),
            Link("hbm", 616.0, latency_us=5.0, peak_efficiency=0.8, source="RTX 2080 Ti GDDR6 616 GB/s"),
            dtype="fp16", host_op_us=10.0, sync_us=60.0,
            source="PipeMoE's testbed: 16 nodes × 4 RTX2080Ti, 100 Gb/s InfiniBand (PipeMoE §V, Table III)"),
        "h100x1024": _hopper_sxm("h100x1024", "NVIDIA H100 SXM (80 GB HBM3)", 128, Link(
            "nvlink", 450.0, latency_us=10.0, peak_efficiency=0.8, source=nvlink4), Link(
            "ib", 50.0, latency_us=15.0, peak_efficiency=0.8,
            source="one 400 Gb/s NDR NIC per GPU (DGX H100 style) = 50 GB/s one direction; r_max 0.8 assumed"),
            "128 nodes × 8 H100, 400 Gb/s per GPU (1024 GPUs)"),
    }


PRESET_NAMES = ("h200x2", "h800x8", "a800x16", "rtx2080ti-64", "h100x1024")
_CACHE: dict[str, Cluster] = {}


def cluster_preset(name: str) -> Cluster:
    if not _CACHE:
        _CACHE.update(_presets())
    if name not in _CACHE:
        raise ValueError(f"unknown cluster preset {name!r}; known: {', '.join(PRESET_NAMES)}")
    return _CACHE[name]


def load_cluster(spec: str | Path | Cluster) -> Cluster:
    """A preset name or a JSON file (:meth:`Cluster.to_json`'s format)."""
    if isinstance(spec, Cluster):
        return spec
    if str(spec) in PRESET_NAMES:
        return cluster_preset(str(spec))
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"{spec!r} is neither a cluster preset ({', '.join(PRESET_NAMES)}) nor a JSON file")
    return Cluster.from_json(json.loads(path.read_text()))
