"""benchmarks/hf_models.py --smoke on the CPU: both models (tiny Qwen3-MoE-like and
DeepSeek-V3-like), 2 gloo ranks, every part (forward, 4 training steps on HF's blocks and on
interlace's from the same init, the compile part with Dynamo's eager backend). Checks the JSON the
GPU run writes and that the two loss curves agree (fp32: far below bf16 noise)."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "hf_models.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_smoke_two_gloo_ranks(tmp_path):
    # The torch fallback paths (no Triton interpreter): the interpreter would make this minutes long,
    # and the strategies' kernels are tested elsewhere.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), SCRIPT, "--smoke", "--out", str(tmp_path), "--compile",
           "--compile-backend", "eager", "--baseline", "sequential"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "hf_models.json").read_text())
    assert record["world"] == 2
    rows = record["rows"]
    for model in ("qwen3", "dsv3"):
        mine = [r for r in rows if r["model"] == model]
        assert not [r for r in mine if "skipped" in r or ("error" in r and r["part"] != "compile")], mine
        forward = {r["impl"]: r for r in mine if r["part"] == "forward"}
        assert set(forward) == {"hf", "interlace"} and all(r["tokens_per_s"] > 0 for r in forward.values())
        train = {r["impl"]: r for r in mine if r["part"] == "train"}
        assert train["hf"]["init_checksum"] == train["interlace"]["init_checksum"] == train["baseline"]["init_checksum"]
        assert len(train["hf"]["losses"]) == len(train["interlace"]["losses"]) == 4
        # --baseline: interlace on sequential, the same model (fp32: losses as the default's)
        assert train["baseline"]["strategy"] == "sequential"
        assert max(abs(a - b) / abs(b) for a, b in zip(train["baseline"]["losses"], train["interlace"]["losses"])) < 1e-5
        assert train["hf"]["losses"][-1] < train["hf"]["losses"][0]  # it trains
        (loss,) = [r for r in mine if r["part"] == "loss"]
        assert loss["same_init"] and loss["max_rel_diff"] < 1e-5, loss
        compiled = [r for r in mine if r["part"] == "compile"]
        assert len(compiled) == 2 and all("tokens_per_s" in r or "error" in r for r in compiled), compiled
    assert "max rel diff" in proc.stdout and "results in" in proc.stdout.splitlines()[-1]
