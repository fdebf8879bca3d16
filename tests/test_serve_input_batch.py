"""The persistent batch (serve/input_batch.py): after every step the device's per-slot block tables and
sampling parameters equal what the scheduler holds for every scheduled sequence, under preemption (recompute
and swap), prefix hits, forks with copy-on-write and aborts; a decode step sends only the new block-table
entries; the packed layout round-trips."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_serve_engine import make_model, prompts  # noqa: E402  (tests/ is on sys.path under pytest)

from nanoforge import SamplingParams
from nanoforge.serve.input_batch import Layout
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine
from nanoforge.tokenizer import Tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. PACK MY BOX WITH FIVE DOZEN LIQUOR JUGS! 0123456789,;:?'\n"


def test_layout_views_round_trip_on_host_and_device():
    layout = Layout(7, 3)
    buf = np.zeros(layout.size, dtype=np.int64)
    v = layout.views(buf)
    v["ids"][:] = np.arange(7)
    v["draw"][:] = [5, 6, 7]
    v["seq_lens"][:] = [10, 11, 12]
    v["cu_seqlens"][:] = [0, 2, 5, 7]
    t = layout.views(torch.from_numpy(buf.copy()))
    assert t["ids"].tolist() == list(range(7)) and t["draw"].tolist() == [5, 6, 7]
    assert t["seq_lens"].dtype == torch.int32 and t["seq_lens"].tolist() == [10, 11, 12]
    assert t["cu_seqlens"].tolist() == [0, 2, 5, 7]
    spans = sorted(layout.spans.values()) + sorted(layout.int32_spans.values())
    ends = [a + (n if (a, n) in layout.spans.values() else (n + 1) // 2) for a, n in spans]
    assert max(ends) <= layout.size  # no field runs past the buffer


@pytest.mark.parametrize("t,s", [(7, 3), (16, 5), (33, 33), (1024, 256)])
def test_every_field_starts_16_byte_aligned_and_fields_never_overlap(t, s):
    """Triton specializes on pointer alignment: a field's alignment must not depend on the step's sizes."""
    layout = Layout(t, s)
    v = layout.views(torch.zeros(layout.size, dtype=torch.int64))
    base = v["ids"].data_ptr()
    assert all((x.data_ptr() - base) % 16 == 0 for x in v.values())
    spans = sorted((x.data_ptr() - base, x.data_ptr() - base + x.numel() * x.element_size()) for x in v.values())
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.size * 8


def check_device_batch(engine: LLMEngine) -> int:
    """Every sequence holding a slot: the device's table row starts with its block table and its sampling
    parameters are the request's. Returns how many were checked."""
    runner, batch = engine.runner, engine.runner.batch
    checked = 0
    for seq_id, slot in batch._slot_of.items():
        seq = batch._seq[slot]
        if seq.status.name != "RUNNING":
            continue  # leaves at the next prepare
        table = seq.block_table
        assert runner.table[slot, :len(table)].tolist() == table, (seq, slot)
        p = seq.sampling_params
        assert runner.slot_temperature[slot].item() == pytest.approx(p.temperature)
        assert runner.slot_top_k[slot].item() == max(p.top_k, 0)
        if p.seed is not None:
            assert runner.slot_seed[slot].item() == p.seed + seq.index
        checked += 1
    # a slot is never shared, and the free list holds exactly the rest
    assert len(set(batch._slot_of.values())) == len(batch._slot_of)
    assert sorted(batch._free + list(batch._slot_of.values())) == list(range(len(batch._seq)))
    return checked


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_device_tables_track_the_scheduler_through_preemption_forks_and_aborts(mode):
    tok = Tokenizer.char_level(TEXT)
    model = make_model(tok)
    rng = random.Random(0)
    shared = [rng.randrange(60) for _ in range(24)]
    ps = prompts(5, rng) + [shared + p for p in prompts(4, rng, 1, 12)]
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16,
                                                 max_num_seqs=6, preemption_mode=mode,
                                                 swap_space=0 if mode == "recompute" else 1 << 20))
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, top_k=5, max_tokens=12, seed=3, ignore_eos=True)]
    ids = [engine.add_request(p, params[i % 2]) for i, p in enumerate(ps)]
    checked, steps = 0, 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        checked += check_device_batch(engine)
        if steps == 6:
            engine.abort(ids[1])
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["blocks_copied"] > 0  # preemption and copy-on-write both happened
    engine.runner.batch._release_departed()  # slots are given back lazily, at the next step's prepare
    assert checked > steps and engine.runner.batch.num_active == 0  # every slot came back


