"""ModelRunner: runs one scheduler step on the model over the paged KV cache.

For each step it
1. packs the step's inputs on the host (`InputBatch.prepare`: the persistent batch sends only what changed
   since the last step) and uploads them in one copy; the device keeps each sequence's block table and
   sampling parameters in its slot of the batch;
2. executes the block operations the scheduler asked for (swap out to the CPU pool, swap in, copy-on-write
   copies), in that order;
3. runs the model once over the step's ragged batch of tokens (no padding between sequences), with
   `PagedAttention` as its attention backend: each layer writes the new tokens' K/V into their cache slots
   and attends through the block tables (`nanoforge.kernels.paged_attention`: Triton on a GPU, the PyTorch
   reference on the CPU);
4. computes logits only at the positions that sample, and samples each with its own request's settings
   (`nanoforge.model.sampling`), into a device buffer that the next step reads a still-pending token from
   and that is copied to pinned memory as the step ends (`launch` returns then; `collect` waits for it);
5. where a request asked for them, turns logits into logprobs (fp32 log-softmax, top k; one routine,
   `logprob_entries`): of each sampled token, and of each prompt token at the chunk's `scored_positions`
   (prompt logprobs, projected onto the vocabulary a slice of rows at a time).

On a GPU, steps that are pure decode run as replays of CUDA graphs captured for a ladder of batch sizes
(padded up to the next one), and prefill and mixed steps as replays of graphs captured for token buckets
(`prefill_buckets`, at every sequence slot; `graph_prefill`): the graph reads its inputs from fixed places of
the uploaded buffer, gathers the block tables of its rows from the slots' tables, and runs the model. Padded
rows read and write only a scratch block that the block manager never hands out.

The KV cache is one tensor per K and V of shape (n_layers, num_blocks, block_size, n_kv_heads, head_dim),
sized from a memory budget; a block id indexes the same block in every layer.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoforge.kernels import gemv
from nanoforge.kernels.decode_layers import ring_stages
from nanoforge.kernels.dispatch import env_choice, replays_us
from nanoforge.kernels.gather import gather_step_inputs, gather_step_inputs_ref
from nanoforge.kernels.paged_attention import paged_attention, query_tile_starts, rope_write_and_attend, write_kv
from nanoforge.kernels.rope import rope_qkv_and_write_kv
from nanoforge.kernels.sampling import sample_tokens
from nanoforge.model.attention import AttentionBackend
from nanoforge.model.sampling import SEED_MOD, sample
from nanoforge.model.transformer import Transformer
from nanoforge.serve import layer_kernel
from nanoforge.serve.input_batch import (
    PARAM_UPDATE_WORDS,
    InputBatch,
    Layout,
    StepInputs,
    StepSamples,
)
from nanoforge.serve.scheduler import SchedulerOutput
from nanoforge.serve.tensor_parallel import TensorParallel

# prefill and mixed steps graphed by default where decode steps are (a GPU): exact on the H200 in every family, and
# as fast or faster than eager steps on every measurement of benchmarks/gpu_engine.py (session 8: (a) 1.02x, (c)
# 1.01x and 1.03x, (d) 0.81 against 0.70: small prefill steps lose the ~25 ms host floor of an eager step)
GRAPH_PREFILL_DEFAULT = True
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
SCORE_ROWS = 512  # prompt positions projected onto the vocabulary at once (bounds the fp32 logits' memory)
UPDATE_RESERVE = 1 << 16  # words of the upload buffer kept for table and parameter updates


_UNSET = object()  # not computed yet (None is a value: decode needs no tile starts)


class PagedAttention(AttentionBackend):
    """The engine's attention backend: one flattened ragged batch, K/V in paged blocks."""

    def __init__(self, k_cache, v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_q_len: int,
                 layer_kernel: layer_kernel.LayerKernel | None = None):
        self.k_cache, self.v_cache = k_cache, v_cache
        self.layer_kernel = layer_kernel  # every layer of a one-token decode step in one launch (None: not here)
        self.slot_mapping, self.block_tables = slot_mapping, block_tables
        self.seq_lens, self.cu_seqlens_q, self.max_q_len = seq_lens, cu_seqlens_q, max_q_len
        self.tile_starts = _UNSET  # the kernel's ragged query tiles: computed at the first layer, shared by all

    def attend(self, layer, q, k, v):
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        write_kv(k[0], v[0], kc, vc, self.slot_mapping)
        return self._attend_cached(q, kc, vc)

    def attend_rotary(self, layer, q, k, v, rope, qk_norm=None):
        if rope is None:
            return super().attend_rotary(layer, q, k, v, rope, qk_norm)
        cos, sin = rope
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        if self.max_q_len == 1:  # decode: with NANOFORGE_ATTN_ROPE=fused, all of it in the attention kernel
            return rope_write_and_attend(q[0], k[0], v[0], cos[0], sin[0], kc, vc, self.slot_mapping,
                                         self.block_tables, self.seq_lens, self.cu_seqlens_q, qk_norm)[None]
        # q/k norms (Qwen3), RoPE and the KV write: one launch on a GPU
        q = rope_qkv_and_write_kv(q[0], k[0], v[0], cos[0], sin[0], kc, vc, self.slot_mapping, qk_norm)
        return self._attend_cached(q[None], kc, vc)

    def run_layers(self, x, rope):
        if self.layer_kernel is None or self.max_q_len != 1 or x.shape[1] != 1 or rope is None:
            return None
        return self.layer_kernel(x, rope, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                                 self.slot_mapping)

    def _attend_cached(self, q, kc, vc):
        if self.tile_starts is _UNSET:
            self.tile_starts = query_tile_starts(q[0], kc, self.cu_seqlens_q, self.max_q_len)
        o = paged_attention(q[0], kc, vc, self.block_tables, self.seq_lens, self.cu_seqlens_q,
                            max_q_len=self.max_q_len, tile_starts=self.tile_starts)
        return o[None]


