"""LLMEngine: requests in, tokens out, one `step()` at a time.

    add_request() -> Scheduler.add()          validate, queue (with a KV connector: look in the pool first)
    step():  KVConnector.ready_loads()        requests whose pool blocks are now in the prefix cache: queue them
             Scheduler.schedule()             which chunks run now (continuous batching)
             ModelRunner.launch()             block ops, one forward over all chunks, sampling (not waited for)
             ModelRunner.collect()            this step's tokens, or with async scheduling the step before's
             KVConnector.save_prompt()        prompts computed in that step: their blocks to the pool
             Scheduler.update()               append tokens, check stops, free finished blocks
             detokenize, check stop strings   build RequestOutputs
    abort()  -> Scheduler.abort()             free blocks at once

With asynchronous scheduling (`EngineConfig.async_scheduling`, on by default on a GPU) one step stays in flight:
the host schedules and launches step n + 1 while the device runs step n, then reads step n's tokens back.

The HTTP server drives the same object from a background loop; `LLM`
(serve/llm.py) drives it to completion for offline batches. Given a KV pool
(`kv_pool=`, e.g. Mooncake Store), the engine shares prompt blocks with every
other engine on the pool (serve/kv_connector.py); without one it is the
colocated engine, unchanged. `add_request(..., outputs=)` resumes a request
whose first tokens another engine generated (a decode instance).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import functools
import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoforge.errors import NanoforgeError
from nanoforge.kernels import gemv
from nanoforge.model.hf import load_model
from nanoforge.model.transformer import Transformer
from nanoforge.runtime import pick_device, pick_dtype
from nanoforge.serve import tensor_parallel
from nanoforge.serve.kv_connector import (
    KVConnector,
    KVPool,
    cache_layout,
    model_fingerprint,
)
from nanoforge.serve.model_runner import Launched, ModelRunner, kv_bytes_per_block
from nanoforge.serve.sampling_params import SamplingParams
from nanoforge.serve.scheduler import (
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    check_request,
)
from nanoforge.serve.sequence import Sequence, SequenceGroup, SequenceStatus
from nanoforge.serve.step_profile import StepStats
from nanoforge.serve.tensor_parallel import (
    TensorParallel,
    check_tensor_parallel,
    shard_model,
)
from nanoforge.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # default: the model's context
    num_gpu_blocks: int | None = None  # default: sized from the memory budget below
    kv_cache_memory: int | None = None  # bytes for the KV cache; default: see kv_cache_blocks
    gpu_memory_utilization: float = 0.90
    swap_space: int = 0  # bytes of CPU memory for swapped-out blocks
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    use_cuda_graphs: bool = True
    # prefill and mixed steps graphed too: padded to token buckets (serve/model_runner.py: prefill_buckets), one
    # CUDA graph per bucket captured at start; None: model_runner.GRAPH_PREFILL_DEFAULT (on where decode is graphed)
    graph_prefill: bool | None = None
    # schedule and launch step n + 1 before reading step n's tokens back (the host's work overlaps the device's);
    # None: on a GPU (check_async_scheduling), except when saving to a KV pool (works, not yet measured on a GPU)
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1  # processes (one per GPU) the model is split over
    device: str = "auto"
    dtype: str = "auto"
    # with a KV pool: save computed prompt blocks to it (a decode instance does not), the staging buffer for
    # moving blocks (default 64 MiB on the CPU, 1 GiB on a GPU), the time a pool call gets before it is a miss, and
    # the threads that make pool calls (one request's transfer each, at the same time)
    kv_pool_save: bool = True
    kv_pool_staging: int | None = None
    kv_pool_timeout: float = 2.0
    kv_pool_workers: int = 4


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then one runner entry per token
    # (complete in every output: outputs start once the prompt is computed; the engine never changes it after)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival_time, first_token_time, finish_time (monotonic seconds)
    error: str | None = None
    # with a KV pool, on the finished output: the save of the prompt's blocks (a future of the blocks stored)
    kv_save: concurrent.futures.Future | None = None


_frozen_depth = 0
_frozen_lock = threading.Lock()


@contextlib.contextmanager
def frozen_heap():
    """Run a step loop with the objects alive at entry out of the cyclic garbage collector's walks (`gc.freeze`).

    A step allocates a few containers per sequence; every few hundred steps that sets off a full collection,
    which walks every object alive: the model, torch's and every imported module's. On nano-vllm's workload
    those walks were a quarter of the engine's host time (`benchmarks/engine_host.py`). Frozen, a collection
    walks what the loop made. Objects are still freed when their last reference goes; only cyclic garbage
    from before entry waits for the exit, where everything is handed back to the collector. Nests (the
    outermost entry freezes) and may be entered from several threads."""
    global _frozen_depth
    with _frozen_lock:
        _frozen_depth += 1
        if _frozen_depth == 1:
            gc.freeze()
    try:
        yield
    finally:
        with _frozen_lock:
            _frozen_depth -= 1
            if _frozen_depth == 0:
                gc.unfreeze()


def _by_index(seq: Sequence) -> int:
    return seq.index


class _Detok:
    """Per-sequence text state: incremental decoding and stop-string search."""

    def __init__(self, tok: Tokenizer):
        self.decoder = IncrementalDecoder(tok)
        self.text = ""
        self.consumed = 0  # output tokens already decoded


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, config: EngineConfig | None = None,
                 kv_pool: KVPool | None = None, model_factory: Callable[[torch.device], Transformer] | None = None):
        """`tokenizer=None` serves token ids only (no text, no stop strings): benchmarks use that. `kv_pool`
        shares prompt blocks with other engines through a cluster-wide pool. With tensor parallelism, the other
        ranks build their model with `model_factory(device)` (default: from `model`'s weights), and this engine
        keeps a sharded copy of `model` (the given one is left whole)."""
        self.config = config = config or EngineConfig()
        cfg = model.cfg
        self.max_model_len = min(config.max_model_len or cfg.max_seq_len, cfg.max_seq_len)
        self.tp: TensorParallel | None = None
        if config.tensor_parallel_size != 1:
            model = self._start_tensor_parallel(model, kv_pool, model_factory)
        self.model = model
        self.tokenizer = tokenizer
        num_gpu_blocks, num_cpu_blocks = kv_cache_blocks(model, config, self.max_model_len)
        if self.tp is not None:
            num_gpu_blocks = self.tp.agree_min(num_gpu_blocks)
        eos = set(tokenizer.stop_ids) if tokenizer is not None else set()
        if cfg.eos_token_id is not None:
            eos |= set(cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id])
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=self.max_model_len, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill, preemption_mode=config.preemption_mode,
            eos_token_ids=tuple(sorted(eos)), vocab_size=cfg.vocab_size))
        started, tuned = time.monotonic(), gemv.tuning_s()
        self.runner = make_runner(model, config, self.max_model_len, num_gpu_blocks, num_cpu_blocks, self.tp)
        # the cache, the device batch, every CUDA graph captured and what their warm-up tunes (kernels
        # autotuned, decode projections timed per shape): what a server start waits for
        self.runner_start_s = time.monotonic() - started
        self.runner_tuning_s = gemv.tuning_s() - tuned  # of which the skinny matmul's tuning
        self.async_scheduling = check_async_scheduling(config, self.runner.device, kv_pool)
        self._in_flight: collections.deque[tuple[SchedulerOutput, Launched, float]] = collections.deque()
        self.step_stats = StepStats()
        self.connector: KVConnector | None = None
        if kv_pool is not None:
            dtype = model.embed.weight.dtype
            staging = config.kv_pool_staging or (1 << 30 if self.runner.device.type == "cuda" else 64 << 20)
            namespace = f"nanoforge/{model_fingerprint(model)}/{cache_layout(cfg, config.block_size, dtype)}"
            self.connector = KVConnector(kv_pool, self.runner, self.scheduler.block_manager, namespace,
                                         save=config.kv_pool_save, staging_bytes=staging,
                                         timeout_s=config.kv_pool_timeout, workers=config.kv_pool_workers)
        self._saves: dict[str, concurrent.futures.Future] = {}  # request id -> the save of its prompt blocks
        self._detok: dict[int, _Detok] = {}
        self._prompts: dict[str, str | None] = {}
        self._first_token: dict[str, float] = {}
        self._next_id = 0

    def _start_tensor_parallel(self, model: Transformer, kv_pool, model_factory) -> Transformer:
        """Start the other ranks; return this rank's shard of the model."""
        n = self.config.tensor_parallel_size
        check_tensor_parallel(model.cfg, n)
        if kv_pool is not None:
            raise NanoforgeError("a KV pool (--store) works with one device per instance; drop "
                                 "--tensor-parallel-size", param="tensor_parallel_size")
        if model_factory is None:
            model_factory = functools.partial(model_from_state, model.cfg, model.state_dict())
            model = copy.deepcopy(model)
        self.tp = tensor_parallel.start(n, model.embed.weight.device, serve_worker,
                                        (model_factory, self.config, self.max_model_len))
        return shard_model(model, 0, n, self.tp.group)

    @classmethod
    def from_pretrained(cls, model_dir: str, config: EngineConfig | None = None,
                        kv_pool: KVPool | None = None) -> LLMEngine:
        config = config or EngineConfig()
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        model = load_model(model_dir, device=device, dtype=dtype)
        factory = functools.partial(_load_on, model_dir, dtype) if config.tensor_parallel_size > 1 else None
        return cls(model, Tokenizer.load(model_dir), config, kv_pool, model_factory=factory)

    # --- requests -----------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    outputs: list[tuple[int, list[int], list | None]] | None = None) -> str:
        """Validate and queue a request; raises NanoforgeError naming the bad field (nothing is queued then).

        The scheduler checks the prompt's ids and the sampling parameters; here, what needs the tokenizer.
        `outputs` resumes a request another engine started: (completion index, its tokens so far, their
        logprob entries) per completion still to generate (`SequenceGroup`)."""
        params = params or SamplingParams()
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop):
            raise NanoforgeError("this engine has no tokenizer: give token ids and no stop strings", param="prompt")
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode_prompt(prompt)
        else:
            text, ids = None, list(prompt)
        if len(ids) > self.max_model_len - (params.max_tokens > 0):  # a generated token needs a position too
            raise NanoforgeError(f"prompt is {len(ids)} tokens; the context is {self.max_model_len}"
                                 + (" (prompt + at least one generated token must fit)" if params.max_tokens else ""),
                                 param="prompt", status=400)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self._prompts:  # every unfinished request, in the scheduler or loading from the pool
            raise NanoforgeError(f"request_id {request_id!r} is already in use", param="request_id")
        group = SequenceGroup(request_id, ids, params, arrival_time, outputs)
        check_request(self.scheduler.config, group)
        if self.connector is None or not self.connector.start_load(group):
            self.scheduler.enqueue(group)
        self._prompts[request_id] = text
        return request_id

    def abort(self, request_id: str) -> bool:
        group = self.scheduler.abort(request_id)
        if group is None and self.connector is not None:
            group = self.connector.cancel(request_id)
        if group is None:
            return False
        self._forget(group)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight) or \
            bool(self.connector and self.connector.num_pending)

    def num_waiting(self) -> int:
        """Requests queued for a batch slot (new, or preempted by recomputation, or looking in the KV pool)."""
        return len(self.scheduler.waiting) + (self.connector.num_pending if self.connector else 0)

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        stats["steps"] = self.step_stats.snapshot()
        if self.connector is not None:
            stats["kv_pool"] = self.connector.stats()
            stats["num_waiting"] += stats["kv_pool"]["pending_loads"]
        return stats

    def close(self) -> None:
        """Stop the KV connector's worker and the other tensor-parallel ranks (if there are any)."""
        if self.connector is not None:
            self.connector.close()
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    # --- the step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, then read back a step's tokens: this one's, or with asynchronous
        scheduling the one before (launched last time; this one runs meanwhile). Returns an output for every
        request that finished in the step read back, and for every other one that progressed in it unless its
        `output_kind` is "final_only"."""
        if self.connector is not None:  # idle but for loads: wait a little for one instead of spinning
            for group in self.connector.ready_loads(wait=0.0 if self.scheduler.has_unfinished() else 0.01):
                self.scheduler.enqueue(group)
        out = self.scheduler.schedule()
        if not out.is_empty or out.finished:
            launched_at = time.monotonic()
            self._in_flight.append((out, self.runner.launch(out), launched_at))
        if not self._in_flight or (len(self._in_flight) <= self.async_scheduling and not out.is_empty):
            return []  # nothing launched before this step: nothing to read back yet
        out, launched, launched_at = self._in_flight.popleft()
        sampled, logprobs, prompt_logprobs = self.runner.collect(launched)
        self.step_stats.record(out, launched_at, time.monotonic())
        if self.connector is not None:
            self._save_prompts(out)
        finished = {g.request_id: g for g in self.scheduler.update(out, sampled, logprobs, prompt_logprobs)}
        for group in out.finished:
            finished[group.request_id] = group
        now = time.monotonic()
        touched: dict[str, SequenceGroup] = {}
        first_token, get_group = self._first_token, self.scheduler.get_group
        for item in out.scheduled:
            rid = item.seq.request_id
            if item.num_samples and rid not in touched:
                group = finished.get(rid) or get_group(rid)
                if group is not None:
                    touched[rid] = group
                    if rid not in first_token:
                        first_token[rid] = now
        touched.update(finished)
        results = []
        for rid, group in touched.items():
            if self.tokenizer is not None:
                for seq in group.seqs:
                    if self._update_text(seq) and not seq.is_finished:
                        ended = self.scheduler.finish_seq(seq, "stop")
                        if ended is not None:
                            finished[rid] = ended
            done = rid in finished or group.is_finished
            if done or group.sampling_params.output_kind == "cumulative":
                results.append(self._output(group, done, now))
        for group in finished.values():
            self._forget(group)
        return results

    def _save_prompts(self, out: SchedulerOutput) -> None:
        """Hand the KV connector the prompts whose last chunk this step computed (blocks still held). A step
        ahead, the next step was scheduled and launched first: a sequence it preempted (or an abort finished)
        holds those blocks no more and is left out (recomputed, its prompt is saved then); the others' full
        prompt blocks are not written by it, and the connector's read of them runs after it in stream order."""
        for item in out.scheduled:
            seq = item.seq
            if item.start < seq.num_prompt_tokens <= item.end and seq.status is SequenceStatus.RUNNING \
                    and seq.request_id not in self._saves:
                future = self.connector.save_prompt(seq)
                if future is not None:
                    self._saves[seq.request_id] = future

    def _update_text(self, seq: Sequence) -> bool:
        """Decode new tokens (an engine with a tokenizer); True if a stop string appeared (the text is cut before
        it)."""
        st = self._detok.get(seq.seq_id)
        if st is None:
            st = self._detok[seq.seq_id] = _Detok(self.tokenizer)
        params = seq.sampling_params
        out_ids = seq.output_token_ids
        for tok in out_ids[st.consumed:]:
            if tok in self.scheduler.config.eos_token_ids and not params.ignore_eos:
                continue  # the end token is not part of the text
            st.text += st.decoder.push(tok)
        st.consumed = len(out_ids)
        if seq.is_finished:
            st.text += st.decoder.flush()
        if params.stop:
            cut = min((i for i in (st.text.find(s) for s in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                st.text = st.text[:cut]
                return True
        return False

    def _output(self, group: SequenceGroup, finished: bool, now: float) -> RequestOutput:
        rid, detok = group.request_id, self._detok
        seqs = group.seqs if len(group.seqs) == 1 else sorted(group.seqs, key=_by_index)
        outs = []
        for s in seqs:
            st = detok.get(s.seq_id)
            outs.append(CompletionOutput(s.index, st.text if st is not None else "", s.output_token_ids,  # (a copy)
                                         s.finish_reason,
                                         list(s.output_logprobs) if s.sampling_params.logprobs is not None else None))
        metrics = {"arrival_time": group.arrival_time, "first_token_time": self._first_token.get(rid)}
        if finished:
            metrics["finish_time"] = now
        first = group.seqs[0]
        return RequestOutput(rid, self._prompts.get(rid), group.prompt_token_ids, outs, finished,
                             prompt_logprobs=first.prompt_logprobs, num_cached_tokens=first.num_cached_tokens,
                             metrics=metrics, error=group.error, kv_save=self._saves.get(rid) if finished else None)

    def _forget(self, group: SequenceGroup) -> None:
        for s in group.seqs:
            self._detok.pop(s.seq_id, None)
        self._prompts.pop(group.request_id, None)
        self._first_token.pop(group.request_id, None)
        self._saves.pop(group.request_id, None)


# --- construction shared by every rank -------------------------------------------------------------------

def check_async_scheduling(c: EngineConfig, device: torch.device, kv_pool) -> bool:
    """Whether the engine schedules a step ahead: `c.async_scheduling`, by default on a GPU (on the H200: 2.6x
    the output tok/s of step-by-step scheduling on nano-vllm's workload; on the CPU torch runs synchronously
    and there is nothing to overlap). With tensor parallelism every rank holds the sampled tokens (the first
    rank broadcasts them on the device after each step), so a step launched ahead reads its pending tokens on
    every rank. An engine that only loads from a KV pool (a decode instance) schedules ahead by default too:
    its loads land in the cache before the step that reads them is launched. One that saves to a pool (a
    prefill or colocated instance) does when asked (`--async-scheduling`): a prompt's blocks are read for the
    pool after the step ahead was launched, in stream order, from a sequence that step did not preempt
    (`_save_prompts`); tested on the CPU, not yet run on a GPU, so not the default there."""
    if c.async_scheduling is None:
        return device.type == "cuda" and not (kv_pool is not None and c.kv_pool_save)
    return c.async_scheduling


def kv_cache_blocks(model: Transformer, c: EngineConfig, max_model_len: int) -> tuple[int, int]:
    """KV-cache blocks on the device and in swap space for this rank's model: `num_gpu_blocks` if given, else
    what the memory budget holds. On a GPU the budget is (utilisation x the card) - what others use - room for
    one full batch of activations; on the CPU, enough for max_num_seqs sequences of 512 tokens, at most 1 GiB."""
    cfg, dtype = model.cfg, model.embed.weight.dtype
    per_block = kv_bytes_per_block(model, c.block_size, dtype)
    if c.preemption_mode == "swap" and c.swap_space < per_block:
        raise NanoforgeError("preemption_mode 'swap' needs swap_space (bytes of CPU memory) for at least one block",
                             param="swap_space")
    if c.num_gpu_blocks:
        return c.num_gpu_blocks, c.swap_space // per_block
    dev = model.embed.weight.device
    if c.kv_cache_memory:
        budget = c.kv_cache_memory
    elif dev.type == "cuda":
        # what an engine closed before this one left (its cache, its graphs' pools) goes back first: PyTorch's
        # allocator keeps freed memory, and the driver counts it as used. Without this a second engine in one
        # process sized its cache from next to nothing (H200: 226 preemptions and 100K steps for 256 requests).
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        act = 64 * c.max_num_batched_tokens * cfg.d_model * 4
        budget = max(0, int(total * c.gpu_memory_utilization) - (total - free) - act)
    else:
        per_token = per_block // c.block_size
        budget = min(1 << 30, per_token * c.max_num_seqs * min(512, max_model_len))
    return max(1, budget // per_block), c.swap_space // per_block


def make_runner(model: Transformer, c: EngineConfig, max_model_len: int, num_gpu_blocks: int, num_cpu_blocks: int,
                tp: TensorParallel | None) -> ModelRunner:
    device = model.embed.weight.device  # every rank decides alike: tensor parallelism takes no KV pool
    return ModelRunner(model, block_size=c.block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                       max_num_seqs=c.max_num_seqs, max_model_len=max_model_len,
                       max_num_batched_tokens=c.max_num_batched_tokens, use_cuda_graphs=c.use_cuda_graphs,
                       graph_prefill=c.graph_prefill, tp=tp,
                       share_tokens=tp is not None and check_async_scheduling(c, device, None))


def serve_worker(tp: TensorParallel, model_factory: Callable, c: EngineConfig, max_model_len: int) -> None:
    """A tensor-parallel rank other than the first: build its shard and runner as the first rank does, then run
    every step the first rank sends until it says stop."""
    model = shard_model(model_factory(tp.device), tp.rank, tp.world, tp.group)
    num_gpu_blocks, num_cpu_blocks = kv_cache_blocks(model, c, max_model_len)
    runner = make_runner(model, c, max_model_len, tp.agree_min(num_gpu_blocks), num_cpu_blocks, tp)
    while not (step := tp.receive()).stop:
        runner.run(step)


def model_from_state(cfg, state: dict, device: torch.device) -> Transformer:
    """A model with the given weights on `device` (the other ranks' copy of an in-memory model)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(state, assign=True)
    model.reset_buffers(device)
    model.to(device)
    return model.eval()


def _load_on(model_dir: str, dtype: torch.dtype, device: torch.device) -> Transformer:
    return load_model(model_dir, device=device, dtype=dtype)