def test_a_decode_step_sends_only_new_block_table_entries():
    tok = Tokenizer.char_level(TEXT)
    model = make_model(tok)
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_gpu_blocks=200))
    for p in prompts(6, random.Random(1), 5, 30):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    batch, seen = engine.runner.batch, []
    prepare = batch.prepare

    def spy(out, *a, **kw):
        step, samples = prepare(out, *a, **kw)
        if all(item.is_decode for item in out.scheduled):
            crossing = sum(item.start % 4 == 0 for item in out.scheduled)  # a position that opens a new block
            seen.append((step.num_table_updates, crossing, step.num_param_updates))
        return step, samples

    batch.prepare = spy
    while engine.has_unfinished():
        engine.step()
    assert len(seen) > 10
    assert all(updates == crossing and params == 0 for updates, crossing, params in seen), seen


def check_padding(batch, step) -> None:
    """A padded step: every sampled row is a token some sequence owns (its attention row is computed), and tokens
    that no sequence owns write the scratch block's spare slot alone (what padding sequences read stays finite)."""
    layout, v = step.layout, step.layout.views(step.packed.numpy())
    cu = v["cu_seqlens"][:layout.s + 1]
    owned = int(cu[-1])
    assert (np.diff(cu) >= 0).all() and owned <= layout.t
    assert (v["sample_row"][:layout.s] < owned).all(), (v["sample_row"][:layout.s], owned)
    assert (v["slots"][owned:layout.t] == batch.spare_cache_slot).all()
    assert (v["slots"][step.num_tokens:owned] == batch.scratch_cache_slot).all()
    spare, scratch = batch.spare_cache_slot, batch.scratch_cache_slot
    assert spare != scratch and spare // 4 == scratch // 4  # another slot of the scratch block (block_size 4 here)


@pytest.mark.parametrize("t,s", [(16, 6), (4, 6), (6, 6)])
def test_idle_inputs_sample_only_rows_a_padding_sequence_owns(t, s):
    """What graphs are captured with (every row padding), buckets of more tokens than rows, fewer, as many."""
    tok = Tokenizer.char_level(TEXT)
    engine = LLMEngine(make_model(tok), tok, EngineConfig(block_size=4, num_gpu_blocks=20, max_num_seqs=6))
    batch = engine.runner.batch
    check_padding(batch, SimpleNamespace(layout=Layout(t, s), packed=torch.from_numpy(batch.idle(Layout(t, s))),
                                         num_tokens=0))


def test_padded_bucket_steps_sample_only_rows_a_sequence_owns():
    """graph_prefill on the CPU: every step packed at a bucket, decode steps too (no decode graphs here): chunks,
    decodes of fewer sequences than slots, and the bucket's tokens beyond the padding sequences."""
    tok = Tokenizer.char_level(TEXT)
    engine = LLMEngine(make_model(tok), tok, EngineConfig(block_size=4, num_gpu_blocks=60, max_num_batched_tokens=24,
                                                          max_num_seqs=6, graph_prefill=True))
    for p in prompts(5, random.Random(2), 3, 30):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    batch, kinds = engine.runner.batch, set()
    prepare = batch.prepare

    def spy(out, *a, **kw):
        step, samples = prepare(out, *a, **kw)
        if step.graph is not None:
            check_padding(batch, step)
            kinds.add((step.layout.t > step.num_tokens + step.layout.s - step.num_seqs, step.num_samples > 0))
        return step, samples

    batch.prepare = spy
    while engine.has_unfinished():
        engine.step()
    assert (True, True) in kinds  # steps with tokens no sequence owns, that sample


def test_one_token_blocks_still_keep_the_spare_slot_apart_from_the_scratch():
    """block_size 1: the scratch slot padding sequences read fills its block, so the cache holds a second scratch
    block for the spare slot (with one block, the unowned tokens' keys would land where padding sequences read)."""
    tok = Tokenizer.char_level(TEXT)
    engine = LLMEngine(make_model(tok), tok, EngineConfig(block_size=1, num_gpu_blocks=200, max_num_seqs=4))
    batch, runner = engine.runner.batch, engine.runner
    assert batch.spare_cache_slot == batch.scratch_cache_slot + 1 == runner.scratch_block + 1
    assert runner.k_cache.shape[1] == runner.v_cache.shape[1] == 202  # the blocks handed out, then the scratch two
