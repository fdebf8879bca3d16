"""`nanoforge plan`: which 4D layouts of a model fit on N GPUs, with memory per GPU and an estimated step time.

The model of a step is what `nanoforge.train.parallel` runs, counted in bytes and FLOPs:

Memory per GPU (the worst pipeline stage: the first, with the embedding, or the last, with the head):
    weights, gradients, AdamW   fp32 master weights (4 B), fp32 gradients (4 B) and two fp32 moments (8 B) per
                                parameter, sharded by FSDP over dp x cp and by TP over tp: 16 P / (tp dp cp)
    gathered weights            bf16 copies that FSDP all-gathers: two blocks at a time (the one running and
                                the one prefetched) plus the root unit (embedding, head); with pipelining a
                                stage keeps all its blocks gathered from forward to backward (2 P_stage / tp)
    activations                 what autograd keeps per block and micro-batch, with sequence parallelism:
                                the residual stream and norms' inputs shard over tp, the matmul inputs that
                                TP all-gathers do not; q, k, v, the attention output (+ LSE) and the MLP's
                                gate, up, silu and product shard over tp; context parallelism holds 1/cp of
                                the tokens plus the gathered K and V of the whole sequence. Held for the
                                micro-batches in flight: 1 without pipelining, pp (1F1B), m (GPipe), or
                                pp (1 + (pp - 1) / (pp v)) interleaved. With recomputation (activation
                                checkpointing per block: the trainer's --ac full) only each block's input
                                stays, plus one block's activations while it is recomputed.
    logits                      the last stage's micro-batch of logits. Compiled (the GPU default) the
                                head and the loss are one graph: the bf16 logits kept for the backward
                                and their bf16 gradient, 4 B per token and vocabulary entry / tp; eager
                                (--no-compile), also their fp32 copy and its log-softmax: 10 B
    overhead                    CUDA context, NCCL buffers, allocator slack: --overhead-gib

Step time, per GPU:
    compute        the model's training FLOPs (6 N + 12 L H Q T per token, PaLM) for its tokens, at
                   --efficiency of the peak (the share of peak that the matmuls and attention reach; 4/3 of it
                   with recomputation, which runs each forward twice)
    tp             2 all-gathers + 2 reduce-scatters of the activations per block, forward and backward (and
                   the recomputed forward), over NVLink: not overlapped
    cp             the all-gather of K and V per block (and the reduce-scatter of their gradients), over NVLink
                   while tp x cp fits in a node, else the network: not overlapped
    pp             the activations sent between stages: not overlapped
    dp             FSDP's all-gathers of bf16 weights and reduce-scatters of fp32 gradients over dp x cp ranks,
                   over the network: overlapped with compute, only what exceeds it counts
    bubble         a pipeline's idle share, (pp - 1) / (v m + pp - 1), stretches the rest
so step = (compute + tp + cp + pp) / (1 - bubble) + max(0, dp - compute). Estimates, not measurements: the
H200 check (benchmarks/gpu_parallel.py) compares them with what one GPU measures.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from nanoforge.errors import NanoforgeError
from nanoforge.model.config import ModelConfig

GiB = 2**30


@dataclass
class Hardware:
    gpus: int
    hbm_gib: float = 80.0
    peak_tflops: float = 989.0  # dense bf16 per GPU (H100 / H200)
    efficiency: float = 0.5  # share of peak the step's kernels reach (one H200 measured 50% on Llama-3.2-1B)
    gpus_per_node: int = 8
    nvlink_gbs: float = 360.0  # achieved bus bandwidth of a collective inside a node (NVLink 4), GB/s per GPU
    network_gbs: float = 40.0  # achieved per-GPU bandwidth across nodes (400 Gb/s RoCE / InfiniBand), GB/s
    overhead_gib: float = 4.0
    compiled: bool = True  # the step runs under torch.compile (the trainer's default on a GPU)


@dataclass
class Workload:
    seq_len: int
    batch_tokens: int  # per optimizer step, all GPUs together
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank


@dataclass
class Layout:
    tp: int
    cp: int
    pp: int
    dp: int
    stages_per_rank: int = 1
    schedule: str = "fsdp"  # no pipeline; else gpipe, 1f1b, interleaved-1f1b

    @property
    def name(self) -> str:
        text = f"tp {self.tp} x cp {self.cp} x pp {self.pp} x dp {self.dp}"
        if self.pp > 1:
            text += f" {self.schedule}" + (f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else "")
        return text


def layer_params(m: ModelConfig) -> int:
    attn = m.d_model * (m.q_dim + 2 * m.kv_dim) + m.q_dim * m.d_model
    mlp = (2 if m.is_gpt2 else 3) * m.d_model * m.d_ff
    norms = 2 * m.d_model + (2 * m.head_dim if m.qk_norm else 0)
    return attn + mlp + norms


def rank_layers(m: ModelConfig, lay: Layout) -> int:
    """Blocks on the busiest pipeline rank (nanoforge cuts equal stages; Llama 3's uneven ones round up)."""
    return -(-m.n_layers // lay.pp)


def stage_params(m: ModelConfig, lay: Layout) -> int:
    """Parameters of the pipeline rank that holds the most: its blocks plus the embedding (first) or the
    final norm and head (last); without pipelining, the whole model."""
    blocks = rank_layers(m, lay) * layer_params(m)
    embed = m.vocab_size * m.d_model
    if lay.pp == 1:
        return blocks + embed * (1 if m.tie_embeddings else 2) + m.d_model
    return blocks + embed + m.d_model


def activation_bytes(m: ModelConfig, lay: Layout, w: Workload) -> tuple[float, float]:
    """(bytes per block per micro-batch without recomputation, with it: the block's input only), bf16."""
    t, c = lay.tp, lay.cp
    tokens = w.micro_batch * w.seq_len / c  # this rank's tokens of the micro-batch
    d, q, kv, ff = m.d_model, m.q_dim, m.kv_dim, m.d_ff
    per_token = (2 * 2 * d / t  # the residual stream into each norm, sequence-sharded
                 + 2 * 2 * d  # each norm's output, all-gathered for the matmuls that keep it
                 + 2 * (q + 2 * kv) / t  # q, k, v
                 + 2 * q / t + 4 * m.n_heads / t  # the attention output and its log-sum-exp
                 + (2 * 2 * ff + 2 * 2 * ff) / t)  # gate and up; silu(gate) and the product
    gathered_kv = 2 * 2 * kv / t * w.micro_batch * w.seq_len if c > 1 else 0.0  # the whole sequence's K and V
    full = tokens * per_token + gathered_kv
    return full, tokens * 2 * d / t


def in_flight(lay: Layout, micro_batches: int) -> float:
    """Micro-batches whose activations the busiest pipeline rank holds at once."""
    if lay.pp == 1:
        return 1.0
    if lay.schedule == "gpipe":
        return float(micro_batches)
    if lay.schedule == "interleaved-1f1b":
        return lay.pp * (1 + (lay.pp - 1) / (lay.pp * lay.stages_per_rank))
    return float(min(micro_batches, lay.pp))


def bubble(lay: Layout, micro_batches: int) -> float:
    return (lay.pp - 1) / (lay.stages_per_rank * micro_batches + lay.pp - 1)


def estimate(m: ModelConfig, lay: Layout, w: Workload, hw: Hardware) -> dict:
    """Memory per GPU (GiB, by part) and step time (s, by part) of one layout."""
    micro = w.batch_tokens // w.seq_len // lay.dp // w.micro_batch  # micro-batches per step per rank
    p_stage = stage_params(m, lay)
    shards = lay.tp * lay.dp * lay.cp
    layers = rank_layers(m, lay)
    weights, grads, optim = 4 * p_stage / shards, 4 * p_stage / shards, 8 * p_stage / shards
    if lay.pp > 1:
        gathered = 2 * p_stage / lay.tp
    else:
        gathered = 2 * (2 * layer_params(m) + m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)) / lay.tp
    gathered += 2 * layer_params(m) / lay.tp  # one block's bf16 gradients before their reduce-scatter
    full, kept = activation_bytes(m, lay, w)
    held = in_flight(lay, micro)
    act = layers * held * full
    act_recompute = layers * held * kept + full
    logits = (4 if hw.compiled else 10) * w.micro_batch * w.seq_len / lay.cp * m.vocab_size / lay.tp
    fixed = weights + grads + optim + gathered + logits + hw.overhead_gib * GiB
    memory = {"weights": weights, "grads": grads, "optimizer": optim, "gathered": gathered, "logits": logits,
              "activations": act, "activations_recompute": act_recompute,
              "total": fixed + act, "total_recompute": fixed + act_recompute}
    memory = {k: v / GiB for k, v in memory.items()}
    recompute = memory["total"] > hw.hbm_gib
    # --- time ---
    tokens_gpu = w.batch_tokens / hw.gpus
    flops = m.flops_per_token(w.seq_len) * w.batch_tokens
    compute = flops / hw.gpus * (4 / 3 if recompute else 1) / (hw.peak_tflops * 1e12 * hw.efficiency)
    mb_tokens = w.micro_batch * w.seq_len / lay.cp  # per micro-batch per rank
    passes = 3 if recompute else 2  # forward, backward (+ the recomputed forward)
    tp_bytes = 4 * passes * (lay.tp - 1) / lay.tp * 2 * mb_tokens * m.d_model * layers * micro
    tp_time = tp_bytes / (hw.nvlink_gbs * 1e9) if lay.tp > 1 else 0.0
    cp_bytes = (passes * (lay.cp - 1) / lay.cp * 2 * 2 * m.kv_dim / lay.tp * w.micro_batch * w.seq_len
                * layers * micro)
    cp_link = hw.nvlink_gbs if lay.tp * lay.cp <= hw.gpus_per_node else hw.network_gbs
    cp_time = cp_bytes / (cp_link * 1e9) if lay.cp > 1 else 0.0
    pp_bytes = 2 * 2 * mb_tokens * m.d_model / lay.tp * micro * lay.stages_per_rank if lay.pp > 1 else 0.0
    pp_link = hw.network_gbs if lay.tp * lay.cp * lay.pp > hw.gpus_per_node else hw.nvlink_gbs
    pp_time = pp_bytes / (pp_link * 1e9)
    group = lay.dp * lay.cp
    gathers, scatters = (1, 1) if lay.pp > 1 else (2 * micro, micro)  # pipelined: gathered once, synced once
    dp_bytes = (group - 1) / group * p_stage / lay.tp * (2 * gathers + 4 * scatters)
    dp_link = hw.network_gbs if lay.tp * lay.cp * lay.pp * lay.dp > hw.gpus_per_node else hw.nvlink_gbs
    dp_time = dp_bytes / (dp_link * 1e9) if group > 1 else 0.0
    b = bubble(lay, micro)
    step = (compute + tp_time + cp_time + pp_time) / (1 - b) + max(0.0, dp_time - compute)
    mfu = flops / (hw.gpus * hw.peak_tflops * 1e12 * step)
    return {"layout": lay.name, **{k: v for k, v in asdict(lay).items()}, "micro_batches": micro,
            "memory_gib": memory, "recompute": recompute, "fits": min(memory["total"], memory["total_recompute"])
            <= hw.hbm_gib, "time_s": {"compute": compute, "tp": tp_time, "cp": cp_time, "pp": pp_time,
                                      "dp": dp_time, "dp_exposed": max(0.0, dp_time - compute), "step": step},
            "bubble": b, "tokens_per_s": w.batch_tokens / step, "mfu": mfu, "tokens_per_gpu": tokens_gpu}


def layouts(m: ModelConfig, w: Workload, hw: Hardware, *, tp=None, cp=None, pp=None,
            uneven: bool = False) -> list[Layout]:
    """Every layout of hw.gpus that the model and batch allow (fixed degrees where given): tp inside a node
    dividing the heads and KV heads; cp a power of two with 2 cp tp dividing the sequence; pp dividing the
    layers into equal stages (`uneven`: any pp, as Llama 3 trims its first and last stages; nanoforge's
    trainer cuts equal ones), with 1F1B and interleaved 1F1B; dp the rest, dividing the batch's sequences
    into micro-batches (at least pp of them for 1F1B)."""
    sequences = w.batch_tokens // w.seq_len
    out = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= hw.gpus_per_node and not m.n_heads % t and not m.n_kv_heads % t]
    cps = [2**i for i in range(0, 9)]
    pps = [p for p in range(1, m.n_layers + 1) if uneven or not m.n_layers % p]
    for t, c, p in itertools.product(tps, cps, pps):
        if (tp and t != tp) or (cp and c != cp) or (pp and p != pp):
            continue
        if hw.gpus % (t * c * p) or w.seq_len % (2 * c * t if c > 1 or t > 1 else 1):
            continue
        d = hw.gpus // (t * c * p)
        if sequences % (d * w.micro_batch):
            continue
        micro = sequences // (d * w.micro_batch)
        if p == 1:
            out.append(Layout(t, c, p, d))
            continue
        if m.tie_embeddings or micro < p:
            continue
        out.append(Layout(t, c, p, d, 1, "1f1b"))
        for v in (2, 4, 8) if uneven else [max((v for v in (2, 4, 8) if not m.n_layers % (p * v)), default=0)]:
            if v and not micro % p and p * v <= m.n_layers:
                out.append(Layout(t, c, p, d, v, "interleaved-1f1b"))
    return out


