"""Where an engine step's time goes, per step kind: `nanoforge bench throughput --profile`.

Each step is a *prefill* (every scheduled sequence computes several tokens), a *decode* (one token each) or
*mixed*. Per kind the profiler sums:

- wall: the whole `LLMEngine.step()` (scheduling, packing, launching, reading the tokens back, bookkeeping);
- wait: the time the host sat blocked reading the sampled tokens back (the step's one sync);
- host = wall - wait: the time the CPU was busy, the part a faster GPU cannot remove (on a CPU, where the
  device's part runs on the host, that part is left out of host too);
- device: the device's span of the step's work (CUDA events around upload, model and sampling; on the CPU,
  the wall time of that part, which runs synchronously), read once at the end (no extra syncs);
- what the device had to move and compute: weight bytes plus the KV bytes the step's attention reads, and
  the forward FLOPs (2 per weight per token, the vocabulary projection only for sampled rows, attention
  over the causal pairs it computes), as achieved GB/s and TFLOP/s over the device time and, on a device
  whose peaks we know (`runtime`), as fractions of them: decode is judged by bandwidth, prefill by FLOPs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from nanoforge.runtime import peak_flops, peak_hbm_bandwidth

KINDS = ("prefill", "decode", "mixed")
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)  # seconds: the step-time histogram's bounds


def step_kind(lengths: list[int]) -> str | None:
    """A step whose scheduled sequences compute `lengths` tokens each: "prefill" (several each), "decode" (one
    each) or "mixed"; None: nothing scheduled."""
    if not lengths:
        return None
    return "decode" if max(lengths) == 1 else "prefill" if min(lengths) > 1 else "mixed"


class StepStats:
    """Always on, cheap: per step kind, the steps an engine read back, their tokens, and each step's *turn*:
    from when it could run (launched, and the step before it read back) to when its tokens were read back, as
    a histogram over STEP_BUCKETS. In a busy engine a step's turn is its time on the device, whatever the
    scheduling; `/metrics` exports it (nanoforge_engine_step_seconds{kind}), so a serving run shows what its
    steps cost (e.g. a decode instance's steps beside a prefill process on the same GPU)."""

    def __init__(self):
        self.kinds = {k: {"steps": 0, "tokens": 0, "seconds": 0.0, "buckets": [0] * len(STEP_BUCKETS)}
                      for k in KINDS}
        self._last: float | None = None  # when the last step was read back

    def record(self, out, launched_at: float, read_at: float) -> None:
        start = launched_at if self._last is None else max(launched_at, self._last)
        self._last = read_at
        lengths = [it.num_tokens for it in out.scheduled]
        kind = step_kind(lengths)
        if kind is None:
            return
        k, seconds = self.kinds[kind], max(0.0, read_at - start)
        k["steps"] += 1
        k["tokens"] += sum(lengths)
        k["seconds"] += seconds
        for i, bound in enumerate(STEP_BUCKETS):
            if seconds <= bound:
                k["buckets"][i] += 1

    def snapshot(self) -> dict:
        return {k: {**v, "buckets": list(v["buckets"])} for k, v in self.kinds.items()}


@dataclass
class _Kind:
    steps: int = 0
    tokens: int = 0
    wall: float = 0.0
    wait: float = 0.0
    device: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    events: list = field(default_factory=list)  # (start, end) CUDA events, timed at the end


class StepProfiler:
    def __init__(self, model, kv_bytes_per_token: int):
        """`model`: this rank's model; `kv_bytes_per_token`: K and V of one token over every layer."""
        cfg = model.cfg
        self.device = model.embed.weight.device
        elt = model.embed.weight.element_size()
        body = [p for n, p in model.named_parameters() if not n.startswith(("embed", "lm_head"))]
        self.vocab_params = model.lm_head.weight.numel()
        self.weight_bytes = (sum(p.numel() for p in body) + self.vocab_params) * elt  # a lookup reads only its rows
        self.body_params = sum(p.numel() for p in body if p.dim() > 1)  # the matmuls' weights
        self.attn_flops_per_pair = 4 * cfg.n_layers * model.layers[0].attn.n_heads * cfg.head_dim  # QK^T and PV
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kinds = {k: _Kind() for k in KINDS}
        self._cur: _Kind | None = None
        self._t0 = self._dev0 = 0.0
        self._ev = None

    # --- called by the engine loop and the runner ----------------------------------------------------

    def step_begin(self) -> None:
        self._t0 = time.perf_counter()
        self._cur = None

    def step_end(self) -> None:
        if self._cur is not None:
            self._cur.wall += time.perf_counter() - self._t0

    def device_begin(self, out, num_samples: int) -> None:
        """The step's work is about to be handed to the device: classify it and count what it costs."""
        items = out.scheduled
        if not items:
            return
        q = [it.end - it.start for it in items]
        k = self._cur = self.kinds[step_kind(q)]
        k.steps += 1
        tokens = sum(q)
        k.tokens += tokens
        kv_read = sum(it.end for it in items)  # every query reads its sequence's keys once (per layer)
        pairs = sum((it.end * (it.end + 1) - it.start * (it.start + 1)) // 2 for it in items)  # causal
        k.bytes += self.weight_bytes + kv_read * self.kv_bytes_per_token
        k.flops += 2 * self.body_params * tokens + 2 * self.vocab_params * num_samples \
            + self.attn_flops_per_pair * pairs
        if self.device.type == "cuda":
            self._ev = torch.cuda.Event(enable_timing=True)
            self._ev.record()
        else:
            self._dev0 = time.perf_counter()

    def device_end(self) -> None:
        if self._cur is None:
            return
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._cur.events.append((self._ev, end))
        else:
            self._cur.device += time.perf_counter() - self._dev0

    def waited(self, seconds: float) -> None:
        if self._cur is not None:
            self._cur.wait += seconds

    # --- the report ------------------------------------------------------------------------------------

    def summary(self) -> dict:
        """Per step kind: counts, ms per step (wall, host, wait, device), achieved GB/s and TFLOP/s and, where
        the device's peaks are known, their fractions."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        bw, fl = peak_hbm_bandwidth(self.device), peak_flops(self.device)
        result = {}
        for name, k in self.kinds.items():
            if not k.steps:
                continue
            device = k.device + sum(a.elapsed_time(b) for a, b in k.events) / 1e3
            gbs = k.bytes / device / 1e9 if device else 0.0
            tfs = k.flops / device / 1e12 if device else 0.0
            result[name] = {"steps": k.steps, "tokens": k.tokens, "bytes": k.bytes, "flops": k.flops,
                            "wall_ms": 1e3 * k.wall / k.steps,
                            "host_ms": 1e3 * (k.wall - k.wait - (k.device if not k.events else 0)) / k.steps,
                            "wait_ms": 1e3 * k.wait / k.steps,
                            "device_ms": 1e3 * device / k.steps, "tokens_per_s": k.tokens / k.wall if k.wall else 0,
                            "achieved_GB_s": gbs, "achieved_TFLOP_s": tfs,
                            "hbm_fraction": gbs * 1e9 / bw if bw else None,
                            "flops_fraction": tfs * 1e12 / fl if fl else None}
        return result


def print_profile(summary: dict) -> None:
    def frac(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    print(f"\n{'step kind':<10}{'steps':>7}{'tokens':>10}{'wall ms':>9}{'host ms':>9}{'wait ms':>9}{'device ms':>10}"
          f"{'GB/s':>9}{'HBM':>7}{'TFLOP/s':>9}{'MFU':>7}")
    for name, r in summary.items():
        print(f"{name:<10}{r['steps']:>7}{r['tokens']:>10}{r['wall_ms']:>9.2f}{r['host_ms']:>9.2f}{r['wait_ms']:>9.2f}"
              f"{r['device_ms']:>10.2f}{r['achieved_GB_s']:>9.1f}{frac(r['hbm_fraction']):>7}"
              f"{r['achieved_TFLOP_s']:>9.2f}{frac(r['flops_fraction']):>7}")
    print("host = wall - wait (the CPU's busy time per step; on a CPU, less the device part too); device = the "
          "device's span of upload, model and sampling")
