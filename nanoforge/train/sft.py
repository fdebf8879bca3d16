"""Supervised fine-tuning: instruction records in, a chat model out.

Starts from a pretrained model folder (`init`), holds out `val_fraction` of
the records, renders each through the tokenizer's chat template with a loss
mask on the assistant's answer (and its end-of-turn token), packs the
examples with document masking and runs the shared training loop. At the end
it answers the held-out prompts and counts how many answers end with the
end-of-turn token within the token limit: the model has learnt to stop.
"""

from __future__ import annotations

import math
import time
from itertools import islice
from pathlib import Path

import numpy as np

from nanoforge.data.sft import SFTPacker, load_records, render_all, to_messages
from nanoforge.errors import NanoforgeError
from nanoforge.model.generate import generate
from nanoforge.model.transformer import Transformer
from nanoforge.runtime import pick_device
from nanoforge.tokenizer import Tokenizer
from nanoforge.train.checkpoint import load_for_training, load_state
from nanoforge.train.config import TrainConfig, sequence_length
from nanoforge.train.progress import write_json
from nanoforge.train.trainer import RunData, SingleDevice, train, use_cuda_graph


def split_records(records: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """A seeded random (train, val) split; val gets round(n * val_fraction) records, at least one."""
    order = np.random.default_rng(seed).permutation(len(records))
    n_val = max(1, round(len(records) * val_fraction))
    if n_val >= len(records):
        raise NanoforgeError(f"{len(records)} records are too few to hold out {val_fraction:.0%} for validation",
                             param="data")
    return [records[i] for i in order[n_val:]], [records[i] for i in order[:n_val]]


def prompt_and_answer(record: dict) -> tuple[list[dict], str]:
    """The conversation up to its last assistant message, and that message (the reference answer)."""
    messages = to_messages(record)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], messages[last]["content"]


def answer_eval(model: Transformer, tokenizer: Tokenizer, records: list[dict], max_new_tokens: int,
                n_examples: int = 3) -> dict:
    """Greedy answers to held-out prompts: the share that ends with the end-of-turn token within
    max_new_tokens (and the context), plus a few examples to read."""
    model.eval()
    ended, examples, tokens, started = 0, [], 0, time.perf_counter()
    for record in records:
        prompt, reference = prompt_and_answer(record)
        ids = tokenizer.encode_chat(prompt, add_generation_prompt=True)
        out = (generate(model, ids, max_new_tokens=max_new_tokens, stop_ids=tokenizer.stop_ids)
               if len(ids) < model.cfg.max_seq_len else [])
        ok = bool(out) and out[-1] == tokenizer.eot_id
        ended += ok
        tokens += len(out)
        if len(examples) < n_examples:
            answer = tokenizer.decode(out[:-1] if ok else out)
            examples.append({"prompt": prompt[-1]["content"], "reference": reference, "answer": answer,
                             "ended_with_eot": ok})
    return {"samples": len(records), "ended_with_eot": ended, "eot_rate": ended / max(len(records), 1),
            "max_new_tokens": max_new_tokens, "examples": examples, "tokens": tokens,
            "seconds": time.perf_counter() - started}


