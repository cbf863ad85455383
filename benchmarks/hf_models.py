"""Hugging Face MoE models on HF's own blocks and on interlace's (issue 31's "done when").

    torchrun --nproc-per-node 2 benchmarks/hf_models.py --out $OUT            # 2 GPUs, bf16, ~125 s
    torchrun --nproc-per-node 2 benchmarks/hf_models.py --out $OUT --compile  # + torch.compile vs eager, ~260 s
    torchrun --nproc-per-node 2 benchmarks/hf_models.py --smoke --out /tmp/x  # CPU, gloo, tiny (the test)

Two models built from transformers configs (random weights, nothing downloaded, vocab cut to
keep the embeddings small, every layer MoE):

* ``qwen3``: Qwen3-30B-A3B's MoE (hidden 2048, 128 experts of FFN 768, top-8, norm_topk_prob) and
  its attention (32 heads, 4 KV heads, head_dim 128), 4 layers;
* ``dsv3``: DeepSeek-V3's MoE (hidden 7168, 256 routed experts of FFN 2048, top-8, 1 shared
  expert, 8 groups with 4 kept, sigmoid scores with a nonzero selection bias, routed scaling 2.5),
  2 layers, with its MLA attention cut to 16 heads (128 in the real model; attention is not what
  is compared). HF's blocks hold all 256 experts on every rank: 2 layers are 22.5 G expert
  parameters, 45 GB of bf16 weights plus 45 GB of gradients per GPU, so Adam's states do not fit in
  an H200's 139 GB and both sides train with plain SGD; ``qwen3`` trains with AdamW.

For each model, on every rank, parts in this order (each prints its expected time first):

1. ``forward``: inference tokens/s (both ranks' tokens; ``--inf-batch`` × ``--inf-seq`` per
   rank), HF's blocks (plain data parallel: every rank all experts) vs interlace's default
   strategy (``replace_moe_blocks(model, group=...)``: experts sharded over the ranks);
2. ``train``: ``--steps`` optimizer steps from the same initial weights (the model is rebuilt
   from the same seed; the JSON records a checksum of both inits) on the same batches: the loss
   of every step (mean over ranks) and the median step time (forward, backward, the gradient
   all-reduce: every parameter for HF, the replicated ones for interlace; optimizer step); with
   ``--baseline S`` a third run, interlace on strategy S (e.g. ``sequential``: what the default's
   own choice gains);
3. ``compile`` (``--compile``): the interlace model under ``torch.compile(model)`` vs eager,
   forward tokens/s (and train step time with ``--compile-train``). A compile that fails is a row
   with its error, not a crash.

Results go to ``--out``/hf_models.json after every part; a short table is printed last. A part
whose expected time would pass ``--budget-s`` is skipped (a row says so).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import interlace.hf  # noqa: E402
from interlace.parallel import release_shared_buffers  # noqa: E402

# name: model class, config class, layers, optimizer, config fields (full size), config fields (--smoke).
MODELS = {
    "qwen3": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", 4, "adamw", dict(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        decoder_sparse_step=1, mlp_only_layers=[]), dict(
        hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "dsv3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", 2, "sgd", dict(
        hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=0, intermediate_size=18432, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128), dict(
        hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0,
        intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)),
}
# Expected seconds of each part on 2 H200s at the default sizes (a planning guess, printed before
# each part and used by --budget-s; the measured times are in the JSON).
EXPECTED_S = {("qwen3", "forward"): 10, ("qwen3", "train"): 25, ("qwen3", "compile"): 60,
              ("dsv3", "forward"): 15, ("dsv3", "train"): 45, ("dsv3", "compile"): 75}
STARTUP_S = 30


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for hf_models.json")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["qwen3", "dsv3"])
    p.add_argument("--layers", type=int, default=None, help="override every model's layer count")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--inf-batch", type=int, default=2)
    p.add_argument("--inf-seq", type=int, default=4096)
    p.add_argument("--inf-iters", type=int, default=5, help="timed forward calls (after 2 warm-up calls)")
    p.add_argument("--train-batch", type=int, default=2)
    p.add_argument("--train-seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr-adamw", type=float, default=1e-3)
    p.add_argument("--lr-sgd", type=float, default=0.2)
    p.add_argument("--strategy", default="auto", help="interlace strategy (default: replace_moe_blocks' default)")
    p.add_argument("--baseline", default=None,
                   help="train a third time with interlace on this strategy (e.g. sequential), after the default")
    p.add_argument("--compile", action="store_true", help="also torch.compile(model) vs eager (interlace)")
    p.add_argument("--compile-train", action="store_true", help="--compile: time training steps too")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--budget-s", type=float, default=290.0, help="skip parts expected to end past this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="CPU, gloo, fp32, tiny models and sizes: checks the script, measures nothing")
    args = p.parse_args()
    if args.smoke:
        args.vocab, args.inf_batch, args.inf_seq, args.inf_iters = 128, 2, 16, 2
        args.train_batch, args.train_seq, args.steps = 2, 16, min(args.steps, 4)
        args.lr_sgd = 0.05
    return args


class Bench:
    """Process set-up, clocks, the JSON record and the part schedule."""

    def __init__(self, args):
        self.args = args
        self.start = time.perf_counter()
        self.distributed = "RANK" in os.environ
        if args.smoke:
            self.device, self.dtype, backend = torch.device("cpu"), torch.float32, "gloo"
        else:
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            self.device, self.dtype, backend = torch.device("cuda", local), torch.bfloat16, "nccl"
        if self.distributed:
            # A rank stuck in a collective (its peer failed) gives up instead of waiting forever.
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=180))
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self.distributed else (0, 1)
        self.cuda = self.device.type == "cuda"
        os.makedirs(args.out, exist_ok=True)
        self.path = os.path.join(args.out, "hf_models.json")
        # auto's decisions go to a folder of this run's own: its calibration is part of what the run
        # measures, so it never reads what an earlier run on the machine decided.
        self.decisions_dir = tempfile.mkdtemp(prefix="hf_models-decisions-")
        atexit.register(shutil.rmtree, self.decisions_dir, True)
        self.record = {"args": vars(args), "world": self.world, "device": self._device_name(),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "notes": ("HF blocks: plain data parallel (all experts on every rank, every gradient "
                                 "all-reduced); interlace: experts sharded over the ranks. dsv3 trains with SGD "
                                 "(Adam's states for HF's 22.5 G replicated expert parameters do not fit), qwen3 "
                                 "with AdamW; dsv3 attention cut to 16 heads; vocab cut; tokens/s counts both ranks"),
                       "rows": []}

    def _device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu"

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timer(self):
        """() → a timestamp; ``seconds(a, b)`` the time between two (CUDA events: no sync per step)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def add(self, row: dict) -> None:
        """Record a row and rewrite the JSON (rank 0), so a run cut short keeps what it measured."""
        self.record["rows"].append(row)
        self.record["elapsed_s"] = round(self.elapsed(), 1)
        if self.rank == 0:
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.record, f, indent=1)
            os.replace(self.path + ".tmp", self.path)

    def part(self, model: str, name: str, fn) -> None:
        """Run one part unless it would pass the budget; an error becomes a row (all ranks fail
        alike here: the parts are the same code on every rank)."""
        expected = 1.0 if self.args.smoke else EXPECTED_S[(model, name)]
        if self.elapsed() + expected > self.args.budget_s:
            self.say(f"-- {model} {name}: skipped (expected ~{expected:.0f} s, {self.elapsed():.0f} s used "
                     f"of --budget-s {self.args.budget_s:.0f})")
            self.add({"model": model, "part": name, "skipped": f"budget: expected ~{expected:.0f} s"})
            return
        self.say(f"-- {model} {name}: expected ~{expected:.0f} s (at {self.elapsed():.0f} s)")
        began = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a failed part is a result; the next part still runs
            if self.rank == 0:
                traceback.print_exc()
            self.add({"model": model, "part": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
        finally:
            release_shared_buffers()
            if self.cuda:
                torch.cuda.empty_cache()
        self.say(f"   {model} {name}: {time.perf_counter() - began:.1f} s")


# ----------------------------------------------------------------------------- models and data
def build_model(bench: Bench, name: str, layers: int):
    """The HF model of ``name`` from its config, on the device, in the bench dtype, from
    ``--seed``: the same weights on every rank and in every rebuild (the same device RNG ops)."""
    args = bench.args
    model_cls, config_cls, default_layers, _, full, smoke = MODELS[name]
    seq = max(args.inf_seq, args.train_seq)
    config = getattr(transformers, config_cls)(
        vocab_size=args.vocab, num_hidden_layers=layers, max_position_embeddings=seq,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        output_router_logits=True, **(smoke if args.smoke else full))
    torch.manual_seed(args.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(bench.dtype)  # no fp32 copy of 45 GB of experts on the way
    try:
        with bench.device:
            model = getattr(transformers, model_cls)(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.to(dtype=bench.dtype)
    gen = torch.Generator(device=bench.device).manual_seed(args.seed + 17)
    with torch.no_grad():
        for module in model.modules():  # DeepSeek-V3: a selection bias that changes the choices
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen, device=bias.device) * 0.05)
    return model


def checksum(model) -> float:
    """Σ over parameters of Σ|p|·(1 + index): equal for equal weights (float64, one number)."""
    total = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    for i, p in enumerate(model.parameters()):
        total += p.detach().abs().sum(dtype=torch.float64) * (1 + i)
    return float(total)


def token_batches(bench: Bench, count: int, batch: int, seq: int, salt: int):
    """(count, batch, seq) ids for this rank from one random 'language' (each token has 4 possible
    successors, the same table on every rank), so the loss falls from ln(vocab) towards ln(4)."""
    vocab = bench.args.vocab
    successors = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(bench.args.seed))
    gen = torch.Generator().manual_seed(1000 * salt + bench.rank + 1)
    ids = torch.empty(count * batch, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (ids.shape[0],), generator=gen)
    choice = torch.randint(0, 4, ids.shape, generator=gen)
    for t in range(1, seq):
        ids[:, t] = successors[ids[:, t - 1], choice[:, t]]
    return ids.view(count, batch, seq).to(bench.device)


def to_interlace(bench: Bench, model, strategy: str | None = None) -> str:
    """Replace the model's MoE blocks (experts sharded over the world group) with ``strategy``
    (default ``--strategy``); the strategy's name."""
    group = dist.group.WORLD if bench.distributed else None
    strategy = strategy or bench.args.strategy
    if strategy == "auto":  # the default strategy
        interlace.hf.replace_moe_blocks(model, group=group, strategy_options={"decisions_dir": bench.decisions_dir})
    else:
        interlace.hf.replace_moe_blocks(model, group=group, strategy=strategy)
    return interlace.hf.moe_blocks(model)[0].strategy.name


# ----------------------------------------------------------------------------- measurements
AUTO_SETTLE_CALLS = 200  # bound on the untimed calls that let auto blocks decide


def auto_choices(model, tokens: int, mode: str) -> list[str] | None:
    """What each ``auto`` block runs for ``tokens`` per rank and ``mode`` (``"fwd"`` or
    ``"fwdbwd"``), ``"undecided"`` while it calibrates; None: no auto block (HF's blocks)."""
    choices = [b.strategy.choice_for(tokens, mode) for b in interlace.hf.moe_blocks(model)
               if hasattr(b.strategy, "choice_for")]
    return [c.spec if c is not None else "undecided" for c in choices] or None


def auto_decisions(model, tokens: int, mode: str) -> list[dict] | None:
    """Each ``auto`` block's decision for ``tokens`` and ``mode`` in full (its candidates'
    times, its notes; :class:`interlace.strategies.auto_decisions.Choice`), None where undecided."""
    choices = [b.strategy.choice_for(tokens, mode) for b in interlace.hf.moe_blocks(model)
               if hasattr(b.strategy, "choice_for")]
    return [c.to_json() if c is not None else None for c in choices] or None


def undecided_blocks(model, tokens: int, mode: str) -> int:
    """How many auto blocks have not decided yet (every rank decides at the same call, so every
    rank sees the same count)."""
    return (auto_choices(model, tokens, mode) or []).count("undecided")


def forward_rate(bench: Bench, model, ids) -> float:
    """Inference tokens/s of both ranks together: ``--inf-iters`` timed calls after 2 warm-ups
    and, for ``auto`` blocks, the calls their calibration takes (what is timed is what they run)."""
    model.eval()
    with torch.no_grad():
        for i in range(2 + AUTO_SETTLE_CALLS):
            if i >= 2 and not undecided_blocks(model, ids.numel(), "fwd"):
                break
            model(ids)
        if bench.distributed:
            dist.barrier()
        bench.sync()
        a = bench.timer()
        for _ in range(bench.args.inf_iters):
            model(ids)
        b = bench.timer()
    seconds = bench.seconds(a, b)
    if bench.distributed:  # the slower rank's time counts
        t = torch.tensor([seconds], device=bench.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = float(t)
    return bench.args.inf_iters * ids.numel() * bench.world / seconds


def train(bench: Bench, model, impl: str, optimizer: str, data, steps: int | None = None):
    """``steps`` optimizer steps on ``data[step]``; (loss per step averaged over ranks, seconds per
    step, the steps ``auto`` blocks were still calibrating). The global loss is the mean of the
    ranks' losses: each rank's loss / W, SUM all-reduce of the replicated gradients (the experts'
    already sum every rank's tokens)."""
    args = bench.args
    steps = steps or args.steps
    synced = interlace.hf.replicated_parameters(model) if impl != "hf" else list(model.parameters())
    model.train()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr_adamw, weight_decay=0.0)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr_sgd)
    losses, stamps, calibrating = [], [bench.timer()], 0
    for step in range(steps):
        ids = data[step % len(data)]
        if calibrating == step and undecided_blocks(model, ids.numel(), "fwdbwd"):
            calibrating += 1
        loss = model(ids, labels=ids).loss  # causal-LM loss + HF's auxiliary balance loss
        (loss / bench.world).backward()
        if bench.world > 1:
            for p in synced:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        stamps.append(bench.timer())
    times = [bench.seconds(a, b) for a, b in zip(stamps, stamps[1:])]
    mean = torch.stack(losses)
    if bench.distributed:
        dist.all_reduce(mean)
    del opt
    return (mean / bench.world).tolist(), times, calibrating


