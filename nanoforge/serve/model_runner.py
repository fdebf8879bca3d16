"""ModelRunner: runs one scheduler step on the model over the paged KV cache.

For each step it
1. executes the block operations the scheduler asked for (swap out to the
   CPU pool, swap in, copy-on-write copies), in that order;
2. flattens every scheduled chunk into one ragged batch of tokens (no
   padding between sequences), with positions, the cache slot of every token,
   and per-sequence block tables, context lengths and query offsets;
3. runs the model once, with `PagedAttention` as its attention backend: each
   layer writes the new tokens' K/V into their slots and attends through the
   block tables (`nanoforge.kernels.paged_attention`: Triton on a GPU, the
   PyTorch reference on the CPU);
4. computes logits only at the positions that sample, and samples each with
   its own request's settings (`nanoforge.model.sampling`);
5. where a request asked for them, turns logits into logprobs (fp32
   log-softmax, top k; one routine, `logprob_entries`): of each sampled token,
   and of each prompt token at the chunk's `scored_positions` (prompt logprobs,
   projected onto the vocabulary a slice of rows at a time).

On a GPU, steps that are pure decode run as replays of CUDA graphs captured
for a ladder of batch sizes (padded up to the next one), so the ~10 small
kernels per layer cost one launch. Padded rows write to a scratch block that
the block manager never hands out.

The KV cache is one tensor per K and V of shape
(n_layers, num_blocks, block_size, n_kv_heads, head_dim), sized from a memory
budget; a block id indexes the same block in every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanoforge.kernels.paged_attention import paged_attention, write_kv
from nanoforge.model.attention import AttentionBackend
from nanoforge.model.sampling import make_generator, sample
from nanoforge.model.transformer import Transformer
from nanoforge.serve.scheduler import SchedulerOutput

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
SCORE_ROWS = 512  # prompt positions projected onto the vocabulary at once (bounds the fp32 logits' memory)


class PagedAttention(AttentionBackend):
    """The engine's attention backend: one flattened ragged batch, K/V in paged blocks."""

    def __init__(self, k_cache, v_cache, slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_q_len: int):
        self.k_cache, self.v_cache = k_cache, v_cache
        self.slot_mapping, self.block_tables = slot_mapping, block_tables
        self.seq_lens, self.cu_seqlens_q, self.max_q_len = seq_lens, cu_seqlens_q, max_q_len

    def attend(self, layer, q, k, v):
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        write_kv(k[0], v[0], kc, vc, self.slot_mapping)
        o = paged_attention(q[0], kc, vc, self.block_tables, self.seq_lens, self.cu_seqlens_q,
                            max_q_len=self.max_q_len)
        return o[None]


