"""``auto``'s routed calls: inference calls the layer hands over with its router
(:meth:`~interlace.strategies.base.Strategy.routes_call`), so that a candidate may route inside
its own kernel (``persistent``) while the others route first, each timed with its routing.

**World size 1.** Inference calls on a GPU calibrate ``persistent`` against ``sequential``
(key mode ``"fwd"``, the world-1 device key).

**World size W > 1.** Inference calls calibrate ``persistent`` beside the model's candidates
(``sequential``, ``pipelined:r``, ``fused``) for buckets up to ``persistent_max_tokens`` tokens
per rank, under their own key mode :data:`ROUTED` (a decision of a routed call never serves a
call that comes routed, and the reverse). Larger buckets, where ``persistent`` is no candidate,
keep the key mode ``"fwd"`` of routed calls: their decisions (and the ones shipped for the
presets) serve both kinds of call. The agreement is :mod:`interlace.strategies.auto`'s: the
group's largest count keys the call, so a ``persistent`` call never has more tokens than its
buffers hold (``persistent_max_tokens`` per rank, sized once). Every rank with tokens must hand
over the same kind of call (a call with ``expert_indices``, a balance loss in training mode or
under ``torch.compile`` comes routed, mode ``"fwd"``): where they differ, every rank raises
(:mod:`interlace.parallel.agreement`); a rank without tokens follows the others.
"""

from __future__ import annotations

import torch

from interlace.strategies.auto_decisions import Clock, token_bucket
from interlace.strategies.base import strategy_class

ROUTED = "fwd-routed"  # key mode of W > 1 inference calls handed over with the router
PERSISTENT = "persistent"
FUSED_SPECS = ("fused", "fused:train")  # the strategies with buffers for a fixed token count per rank