def median_after_warmup(times: list[float], calibrating: int = 0) -> float:
    """The median step time without the first steps (compilation, tuning, graph capture) and
    those ``auto`` blocks spent calibrating (if any step is left after them)."""
    skip = max(min(5, len(times) // 2), min(calibrating, len(times) - 1))
    return statistics.median(times[skip:])


def run_model(bench: Bench, name: str) -> None:
    args = bench.args
    _, _, default_layers, optimizer, _, _ = MODELS[name]
    layers = args.layers or default_layers
    tokens_inf = bench.world * args.inf_batch * args.inf_seq
    bench.say(f"== {name}: {layers} layers, {optimizer}, forward {args.inf_batch}x{args.inf_seq} and training "
              f"{args.train_batch}x{args.train_seq} tokens per rank, {bench.world} rank(s), {bench.dtype}")
    inf_ids = token_batches(bench, 1, args.inf_batch, args.inf_seq, salt=1)[0]
    train_ids = token_batches(bench, args.steps, args.train_batch, args.train_seq, salt=2)
    base = {"model": name, "layers": layers, "optimizer": optimizer}
    state = {}

    def forward():
        for impl in ("hf", "interlace"):
            model = build_model(bench, name, layers)
            row = dict(base, part="forward", impl=impl, tokens_per_call=tokens_inf,
                       experts_impl=getattr(model.config, "_experts_implementation", None),
                       attn_impl=getattr(model.config, "_attn_implementation", None))
            if impl == "interlace":
                row["strategy"] = to_interlace(bench, model)
            row["tokens_per_s"] = round(forward_rate(bench, model, inf_ids))
            row["auto_ran"] = auto_choices(model, args.inf_batch * args.inf_seq, "fwd")
            row["auto_decisions"] = auto_decisions(model, args.inf_batch * args.inf_seq, "fwd")
            if bench.cuda:
                row["max_memory_gb"] = round(torch.cuda.max_memory_allocated(bench.device) / 2**30, 1)
                torch.cuda.reset_peak_memory_stats(bench.device)
            bench.add(row)
            bench.say(f"   {impl:9s} forward {row['tokens_per_s']:>12,} tokens/s")
            del model
            release_shared_buffers()

    def training():
        runs, inits = {}, {}
        for impl in ("hf", "interlace") + (("baseline",) if args.baseline else ()):
            model = build_model(bench, name, layers)
            init = inits[impl] = checksum(model)
            strategy = None if impl == "hf" else to_interlace(bench, model, args.baseline if impl == "baseline" else None)
            losses, times, calibrating = train(bench, model, impl, optimizer, train_ids)
            runs[impl] = losses
            row = dict(base, part="train", impl=impl, strategy=strategy, steps=args.steps, init_checksum=init,
                       tokens_per_step=bench.world * args.train_batch * args.train_seq, calibrating_steps=calibrating,
                       step_s_median=median_after_warmup(times, calibrating), step_s=[round(t, 5) for t in times],
                       losses=losses, auto_ran=auto_choices(model, args.train_batch * args.train_seq, "fwdbwd"),
                       auto_decisions=auto_decisions(model, args.train_batch * args.train_seq, "fwdbwd"))
            if bench.cuda:
                row["max_memory_gb"] = round(torch.cuda.max_memory_allocated(bench.device) / 2**30, 1)
                torch.cuda.reset_peak_memory_stats(bench.device)
            bench.add(row)
            bench.say(f"   {impl:9s} train step {row['step_s_median'] * 1e3:9.1f} ms (median), "
                      f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
                      + (f"; auto ran {row['auto_ran']} after {calibrating} steps" if row["auto_ran"] else ""))
            if impl == "interlace" and not args.baseline:
                state["model"] = model  # the compile part reuses it (else it builds its own: memory)
            else:
                del model
                release_shared_buffers()
                if bench.cuda:
                    torch.cuda.empty_cache()
        hf, il = runs["hf"], runs["interlace"]
        rel = [abs(a - b) / abs(a) for a, b in zip(hf, il)]
        same_init = len(set(inits.values())) == 1
        bench.add(dict(base, part="loss", steps=len(rel), max_rel_diff=max(rel), rel_diff=rel, same_init=same_init))
        bench.say(f"   loss curves: same init {same_init}; max relative difference over {len(rel)} steps "
                  f"{max(rel):.2e} (step {rel.index(max(rel)) + 1}); steps 1, 10, 20, ...:")
        for step in sorted({0, *range(9, len(rel), 10), len(rel) - 1}):
            bench.say(f"     step {step + 1:3d}  hf {hf[step]:.5f}  interlace {il[step]:.5f}  rel {rel[step]:.1e}")

    def compiled():
        model = state.pop("model", None)
        if model is None:
            model = build_model(bench, name, layers)
            to_interlace(bench, model)
        eager = forward_rate(bench, model, inf_ids)
        bench.add(dict(base, part="compile", impl="interlace eager", tokens_per_s=round(eager)))
        row = dict(base, part="compile", impl=f"interlace compiled ({args.compile_backend})")
        began = time.perf_counter()
        try:
            fast = torch.compile(model, backend=args.compile_backend)
            row["tokens_per_s"] = round(forward_rate(bench, fast, inf_ids))
            row["speedup_vs_eager"] = round(row["tokens_per_s"] / eager, 3)
            if args.compile_train:
                optimizer_ = MODELS[name][3]
                _, eager_times, calibrating = train(bench, model, "interlace", optimizer_, train_ids, steps=8)
                _, fast_times, _ = train(bench, fast, "interlace", optimizer_, train_ids, steps=8)
                row["train_step_s_eager"] = median_after_warmup(eager_times, calibrating)
                row["train_step_s_compiled"] = median_after_warmup(fast_times)
        except Exception as exc:  # noqa: BLE001 - a compile failure is this part's result
            if bench.rank == 0:
                traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        row["compile_and_run_s"] = round(time.perf_counter() - began, 1)
        bench.add(row)
        bench.say(f"   eager {eager:,.0f} tokens/s; compiled "
                  + (f"{row['tokens_per_s']:,} tokens/s" if "tokens_per_s" in row else f"failed: {row['error']}"))
        torch._dynamo.reset()

    bench.part(name, "forward", forward)
    bench.part(name, "train", training)
    if args.compile:
        bench.part(name, "compile", compiled)
    state.clear()


def table(bench: Bench) -> None:
    rows = bench.record["rows"]
    bench.say(f"\n{'model':6s} {'part':8s} {'impl':32s} result")
    for r in rows:
        if "skipped" in r or "error" in r:
            result = ("skipped: " + r["skipped"]) if "skipped" in r else ("error: " + " ".join(r["error"].split()))[:160]
        elif r["part"] == "forward" or (r["part"] == "compile" and "tokens_per_s" in r):
            result = f"{r['tokens_per_s']:,} tokens/s" + (f" (x{r['speedup_vs_eager']})" if "speedup_vs_eager" in r
                                                         else "")
        elif r["part"] == "train":
            result = f"step {r['step_s_median'] * 1e3:.1f} ms, loss {r['losses'][-1]:.4f}"
        elif r["part"] == "loss":
            result = f"max rel diff {r['max_rel_diff']:.2e} over {r['steps']} steps"
        else:
            continue
        impl = r.get("impl", "hf vs interlace")
        if r.get("strategy"):
            impl += f" [{r['strategy']}]"
        bench.say(f"{r['model']:6s} {r['part']:8s} {impl:32s} {result}")
    bench.say(f"\n{bench.elapsed():.0f} s; results in {bench.path}")


def main():
    args = parse_args()
    bench = Bench(args)
    planned = STARTUP_S + sum(EXPECTED_S[(m, p)] for m in args.models
                              for p in ("forward", "train") + (("compile",) if args.compile else ()))
    bench.say(f"hf_models: {', '.join(args.models)} on {bench.world} x {bench.record['device']}; expected ~{planned} s "
              f"on 2 H200s (budget {args.budget_s:.0f} s)" + (" [smoke: tiny sizes]" if args.smoke else ""))
    for name in args.models:
        run_model(bench, name)
    table(bench)
    release_shared_buffers()
    if bench.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