def finetune(cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False, answer_tokens: int = 256,
             eval_samples: int | None = 100, layout: SingleDevice | None = None) -> dict:
    """Run (or resume) SFT; returns the loop's summary plus the held-out answer check.

    A fresh run with cfg.epochs set trains for that many passes over the examples (max_steps is
    computed); `eval_samples` held-out prompts (None: all) are answered at the end. With a parallel
    `layout` every rank trains; the layout is closed after training, and the main rank answers the
    prompts with the model folder the run wrote (the others return the summary alone)."""
    out_dir = Path(out_dir)
    layout = layout or SingleDevice(pick_device(cfg.device))
    device, say = layout.device, (print if layout.is_main else lambda *a, **k: None)
    state = load_state(out_dir) if resume else None
    use_cuda_graph(device, cfg.cuda_graph, layout.name)  # refuse before anything is written
    source = out_dir if resume else Path(cfg.init or "runs/pretrain")
    if not (source / "config.json").is_file():
        raise NanoforgeError(f"{source}/config.json not found: SFT starts from a pretrained model folder "
                             f"(run `nanoforge train` first, or pass --init)", param="init")
    model = load_for_training(source, device)
    tokenizer = Tokenizer.load(source)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise NanoforgeError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                             f"{model.cfg.vocab_size}; they are not from the same model", param="init")
    # Generation (here and in transformers) should stop at the end of the assistant's turn.
    model.cfg = model.cfg.replace(eos_token_id=sorted({tokenizer.eot_id, tokenizer.eos_id}))

    records = load_records(cfg.data[0] if cfg.data else None)
    train_records, val_records = split_records(records, cfg.val_fraction, cfg.seed)
    seq_len = sequence_length(cfg, model.cfg)
    train_records, train_examples, unknown = render_all(train_records, tokenizer)
    val_records, val_examples, val_unknown = render_all(val_records, tokenizer)
    skipped = len(records) - len(train_records) - len(val_records)
    if skipped:
        chars = "".join(sorted(set(unknown) | set(val_unknown)))
        if not train_records or not val_records:
            raise NanoforgeError(f"{source}'s tokenizer cannot encode {'any' if not train_records else 'enough'} "
                                 f"of the {len(records)} records (characters outside its vocabulary: {chars[:40]!r}); "
                                 f"fine-tune a model whose tokenizer covers the data (e.g. pretrained with "
                                 f"--tokenizer bpe:N)", param="data")
        say(f"SFT: skipped {skipped} of {len(records)} records holding characters outside {source}'s vocabulary "
              f"({chars[:40]!r}): a character-level model cannot read them, here or when it serves")
    packer = SFTPacker(train_examples, seq_len, cfg.batch_size, seed=cfg.seed, shard=layout.data_shard)

    def steps_for(examples, passes: float) -> int:
        """Batches that `passes` passes over the examples fill (each takes len - 1 slots of a row)."""
        return max(1, math.ceil(passes * sum(len(ids) - 1 for ids, _ in examples) / (cfg.batch_size * seq_len)))

    if state is None and cfg.epochs:
        cfg = cfg.replace(max_steps=steps_for(train_examples, cfg.epochs))

    val_packer = SFTPacker(val_examples, seq_len, cfg.batch_size, seed=cfg.seed, shard=layout.data_shard)
    for name, p in (("training", packer), ("held-out", val_packer)):
        if p.dropped:
            say(f"SFT: dropped {p.dropped} of {p.dropped + len(p.examples)} {name} examples longer than "
                  f"seq_len + 1 = {seq_len + 1} tokens")
    val_start, one_pass = val_packer.state_dict(), steps_for(val_examples, 1)

    def eval_batches(n: int | None):
        """The same packed validation batches every time: about one pass, or the first n of it."""
        val_packer.load_state_dict(val_start)
        return islice(val_packer, min(n or one_pass, one_pass))

    where = f"{layout.world_size} processes ({layout.name}), {device.type}" if layout.distributed else device
    say(f"fine-tuning {source} ({model.num_params() / 1e6:.2f}M parameters) on {where}: "
        f"{len(train_records)} examples ({len(val_records)} held out), {cfg.batch_size} x {seq_len} tokens "
        f"per step, {cfg.max_steps} steps")
    summary = train(model, tokenizer, cfg, RunData(packer, eval_batches), out_dir, layout=layout, resume=state,
                    title="sft")
    if layout.distributed:  # the model is sharded across the ranks: answer with the folder the run wrote
        layout.close()
        if not layout.is_main:
            return summary
        model = load_for_training(out_dir, device)
        model.cfg = model.cfg.replace(eos_token_id=sorted({tokenizer.eot_id, tokenizer.eos_id}))

    held_out = val_records if eval_samples is None else val_records[:eval_samples]
    check = answer_eval(model, tokenizer, held_out, answer_tokens)
    write_json(out_dir / "answers.json", check)
    return summary | {"answers": check}