@dataclass
class Launched:
    """A step handed to the device: what `ModelRunner.collect` needs to read its results back."""

    samples: StepSamples
    num_samples: int
    hidden: torch.Tensor | None  # kept for the prompt logprobs
    tokens: torch.Tensor | None = None  # host copy of the sampled tokens, complete once `event` has passed
    logits: torch.Tensor | None = None  # the logits of the sampled rows from the first to the last that asked
    # for logprobs (a slice, no index tensor to upload: that would wait for the device)
    event: torch.cuda.Event | None = None


def local_kv_heads(model: Transformer) -> int:
    """KV heads of this rank's shard (all of them without tensor parallelism)."""
    return model.layers[0].attn.n_kv_heads


def kv_bytes_per_block(model: Transformer, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.cfg
    return 2 * cfg.n_layers * block_size * local_kv_heads(model) * cfg.head_dim * torch.finfo(dtype).bits // 8


def logprob_entries(logits: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[dict]:
    """Per row of `logits` (rows, vocab): the log-probability of token_ids[i] and the ks[i] most likely
    alternatives, from the fp32 log-softmax, as {"token_id", "logprob", "top": [(id, logprob), ...]}."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])[:, 0].tolist()
    k = max(ks)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [{"token_id": t, "logprob": c, "top": list(zip(ids[:kk], vals[:kk]))}
            for t, c, ids, vals, kk in zip(token_ids, chosen, top_ids, top_vals, ks)]


def prefill_buckets(max_num_tokens: int) -> list[int]:
    """The token counts a prefill or mixed step is padded to when those steps are graphed: powers of two up
    to 1,024, then multiples of 1,024 (at most 1/8 of a step wasted past 8K), then max_num_tokens."""
    small = [t for t in (16, 32, 64, 128, 256, 512, 1024) if t < max_num_tokens]
    return small + list(range(2048, max_num_tokens, 1024)) + [max_num_tokens]


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes that get a CUDA graph: the ladder up to max_num_seqs (and the next rung)."""
    sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_num_seqs] or [1]
    if sizes[-1] < max_num_seqs <= GRAPH_BATCH_SIZES[-1]:
        sizes.append(next(b for b in GRAPH_BATCH_SIZES if b >= max_num_seqs))
    return sizes


class ModelRunner:
    def __init__(self, model: Transformer, *, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 max_num_seqs: int = 256, max_model_len: int, max_num_batched_tokens: int = 8192,
                 use_cuda_graphs: bool = True, graph_prefill: bool | None = None, tp: TensorParallel | None = None,
                 share_tokens: bool = False):
        self.model = model
        self.tp = tp
        # tensor parallelism a step ahead: every rank holds each step's sampled tokens (the first broadcasts them),
        # where the step launched after it reads its pending ones; step by step the packed ids carry them
        self.share_tokens = share_tokens and tp is not None
        self.is_driver = tp is None or tp.is_driver  # the rank that samples and reads tokens back
        self.cfg = model.cfg
        self.device = model.embed.weight.device
        self.dtype = model.embed.weight.dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        # past the blocks handed out, the scratch: padded rows write and read there; at least two slots (InputBatch's
        # scratch and spare slots), so a second block where a block holds one token
        scratch_blocks = math.ceil(2 / block_size)
        shape = (self.cfg.n_layers, num_gpu_blocks + scratch_blocks, block_size, local_kv_heads(model),
                 self.cfg.head_dim)
        self.scratch_block = num_gpu_blocks  # (the first of them: the padding sequences' table entries)
        # one-token decode steps' layers in one launch (NANOFORGE_DECODE_LAYERS=persistent, or auto, a GPU's default,
        # where it times faster): the weights stacked before the cache takes the memory that is left
        self.layer_kernel = (layer_kernel.LayerKernel(model) if layer_kernel.mode(self.device) != "kernels"
                             and tp is None and layer_kernel.supported(model) else None)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        # the KV connector's copies: on a side stream, made at the first use (_copy_stream), or on the compute stream
        self._kv_side = env_choice("NANOFORGE_KV_COPY_STREAM", ("1", "0")) == "1"
        self._kv_stream = None
        cpu_shape = (self.cfg.n_layers, num_cpu_blocks) + shape[2:]
        cuda = self.device.type == "cuda"
        self.k_swap = torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=cuda) if num_cpu_blocks else None
        self.v_swap = torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=cuda) if num_cpu_blocks else None
        sizes = graph_sizes(max_num_seqs) if use_cuda_graphs and cuda else []
        # prefill and mixed steps padded to token buckets, one graph each (None: GRAPH_PREFILL_DEFAULT where decode
        # steps are graphed; on the CPU, if asked for, the same padded steps run eagerly: what the tests check);
        # with tensor parallelism every rank captures the same buckets in the same order, all-reduces inside
        if graph_prefill is None:
            graph_prefill = GRAPH_PREFILL_DEFAULT and bool(sizes)
        buckets = prefill_buckets(max_num_batched_tokens) if graph_prefill else []
        self.batch = InputBatch(max_num_seqs=max_num_seqs, block_size=block_size,
                                max_blocks_per_seq=self.max_blocks_per_seq, scratch_block=self.scratch_block,
                                max_num_tokens=max_num_batched_tokens, graph_sizes=sizes, prefill_buckets=buckets,
                                pin_memory=cuda)
        self._init_device_batch(max_num_seqs)
        self.rope_table = model.rope_table(max_model_len, self.dtype)  # RoPE's cos and sin, indexed by position
        # NANOFORGE_STEP_GATHERS: `kernel` (the default: a step's input gathers in one launch, the sampled rows'
        # temperatures and seeds inside the sampler's) or `torch` (PyTorch's indexing, 11 small kernels: the
        # baseline gpu_engine.py's `torch_gathers` variant times)
        self.one_gather = env_choice("NANOFORGE_STEP_GATHERS", ("kernel", "torch")) == "kernel"
        self.graphs: dict[tuple[bool, int], Callable[[], None]] = {}  # (decode, tokens) -> replay
        self.graph_replays: dict[tuple[bool, int], int] = {}  # how often each ran (stats, tests)
        self._graph_pool = None  # the memory pool every graph shares (they never run at once)
        self.profiler = None  # a StepProfiler (serve/step_profile.py) while `bench throughput --profile` runs
        # the sampled rows' logits of every graph (None: no graphs, or not the driver; a step run for timing
        # alone then makes its own)
        self.g_logits = torch.zeros(self.batch.max_num_seqs, self.cfg.vocab_size, dtype=self.dtype,
                                    device=self.device) if self.is_driver and (sizes or buckets) else None
        # every graph captured up front, the largest first (the pool they share is sized by it): a capture in the
        # middle of serving would stall every running request for it
        started, tuned = time.perf_counter(), gemv.tuning_s()
        for t in reversed(buckets):
            self.graphs[(False, t)] = self._capture(Layout(t, self.batch.max_num_seqs), decode=False)
        for b in reversed(sizes):
            self.graphs[(True, b)] = self._capture(Layout(b, b), decode=True)
        captured = time.perf_counter()
        self.decode_layers = None  # NANOFORGE_DECODE_LAYERS=auto: the batch-1 decode step timed each way
        if self.layer_kernel is not None and layer_kernel.mode(self.device) == "auto":
            self._choose_decode_layers()
        # what the start spent on capturing (less the skinny matmul's tuning, which the first captures' warm-ups
        # do) and on timing the decode layers' ways: the server's first line says
        self.start_s = {"capture": captured - started - (gemv.tuning_s() - tuned),
                        "decode_layers": time.perf_counter() - captured}
        if cuda and not buckets:
            self._warm_up_eager_prefill()
        if cuda and (sizes or buckets):
            torch.cuda.synchronize()
        if self.layer_kernel is not None:
            self.layer_kernel.check(self.device)  # the warm-up ran it: its barriers held

    def _init_device_batch(self, max_num_seqs: int) -> None:
        """The device half of the persistent batch: per slot (plus the scratch slot) a block table and sampling
        parameters; the upload buffer the step's packed inputs land in; the sampled tokens of the last step."""
        dev, slots = self.device, max_num_seqs + 1
        self.table = torch.full((slots, self.max_blocks_per_seq), self.scratch_block, dtype=torch.int32, device=dev)
        self.slot_temperature = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.slot_top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self.slot_top_k = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.slot_seed = torch.zeros(slots, dtype=torch.int64, device=dev)
        b = self.batch
        self.inputs = torch.zeros(Layout(b.max_num_tokens, b.max_num_seqs).size + UPDATE_RESERVE, dtype=torch.int64,
                                  device=dev)
        self.sampled = torch.zeros(b.max_num_seqs, dtype=torch.int64, device=dev)
        # where each launched step's tokens come back to (pinned: the copy is asynchronous); two, as a step is
        # launched before the one before it is collected
        self._host_tokens = [torch.zeros(b.max_num_seqs, dtype=torch.int64, pin_memory=dev.type == "cuda")
                             for _ in range(2)]
        self._turn = 0
        self._pending: dict[int, int] = {}  # seq_id -> row of self.sampled, for the launched step not collected
        self._last: Launched | None = None

    # --- block operations ------------------------------------------------------------------------------

    def _block_ops(self, step: StepInputs) -> None:
        if step.swap_out:
            src, dst = map(list, zip(*step.swap_out))
            self.k_swap[:, dst] = self.k_cache[:, src].cpu()
            self.v_swap[:, dst] = self.v_cache[:, src].cpu()
        if step.swap_in:
            src, dst = map(list, zip(*step.swap_in))
            self.k_cache[:, dst] = self.k_swap[:, src].to(self.device, non_blocking=True)
            self.v_cache[:, dst] = self.v_swap[:, src].to(self.device, non_blocking=True)
        if step.copies:
            src, dst = map(list, zip(*step.copies))
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    # Whole blocks between the cache and the KV connector's staging buffer: out[i] / kv[i] = (K, V) of every layer
    # of blocks[i], shape (len(blocks), 2, n_layers, block_size, n_kv_heads, head_dim). Each slot's KV is contiguous
    # in the staging buffer but the slots are not (a header sits between them), and copy_ between a device tensor
    # and a strided host view goes through a pageable temporary, synchronously (~30-60 ms for a long prompt on the
    # H200's host, on the engine thread): so the blocks are gathered on the device and moved a slot at a time,
    # asynchronously from page-locked memory. On a GPU both return an event recorded after the copies: the staging
    # slots are ready (read) or free again (write) once it has happened. On the CPU the copies are done on return.
    #
    # The host copies run on a stream of their own (`_copy_stream`), so the steps' kernels never queue behind
    # them: a long prompt's save moves ~200 MB over PCIe, on the compute stream ahead of the prefill instance's
    # next step. Only the device-side gather (before a save's copy) and scatter (after a load's) are on the
    # compute stream, in its order. NANOFORGE_KV_COPY_STREAM=0 puts the copies back on the compute stream: in
    # the README's A/B on the H200 (1P+1D) the two differed by no more than repeats of either do.

    def read_blocks(self, blocks: list[int], out: torch.Tensor) -> torch.cuda.Event | None:
        idx = torch.tensor(blocks, device=self.device)
        kv = torch.empty(out.shape, dtype=out.dtype, device=self.device)
        kv[:, 0] = self.k_cache[:, idx].transpose(0, 1)
        kv[:, 1] = self.v_cache[:, idx].transpose(0, 1)
        if self.device.type != "cuda":
            out.copy_(kv)
            return None
        side = self._copy_stream()
        side.wait_stream(torch.cuda.current_stream(self.device))  # after the gather
        with torch.cuda.stream(side):
            event = self._copy_slots(out, kv)
        kv.record_stream(side)  # the compute stream's allocator must not hand it out before the copies have read it
        return event

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> torch.cuda.Event | None:
        idx = torch.tensor(blocks, device=self.device)
        copied = None
        if kv.device == self.device:  # the CPU: the staging buffer is the cache's memory already
            staged = kv
        else:
            with torch.cuda.stream(self._copy_stream()):  # allocated on the copy stream: it waits for nothing
                staged = torch.empty(kv.shape, dtype=kv.dtype, device=self.device)
                copied = self._copy_slots(staged, kv)
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)  # the scatter after the copies
            staged.record_stream(compute)
        self.k_cache[:, idx] = staged[:, 0].transpose(0, 1)
        self.v_cache[:, idx] = staged[:, 1].transpose(0, 1)
        return copied

    def _copy_stream(self) -> torch.cuda.Stream:
        """The stream of the KV connector's host copies: a side stream, or the compute stream where
        NANOFORGE_KV_COPY_STREAM=0."""
        if self._kv_stream is None:
            current = torch.cuda.current_stream(self.device)
            self._kv_stream = torch.cuda.Stream(self.device) if self._kv_side else current
        return self._kv_stream

    @staticmethod
    def _copy_slots(dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """Slot by slot, asynchronously, on the current stream; an event recorded after the last."""
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return event

    # --- uploading a step ------------------------------------------------------------------------------------

    def _upload(self, step: StepInputs, views: bool = True) -> dict | None:
        """Copy the packed inputs to the device in one go, apply the table and parameter updates; return the
        device views of the step's fields (None where not `views`: a replayed graph reads its own)."""
        n = step.packed.numel()
        dst = self.inputs if n <= self.inputs.numel() else torch.empty(n, dtype=torch.int64, device=self.device)
        dst[:n].copy_(step.packed, non_blocking=True)
        a = step.layout.size
        if step.num_table_updates:
            u = dst[a:a + 2 * step.num_table_updates].view(-1, 2)
            self.table.view(-1)[u[:, 0]] = u[:, 1].to(torch.int32)
            a += 2 * step.num_table_updates
        if step.num_param_updates:
            u = dst[a:a + PARAM_UPDATE_WORDS * step.num_param_updates].view(-1, PARAM_UPDATE_WORDS)
            slots, floats = u[:, 0], u[:, 3:].contiguous().view(torch.float64)
            self.slot_top_k[slots] = u[:, 1]
            self.slot_seed[slots] = u[:, 2]
            self.slot_temperature[slots] = floats[:, 0].float()
            self.slot_top_p[slots] = floats[:, 1].float()
        return step.layout.views(dst) if views else None

    # --- the forward pass ---------------------------------------------------------------------------------

    def _forward(self, v: dict, n: int, s: int, max_q_len: int, width: int,
                 kernel: layer_kernel.LayerKernel | None) -> torch.Tensor:
        """Hidden states of the step's n tokens of s sequences (width: block-table columns to read; kernel: the
        persistent kernel a one-token decode step runs its layers in, or None). The step's gathers run in one
        kernel (`gather_step_inputs`): its tokens (rows whose token the step in flight sampled, token_src >= 0,
        take it from the device), their embeddings and RoPE rows, its rows' block tables."""
        m, positions = self.model, v["positions"][:n]
        gather = gather_step_inputs if self.one_gather else gather_step_inputs_ref
        tokens, x, cs, tables = gather(
            v["token_src"][:n], self.sampled, v["ids"][:n], positions, m.embed.weight,
            m.pos_embed.weight if m.pos_embed is not None else None, self.rope_table, v["row_slot"][:s], self.table,
            width)
        attn = PagedAttention(self.k_cache, self.v_cache, v["slots"][:n], tables, v["seq_lens"][:s],
                              v["cu_seqlens"][:s + 1], max_q_len=max_q_len, layer_kernel=kernel)
        rope = (cs[None, :, 0:1], cs[None, :, 1:2]) if cs is not None else None  # (1, n, 1, D) views: cos, sin
        return m(tokens[None], positions[None], attn, return_hidden=True, rope=rope, inputs_embeds=x[None])[0]

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> Launched:
        """Start one step on the device and return without waiting for it. Chunks that end in a token the
        step before samples (one not yet collected: asynchronous scheduling) read it from the device."""
        step, samples = self.batch.prepare(out, self._pending)
        if self.tp is not None:
            self.tp.send(step)
        prof = self.profiler
        if prof is not None:
            prof.device_begin(out, step.num_samples)
        hidden, logits = self.run(step)
        if prof is not None:
            prof.device_end()
        n = step.num_samples
        done = Launched(samples, n, hidden if samples.scored else None)
        if n:
            self._turn ^= 1
            done.tokens = self._host_tokens[self._turn][:n]
            done.tokens.copy_(self.sampled[:n], non_blocking=True)  # before the next step samples over them
            if samples.logprob_rows:  # a copy of the rows' span: a graph's logits buffer is the next step's too
                done.logits = logits[samples.logprob_rows[0]:samples.logprob_rows[-1] + 1].clone()
            if self.device.type == "cuda":
                done.event = torch.cuda.Event()
                done.event.record()
        self._pending = {t.seq_id: row for row, t in enumerate(t for item in out.scheduled for t in item.targets)}
        self._last = done
        return done

    @torch.inference_mode()
    def collect(self, done: Launched) -> tuple[dict[int, list[int]], dict[int, list], dict[int, list]]:
        """Wait for a launched step (the step's one sync); return its sampled tokens, their logprobs (where
        asked) and the prompt logprobs of the chunks' `scored_positions`, each keyed by seq_id."""
        if done is self._last:
            self._pending = {}
        prompt_logprobs = self._score_prompts(done.samples, done.hidden) if done.samples.scored else {}
        if not done.num_samples:  # only prompt chunks that sample nothing (max_tokens=0, or not their last chunk)
            return {}, {}, prompt_logprobs
        t0 = time.perf_counter()
        if done.event is not None:
            done.event.synchronize()
        tokens = done.tokens.tolist()
        if self.profiler is not None:
            self.profiler.waited(time.perf_counter() - t0)
        return *self._outputs(done.samples, tokens, done.logits), prompt_logprobs

    @torch.inference_mode()
    def run(self, step: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The device's part of a step: upload, block operations, the forward pass and, on the first rank,
        sampling into `self.sampled[:step.num_samples]`. Returns the hidden states of the step's tokens (None
        for a replayed graph: decodes score no prompt token) and the logits of the sampled rows (first rank)."""
        key = (step.graph == "decode", step.layout.t)
        # a graph reads its inputs from self.inputs: a step whose table updates overflow it (a fresh upload
        # buffer) runs its padded inputs eagerly instead
        graphed = step.graph is not None and step.packed.numel() <= self.inputs.numel()
        # (the views cost ~10-20 us of host time a step: a replay reads none, the top-k / top-p draw does)
        v = self._upload(step, views=not graphed or (step.needs_filter and self.is_driver))
        self._block_ops(step)
        if not step.num_tokens:
            return None, None
        n = step.num_samples
        if graphed:
            self.graphs[key]()
            self.graph_replays[key] = self.graph_replays.get(key, 0) + 1
            hidden, logits = None, self.g_logits[:n] if self.is_driver else None
        else:
            hidden = self._forward(v, step.num_tokens, step.num_seqs, step.max_q_len, step.table_width,
                                   self.layer_kernel)
            logits = self._sample(v, hidden[v["sample_row"][:n]], n) if n and self.is_driver else None
        if step.needs_filter and self.is_driver:
            self._sample_filtered(v, logits, n)
        if self.share_tokens and n:
            self.tp.broadcast_tokens(self.sampled[:n])
        return hidden, logits

    # --- sampling ---------------------------------------------------------------------------------------

    def _seeds(self, v: dict, n: int) -> torch.Tensor:
        """Each sampled row's seed: its slot's, plus its completion offset (a fork's n rows), modulo 2**63."""
        return (self.slot_seed[v["sample_slot"][:n]] + v["seed_offset"][:n]) & (SEED_MOD - 1)

    def _sample(self, v: dict, hidden: torch.Tensor, n: int, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the n sampled rows (in the model's dtype; into `logits_out` if given) and their tokens,
        greedy or drawn with temperature, into self.sampled[:n]. Top-k / top-p is `_sample_filtered`'s."""
        logits = self.model.logits(hidden, out=logits_out)
        if self.one_gather:  # the rows' temperatures and seeds gathered in the sampler's kernel
            sample_tokens(logits, self.slot_temperature, self.slot_seed, v["draw"][:n], out=self.sampled[:n],
                          slots=v["sample_slot"][:n], seed_offsets=v["seed_offset"][:n])
        else:
            sample_tokens(logits, self.slot_temperature[v["sample_slot"][:n]], self._seeds(v, n), v["draw"][:n],
                          out=self.sampled[:n])
        return logits

    def _sample_filtered(self, v: dict, logits: torch.Tensor, n: int) -> None:
        """Draw the step's rows again with their top-k and top-p (the same noise: the same draw)."""
        slots = v["sample_slot"][:n]
        self.sampled[:n] = sample(logits, self.slot_temperature[slots], self.slot_top_k[slots],
                                  self.slot_top_p[slots], self._seeds(v, n), v["draw"][:n])

    def _outputs(self, samples: StepSamples, tokens: list[int], logits: torch.Tensor | None):
        """The sampled tokens, and logprob entries where asked, keyed by seq_id (a fork's n tokens in order)."""
        sampled: dict[int, list[int]] = {}
        logprobs: dict[int, list] = {}
        for (seq, _), tok in zip(samples.seqs, tokens):
            sampled.setdefault(seq.seq_id, []).append(tok)
        if samples.logprob_rows:
            rows = samples.logprob_rows
            entries = logprob_entries(logits[[i - rows[0] for i in rows]], [tokens[i] for i in rows],
                                      [samples.seqs[i][0].sampling_params.logprobs for i in rows])
            for i, entry in zip(rows, entries):
                logprobs.setdefault(samples.seqs[i][0].seq_id, []).append(entry)
        return sampled, logprobs

    def _score_prompts(self, samples: StepSamples, hidden: torch.Tensor) -> dict[int, list]:
        """Prompt logprobs: the logits at each score row give the logprob of the prompt token after it."""
        ks = [item.seq.sampling_params.prompt_logprobs for item, n in samples.scored for _ in range(n)]
        entries = []
        for i in range(0, len(samples.score_rows), SCORE_ROWS):
            rows = torch.tensor(samples.score_rows[i:i + SCORE_ROWS], device=hidden.device)
            entries += logprob_entries(self.model.lm_head(hidden[rows]), samples.score_targets[i:i + SCORE_ROWS],
                                       ks[i:i + SCORE_ROWS])
        result, start = {}, 0
        for item, n in samples.scored:
            result[item.seq.seq_id] = entries[start:start + n]
            start += n
        return result

    @torch.no_grad()  # as the captures: an eager run with grad enabled would skip the kernel (the CPU's timing)
    def _choose_decode_layers(self) -> None:
        """NANOFORGE_DECODE_LAYERS=auto: the batch-1 decode step captured each way (`layer_kernel.WAYS`: the
        persistent kernel; where NANOFORGE_DECODE_RING is unset, the kernel again with its weights through a
        shared-memory ring, on every projection and on gate-and-up alone; the layers one by one), their replays
        timed in turns on the idle step (`replays_us`: the weights stream from HBM as in any step; the context is
        short), and the fastest kept: the persistent kernel saves launches but syncs its programs at every phase,
        which wins on some models and GPUs and loses on others (session 27, an H100: Qwen3-0.6B's batch-1 decode
        1.12x; session 26, an H200: Llama-3.2-1B's 0.90x), and the ring wins where the kernel keeps its
        registers (session 40, an H100: Llama-3.2-1B's layers 1.04x, Qwen3-0.6B's 0.90x, whose kernel spills with
        a ring on every projection and not with one on gate-and-up alone). Without a batch-1 graph the ways are
        timed the same way and only the choice is kept (on the CPU: eager steps). `self.decode_layers` records
        each way's time and the choice."""
        kernel, graphed = self.layer_kernel, (True, 1) in self.graphs
        # each way's replay and the kernel's ring (a graph holds the ring it was captured with; the CPU's eager
        # "replays" read it at each call, so it is set before each)
        ways = {"persistent": (self.graphs[(True, 1)] if graphed else self._capture(Layout(1, 1), decode=True),
                               None)}
        rings = {way: ring for way, (_, ring) in layer_kernel.WAYS.items() if ring} if ring_stages() == 0 else {}
        for way, ring in rings.items():  # (the ways with a ring, where NANOFORGE_DECODE_RING is unset)
            kernel.ring = ring
            ways[way] = (self._capture(Layout(1, 1), decode=True), ring)
        kernel.ring, self.layer_kernel = None, None
        ways["kernels"] = (self._capture(Layout(1, 1), decode=True), None)

        def run(replay, ring):
            kernel.ring = ring
            replay()

        cuda = self.device.type == "cuda"
        us = replays_us({way: functools.partial(run, *w) for way, w in ways.items()}, rounds=10 if cuda else 1,
                        cuda=cuda)
        chosen = min(us, key=us.get)
        replay, kernel.ring = ways[chosen]
        if chosen != "kernels":
            self.layer_kernel = kernel
        if graphed:
            self.graphs[(True, 1)] = replay
        self.decode_layers = {"chosen": chosen, **{f"{way}_us": t for way, t in us.items()},
                              "tagged": bool(kernel.layers.tagged)}  # (its buffers: the kernel ran tagged)

    @torch.no_grad()
    def _warm_up_eager_prefill(self) -> None:
        """Run an idle eager step of 16 tokens and one of a full step before the first request: they compile the
        attention kernel's prefill variants (split context or not, by the launch's shape), which would otherwise
        compile at a first use in the middle of serving (~0.7 s on the H200, every running request stalled)."""
        for t in sorted({min(16, self.batch.max_num_tokens), self.batch.max_num_tokens}):
            self._forward(self._idle_inputs(Layout(t, 1)), t, 1, t, self.max_blocks_per_seq, None)

    def _idle_inputs(self, layout: Layout) -> dict:
        """The upload buffer filled with `layout`'s idle inputs (every row padding, reading and writing only the
        scratch block); its views."""
        self.inputs[:layout.size].copy_(torch.from_numpy(self.batch.idle(layout)))
        return layout.views(self.inputs)

    # --- CUDA graphs -------------------------------------------------------------------------------------

    @torch.no_grad()  # the weights may require grad (a model fresh from training); the graph's outputs never do
    def _capture(self, layout: Layout, *, decode: bool) -> Callable[[], None]:
        """One graph for the steps of `layout`: input ids, the rows' block tables, the model, the logits of the
        sampled rows (into a buffer all graphs share) and the sampled tokens (temperature and seeds included):
        decode graphs (layout t = s = batch) and prefill buckets' (t tokens, every sequence slot), all at start.
        On the CPU the "graph" is the padded step run eagerly (after the same warm-up on idle inputs). Returns
        its replay (the layers run as `self.layer_kernel` says now)."""
        t, s = layout.t, layout.s
        v = self._idle_inputs(layout)
        max_q_len = 1 if decode else t
        kernel = self.layer_kernel

        def run():
            hidden = self._forward(v, t, s, max_q_len, self.max_blocks_per_seq, kernel)
            if self.is_driver:
                out = self.g_logits[:s] if self.g_logits is not None else None
                self._sample(v, hidden if decode else hidden[v["sample_row"]], s, logits_out=out)

        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        side = torch.cuda.Stream() if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (None: a no-op on the CPU)
            run()  # warm up on the idle inputs (on the CPU too: what the tests check): compile, autotune
        if not cuda:
            return run
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        # thread_local: another engine's KV connector worker in this process may wait on a CUDA event meanwhile
        with torch.cuda.graph(g, pool=self._graph_pool, capture_error_mode="thread_local"):
            run()
        self._graph_pool = g.pool()
        return g.replay