def plan(m: ModelConfig, w: Workload, hw: Hardware, *, uneven: bool = False, **fixed) -> list[dict]:
    """Every allowed layout's estimate, those that fit first, fastest first."""
    if w.batch_tokens % w.seq_len:
        raise NanoforgeError(f"--batch-tokens {w.batch_tokens} is not a whole number of {w.seq_len}-token "
                             f"sequences", param="batch_tokens")
    found = [estimate(m, lay, w, hw) for lay in layouts(m, w, hw, uneven=uneven, **fixed)]
    if not found:
        raise NanoforgeError(f"no layout of {hw.gpus} GPUs suits this model and batch ({w.batch_tokens // w.seq_len} "
                             f"sequences of {w.seq_len}; degrees must divide heads, layers, sequence and batch)",
                             param="gpus")
    return sorted(found, key=lambda r: (not r["fits"], r["time_s"]["step"]))


def table(rows: list[dict], hbm_gib: float, limit: int | None = None) -> str:
    head = (f"{'layout':<50} {'micro':>5} {'weights+grads+adam':>18} {'gathered':>8} {'act':>7} {'act rc':>7} "
            f"{'total GiB':>10} {'compute':>8} {'comm':>7} {'bubble':>7} {'step s':>7} {'MFU':>6}")
    lines = [head, "-" * len(head)]
    for r in rows[:limit]:
        mem, t = r["memory_gib"], r["time_s"]
        total = f"{mem['total_recompute' if r['recompute'] else 'total']:.1f}" + ("rc" if r["recompute"] else "")
        if not r["fits"]:
            total += ">"
        comm = t["tp"] + t["cp"] + t["pp"] + t["dp_exposed"]
        lines.append(f"{r['layout']:<50} {r['micro_batches']:>5} "
                     f"{mem['weights'] + mem['grads'] + mem['optimizer']:>18.1f} {mem['gathered']:>8.1f} "
                     f"{mem['activations']:>7.1f} {mem['activations_recompute']:>7.1f} {total:>10} "
                     f"{t['compute']:>8.2f} {comm:>7.2f} {100 * r['bubble']:>6.1f}% {t['step']:>7.2f} "
                     f"{100 * r['mfu']:>5.1f}%")
    return "\n".join(lines)