def persistent_buffer_bytes(config, world: int, max_tokens: int) -> int:
    """Bytes of the W > 1 persistent buffer on one rank (its regions: ``DistSpec.regions``)."""
    from interlace.kernels.persistent.dist_launch import DistSpec

    return DistSpec(world, config.num_experts // world, config.hidden, config.top_k, max_tokens, config.dtype).nbytes


class RoutedCalls:
    """Mixin of :class:`~interlace.strategies.auto.AutoStrategy`: the calls that come with
    the router (``routes_call`` / ``forward_layer``)."""

    # -- which calls come here -------------------------------------------------------------------
    def routes_call(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
        """Inference calls (no autograd graph) where a candidate routes inside its kernel: at
        world size 1 when more than one candidate runs here; at W > 1 when ``persistent`` can."""
        if not self.options.calibrate:
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, router.weight, w_up, w_down)):
            return False
        if self._agree is None:
            return len(self._world1_candidates(x.device)) > 1
        return self._persistent_here(x.device)

    def _world1_candidates(self, device: torch.device) -> tuple:
        found = self._routed_candidates.get(device.type)
        if found is None:
            from interlace.strategies.persistent import unsupported

            if self.options.candidates is not None:
                found = tuple(self.options.candidates)
            elif device.type == "cuda" and unsupported(self.config, 1) is None:
                found = (PERSISTENT, "sequential")
            else:
                found = ("sequential",)
            found = self._routed_candidates[device.type] = tuple(
                s for s in found if _runs(s, device) and self.runs_experts(s))
        return found

    def _persistent_here(self, device: torch.device) -> bool:
        """W > 1: whether ``persistent`` is a candidate of routed calls on ``device`` (the config
        runs in its kernel, ``persistent_max_tokens`` > 0, its buffers fit ``memory_cap``, and a
        GPU, or the ``candidates`` option naming it)."""
        found = self._persistent_ok.get(device.type)
        if found is None:
            from interlace.strategies.persistent import unsupported

            opts, cap = self.options, self.options.persistent_max_tokens
            found = (cap > 0 and unsupported(self.config, self.ep.world) is None
                     and (self.ep.one_host or device.type != "cuda")  # (peer memory: one host only)
                     and (PERSISTENT in opts.candidates if opts.candidates is not None else device.type == "cuda")
                     and (opts.memory_cap is None
                          or persistent_buffer_bytes(self.config, self.ep.world, cap) <= opts.memory_cap)
                     and _runs(PERSISTENT, device) and self.runs_experts(PERSISTENT))
            self._persistent_ok[device.type] = found
        return found

    def routed_candidates(self, predicted: dict, bucket: int, device) -> dict:
        """W > 1: the candidates of a routed key, ``persistent`` (unpredicted) added up to
        ``persistent_max_tokens`` tokens per rank and dropped above."""
        predicted = dict(predicted)
        if bucket <= self.options.persistent_max_tokens and self._persistent_here(torch.device(device)):
            predicted.setdefault(PERSISTENT, None)
        else:
            predicted.pop(PERSISTENT, None)
        return predicted

    # -- the calls -------------------------------------------------------------------------------
    def forward_layer(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """x (T, N) → (T, N): this call's strategy (routing inside, or the router first), or a
        calibration call of the scheduled candidate, timed with its routing."""
        args = (x, router, w_up, w_down)
        if self._agree is None:
            return self._routed_key_call(x.shape[0], "fwd", args, x.is_cuda and torch.cuda.is_current_stream_capturing())
        agreed = self._agree.settle(x.shape[0], False, True).tokens
        ready = self._ready.get((token_bucket(agreed), ROUTED))
        if ready is not None and agreed <= ready[1]:  # (a decided key: straight to its strategy)
            return self._run_routed(ready[0], *args)
        return self._routed_key_call(agreed, None, args, x.is_cuda and torch.cuda.is_current_stream_capturing())

    def _routed_mode(self, bucket: int) -> str:
        """W > 1: the key mode of a routed call of ``bucket``: :data:`ROUTED` where
        ``persistent`` is a candidate, else ``"fwd"`` (the candidates of a call that comes routed)."""
        return ROUTED if 0 < bucket <= self.options.persistent_max_tokens else "fwd"

    def _routed_key_call(self, agreed: int, mode: str | None, args, capturing: bool) -> torch.Tensor:
        """The call under the key of ``agreed`` tokens (the group's largest count; ``mode`` None:
        :meth:`_routed_mode`): its choice, or the scheduled candidate of its calibration, timed
        with its routing."""
        x = args[0]
        bucket = token_bucket(agreed)
        key = (bucket, mode or self._routed_mode(bucket))
        state = self._key_state(key, x.device)
        if state.choice is None and state.pos == len(state.schedule) and not capturing:
            self._decide(key, state, Clock(x.device))
        if state.choice is not None:
            impl = self._impl(state.choice.spec, agreed)
            self._mark_ready((bucket, ROUTED), state.choice.spec, impl)
            return self._run_routed(impl, *args)
        if capturing:  # nothing timed or recorded inside a capture
            return self._routed(state.plan["candidates"][0], agreed, *args)
        clock = Clock(x.device)
        c = state.schedule[state.pos]
        warm = state.pos < len(state.plan["candidates"]) * self.options.warmup
        state.pos += 1
        if x.is_cuda:
            # NOTE: a device sync before each calibration call (never in the steady state): each
            # candidate is timed from an idle GPU, its host time included. Back to back, a call
            # after one that queued its work asynchronously (persistent) would launch under that
            # work and hide its own host time (sequential's), and win by it.
            torch.cuda.synchronize(x.device)
        marks = [clock.mark()]
        out = self._routed(state.plan["candidates"][c], agreed, *args)
        marks.append(clock.mark())
        state.samples[c].append((warm, marks))
        return out

    def _routed(self, spec: str, agreed: int, x, router, w_up, w_down) -> torch.Tensor:
        return self._run_routed(self._impl(spec, agreed), x, router, w_up, w_down)

    @staticmethod
    def _run_routed(impl, x, router, w_up, w_down) -> torch.Tensor:
        if impl.routes_itself:
            return impl.forward_layer(x, router, w_up, w_down)
        topk_idx, topk_weight, _ = router(x, None, fused=impl.fused_routing)
        return impl(x, topk_idx, topk_weight, w_up, w_down)


def _runs(spec: str, device: torch.device) -> bool:
    try:
        strategy_class(spec).check_runtime(spec, device)
        return True
    except ValueError:
        return False