def kv_bytes_per_block(model: Transformer, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.cfg
    return 2 * cfg.n_layers * block_size * cfg.n_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


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


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: PagedAttention
    sample_rows: torch.Tensor  # index into the flattened tokens of each position that samples
    score_rows: list[int]  # index into the flattened tokens of each position that scores a prompt token
    score_targets: list[int]  # the prompt token each of those scores (the one after it)
    scored: list  # (ScheduledSeq, number of score rows) of the chunks that score prompt tokens, in row order


class ModelRunner:
    def __init__(self, model: Transformer, *, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 max_num_seqs: int = 256, max_model_len: int, use_cuda_graphs: bool = True):
        self.model = model
        self.cfg = model.cfg
        self.device = model.embed.weight.device
        self.dtype = model.embed.weight.dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        shape = (self.cfg.n_layers, num_gpu_blocks + 1, block_size, self.cfg.n_kv_heads, self.cfg.head_dim)
        self.scratch_block = num_gpu_blocks  # padded graph rows write here; never handed out
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        cpu_shape = (self.cfg.n_layers, num_cpu_blocks) + shape[2:]
        pin = self.device.type == "cuda"
        self.k_swap = torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin) if num_cpu_blocks else None
        self.v_swap = torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin) if num_cpu_blocks else None
        self.generators: dict[tuple[str, int], torch.Generator | None] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_cuda_graphs and self.device.type == "cuda":
            self._capture_graphs(max_num_seqs)

    # --- block operations ------------------------------------------------------------------

    def _block_ops(self, out: SchedulerOutput) -> None:
        if out.blocks_to_swap_out:
            src, dst = map(list, zip(*out.blocks_to_swap_out.items()))
            self.k_swap[:, dst] = self.k_cache[:, src].cpu()
            self.v_swap[:, dst] = self.v_cache[:, src].cpu()
        if out.blocks_to_swap_in:
            src, dst = map(list, zip(*out.blocks_to_swap_in.items()))
            self.k_cache[:, dst] = self.k_swap[:, src].to(self.device, non_blocking=True)
            self.v_cache[:, dst] = self.v_swap[:, src].to(self.device, non_blocking=True)
        if out.blocks_to_copy:
            src, dst = map(list, zip(*out.blocks_to_copy))
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    def read_blocks(self, blocks: list[int], out: torch.Tensor) -> None:
        """Copy whole blocks out of the cache: out[i] = (K, V) of every layer of blocks[i], shape
        (len(blocks), 2, n_layers, block_size, n_kv_heads, head_dim) (the KV connector's staging buffer)."""
        idx = torch.tensor(blocks, device=self.device)
        out.copy_(torch.stack((self.k_cache[:, idx], self.v_cache[:, idx])).permute(2, 0, 1, 3, 4, 5))

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Fill whole blocks of the cache from `kv`, laid out as `read_blocks` writes it. The copy is done when
        this returns (`kv` may be reused at once)."""
        idx = torch.tensor(blocks, device=self.device)
        kv = kv.to(self.device)
        self.k_cache[:, idx] = kv[:, 0].transpose(0, 1)
        self.v_cache[:, idx] = kv[:, 1].transpose(0, 1)

    # --- batch building --------------------------------------------------------------------------

    def _build(self, out: SchedulerOutput) -> _Batch:
        ids, pos, slots, seq_lens, cu, rows, tables = [], [], [], [], [0], [], []
        score_rows, score_targets, scored = [], [], []
        bs = self.block_size
        for item in out.scheduled:
            if item.scored_positions:
                positions = item.scored_positions
                score_rows += [cu[-1] + p - item.start for p in positions]
                score_targets += item.seq.token_ids[positions.start + 1:positions.stop + 1]
                scored.append((item, len(positions)))
            ids += item.token_ids
            pos += range(item.start, item.end)
            slots += item.slot_mapping(bs)
            seq_lens.append(item.end)
            cu.append(cu[-1] + item.num_tokens)
            if item.num_samples:
                rows.append(cu[-1] - 1)
            tables.append(item.block_table)
        width = max(len(t) for t in tables)
        tables = [t + [self.scratch_block] * (width - len(t)) for t in tables]
        dev = self.device

        def t(x, dtype=torch.int32):
            return torch.tensor(x, dtype=dtype, device=dev)

        attn = PagedAttention(self.k_cache, self.v_cache, t(slots, torch.int64), t(tables), t(seq_lens), t(cu),
                              max_q_len=max(item.num_tokens for item in out.scheduled))
        return _Batch(t([ids], torch.int64), t([pos], torch.int64), attn, t(rows, torch.int64), score_rows,
                      score_targets, scored)

    # --- forward ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[dict[int, list[int]], dict[int, list], dict[int, list]]:
        """Run one step; returns the sampled tokens, their logprobs (where asked) and the prompt logprobs of
        the chunks' `scored_positions`, each keyed by seq_id."""
        self._block_ops(out)
        if not out.scheduled:
            return {}, {}, {}
        decode_only = all(item.is_decode for item in out.scheduled)  # decodes score no prompt token
        prompt_logprobs = {}
        if decode_only and self.graphs and len(out.scheduled) <= max(self.graphs):
            hidden = self._replay(out)
        else:
            batch = self._build(out)
            hidden = self.model(batch.input_ids, batch.positions, batch.attn, return_hidden=True)[0]
            if batch.scored:
                prompt_logprobs = self._score_prompts(batch, hidden)
            hidden = hidden[batch.sample_rows]
        if not len(hidden):  # only prompt chunks that sample nothing (max_tokens=0, or not their last chunk)
            return {}, {}, prompt_logprobs
        logits = self.model.lm_head(hidden).float()
        return *self._sample(out, logits), prompt_logprobs

    def _score_prompts(self, batch: _Batch, hidden: torch.Tensor) -> dict[int, list]:
        """Prompt logprobs: the logits at each score row give the logprob of the prompt token after it."""
        ks = [item.seq.sampling_params.prompt_logprobs for item, n in batch.scored for _ in range(n)]
        entries = []
        for i in range(0, len(batch.score_rows), SCORE_ROWS):
            rows = torch.tensor(batch.score_rows[i:i + SCORE_ROWS], device=hidden.device)
            entries += logprob_entries(self.model.lm_head(hidden[rows]), batch.score_targets[i:i + SCORE_ROWS],
                                       ks[i:i + SCORE_ROWS])
        result, start = {}, 0
        for item, n in batch.scored:
            result[item.seq.seq_id] = entries[start:start + n]
            start += n
        return result

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor):
        # one row per token to draw: a chunk with num_samples = n contributes n rows (parallel sampling)
        row_of, temps, top_ks, top_ps, gens, keys = [], [], [], [], [], []
        r = 0
        for item in out.scheduled:
            if not item.num_samples:
                continue
            p = item.seq.sampling_params
            for j in range(item.num_samples):
                index = item.seq.index + j  # forked children take the next indices
                key = (item.seq.request_id, index)
                if key not in self.generators:
                    g = self.generators[key] = make_generator(None if p.seed is None else p.seed + index, self.device)
                    # a resumed sequence (its first tokens drawn by another engine) continues the same draws
                    for _ in range(item.seq.num_output_tokens if g is not None else 0):
                        torch.empty(logits.shape[-1], device=self.device).exponential_(generator=g)
                row_of.append(r)
                temps.append(p.temperature)
                top_ks.append(max(p.top_k, 0))
                top_ps.append(p.top_p)
                gens.append(self.generators[key])
                keys.append(item)
            r += 1
        dev = self.device
        rows = logits[torch.tensor(row_of, device=dev)] if len(row_of) != logits.shape[0] else logits
        top_k = torch.tensor(top_ks, device=dev) if any(top_ks) else None
        top_p = torch.tensor(top_ps, device=dev) if any(x < 1.0 for x in top_ps) else None
        tokens = sample(rows, torch.tensor(temps, device=dev), top_k, top_p, gens).tolist()

        sampled: dict[int, list[int]] = {}
        logprobs: dict[int, list] = {}
        for item, tok in zip(keys, tokens):
            sampled.setdefault(item.seq.seq_id, []).append(tok)
        want_lp = [i for i, item in enumerate(keys) if item.seq.sampling_params.logprobs is not None]
        if want_lp:
            entries = logprob_entries(rows[want_lp], [tokens[i] for i in want_lp],
                                      [keys[i].seq.sampling_params.logprobs for i in want_lp])
            for i, entry in zip(want_lp, entries):
                logprobs.setdefault(keys[i].seq.seq_id, []).append(entry)
        return sampled, logprobs

    def release(self, request_id: str, n: int) -> None:
        """Forget a finished request's generators."""
        for i in range(n):
            self.generators.pop((request_id, i), None)

    # --- CUDA graphs for decode -------------------------------------------------------------------

    def _capture_graphs(self, max_num_seqs: int) -> None:
        sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_num_seqs] or [1]
        if sizes[-1] < max_num_seqs and max_num_seqs <= GRAPH_BATCH_SIZES[-1]:
            sizes.append(next(b for b in GRAPH_BATCH_SIZES if b >= max_num_seqs))
        n = sizes[-1]
        dev = self.device
        self.g_ids = torch.zeros(1, n, dtype=torch.int64, device=dev)
        self.g_pos = torch.zeros(1, n, dtype=torch.int64, device=dev)
        self.g_slots = torch.full((n,), self.scratch_block * self.block_size, dtype=torch.int64, device=dev)
        self.g_tables = torch.full((n, self.max_blocks_per_seq), self.scratch_block, dtype=torch.int32, device=dev)
        self.g_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.g_cu = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.g_hidden = torch.zeros(n, self.cfg.d_model, dtype=self.dtype, device=dev)
        pool = None
        for b in reversed(sizes):
            attn = PagedAttention(self.k_cache, self.v_cache, self.g_slots[:b], self.g_tables[:b], self.g_lens[:b],
                                  self.g_cu[:b + 1], max_q_len=1)

            def run():
                h = self.model(self.g_ids[:, :b], self.g_pos[:, :b], attn, return_hidden=True)
                self.g_hidden[:b] = h[0]

            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                run()  # warm up: autotuning and compilation happen outside the capture
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                run()
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()

    def _replay(self, out: SchedulerOutput) -> torch.Tensor:
        b = len(out.scheduled)
        size = next(s for s in sorted(self.graphs) if s >= b)
        bs = self.block_size
        ids, pos, slots, lens = [], [], [], []
        tables = torch.full((size, self.max_blocks_per_seq), self.scratch_block, dtype=torch.int32)
        for i, item in enumerate(out.scheduled):
            p = item.start
            ids.append(item.seq.token_ids[p])
            pos.append(p)
            table = item.block_table
            slots.append(table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        pad = size - b
        scratch = self.scratch_block * bs
        self.g_ids[0, :size].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.g_pos[0, :size].copy_(torch.tensor(pos + [0] * pad), non_blocking=True)
        self.g_slots[:size].copy_(torch.tensor(slots + [scratch] * pad), non_blocking=True)
        self.g_lens[:size].copy_(torch.tensor(lens + [1] * pad, dtype=torch.int32), non_blocking=True)
        self.g_tables[:size].copy_(tables, non_blocking=True)
        self.graphs[size].replay()
        return self.g_hidden[:b]