# Llama 3 405B's published layouts (the Llama 3 paper, Table 4: 8K-token pre-training at 8,192 and 16,384 GPUs,
# then 128K-token sequences with context parallelism), with the MFU the paper reports, on H100s of 80 GB.
LLAMA3_405B = [
    {"gpus": 8192, "tp": 8, "cp": 1, "pp": 16, "dp": 64, "seq_len": 8192, "batch_tokens": 16 * 2**20, "mfu": 0.43},
    {"gpus": 16384, "tp": 8, "cp": 1, "pp": 16, "dp": 128, "seq_len": 8192, "batch_tokens": 16 * 2**20, "mfu": 0.41},
    {"gpus": 16384, "tp": 8, "cp": 16, "pp": 16, "dp": 8, "seq_len": 131072, "batch_tokens": 16 * 2**20, "mfu": 0.38},
]


def llama3_405b(m: ModelConfig, hw: Hardware) -> list[dict]:
    """Our estimate of each published Llama 3 405B layout on its 80 GB GPUs (1F1B and interleaved 1F1B, with
    `hw`'s speeds)."""
    rows = []
    for row in LLAMA3_405B:
        h = Hardware(**{**asdict(hw), "gpus": row["gpus"], "hbm_gib": 80.0})  # the paper's H100s
        w = Workload(seq_len=row["seq_len"], batch_tokens=row["batch_tokens"])
        for est in plan(m, w, h, tp=row["tp"], cp=row["cp"], pp=row["pp"], uneven=True):
            rows.append(est | {"paper_mfu": row["mfu"]})
    return rows


def parse_count(text: str) -> int:
    """"16M" -> 16 * 2**20, "4096" -> 4096 (K, M, G: powers of 1024, as batch sizes are quoted)."""
    scale = {"k": 2**10, "m": 2**20, "g": 2**30}.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise NanoforgeError(f"{text!r} is not a count (e.g. 4096, 512K, 16M)", param="batch_tokens") from None
    if value <= 0 or value != int(value):
        raise NanoforgeError(f"{text!r} must be a positive whole number", param="batch_tokens")
    return int(value)

