"""Data: prepare (inputs, split, dtype, errors, atomic output), the packed loader, SFT rendering and packing, defaults."""

import argparse
import json
import random

import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers

from nanoforge.data.default import default_corpus, default_instructions
from nanoforge.data.loader import PackedLoader, doc_ids_and_positions
from nanoforge.data.prepare import add_cli_arguments, prepare, run_cli
from nanoforge.data.sft import IGNORE_INDEX, SFTPacker, load_records, render, to_messages
from nanoforge.errors import NanoforgeError
from nanoforge.tokenizer import IM_END, Tokenizer
from conftest import SHARED_DATA

SHAKESPEARE = str(SHARED_DATA / "tinyshakespeare.txt")
INSTRUCTIONS = str(SHARED_DATA / "instruction-data.json")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def random_doc(rng, lines=3):
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(lines))


@pytest.fixture(scope="module")
def tok():
    rng = random.Random(0)
    return Tokenizer.train_bpe([random_doc(rng, 20) for _ in range(50)] + ["ünïcødé 😀 text\tand\n\n  spaces"], vocab_size=400)


def read_split(out, name, meta):
    return np.fromfile(out / name, dtype=meta["dtype"]).tolist()


def split_docs(ids, eot):
    docs, cur = [], []
    for i in ids:
        if i == eot:
            docs.append(cur)
            cur = []
        else:
            cur.append(i)
    return docs + [cur] if ids else []


# ---------------------------------------------------------------------- prepare


def test_prepare_files_folder_jsonl_with_document_split(tmp_path, tok):
    rng = random.Random(1)
    (tmp_path / "in" / "sub" / "deeper").mkdir(parents=True)
    texts = {
        "a.txt": random_doc(rng),
        "in/b.md": random_doc(rng),
        "in/sub/deeper/c.txt": random_doc(rng),
        "in/sub/ignored.bin": "not read: unknown suffix inside a folder",
        "in/.hidden/d.txt": "not read: hidden",
    }
    for name, text in texts.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    records = [{"text": random_doc(rng), "id": i} for i in range(150)]
    records.insert(7, {"text": ""})  # empty records are skipped, and counted
    (tmp_path / "in" / "sub" / "r.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    out = tmp_path / "out"
    meta = prepare([tmp_path / "a.txt", tmp_path / "in"], out, tok, val_fraction=0.1, seed=3)

    # Sources in order: explicit file, then the folder's files sorted by path.
    expected = [texts["a.txt"], texts["in/b.md"], texts["in/sub/deeper/c.txt"], *(r["text"] for r in records if r["text"])]
    assert (meta["documents"], meta["empty_documents_skipped"], meta["split"]) == (153, 1, "documents")
    assert (meta["train_documents"], meta["val_documents"]) == (138, 15)
    assert meta["dtype"] == "uint16" and meta["eos_id"] == tok.eos_id
    train, val = read_split(out, "train.bin", meta), read_split(out, "val.bin", meta)
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    # Each split is its documents, in corpus order, with exactly one EOT between neighbours.
    train_docs, val_docs = split_docs(train, tok.eos_id), split_docs(val, tok.eos_id)
    assert (len(train_docs), len(val_docs)) == (138, 15)
    encoded = [tok.encode(t) for t in expected]
    is_val = [e in val_docs for e in encoded]
    assert [e for e, v in zip(encoded, is_val) if not v] == train_docs
    assert [e for e, v in zip(encoded, is_val) if v] == val_docs
    assert train[0] != tok.eos_id and train[-1] != tok.eos_id
    assert Tokenizer.load(out).encode(expected[0]) == encoded[0]
    assert json.loads((out / "meta.json").read_text()) == meta
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "tokenizer_config.json", "train.bin", "val.bin"]


def test_prepare_single_document_matches_nanogpt_char_split(tmp_path):
    with open(SHAKESPEARE, encoding="utf-8") as f:
        text = f.read()
    tok = Tokenizer.char_level(text)
    meta = prepare([SHAKESPEARE], tmp_path, tok)
    # nanoGPT data/shakespeare_char/prepare.py
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    n = len(text)
    train_ids, val_ids = [stoi[c] for c in text[: int(n * 0.9)]], [stoi[c] for c in text[int(n * 0.9) :]]
    assert meta["split"] == "tokens" and meta["dtype"] == "uint16"
    assert np.array_equal(np.fromfile(tmp_path / "train.bin", dtype=np.uint16), train_ids)
    assert np.array_equal(np.fromfile(tmp_path / "val.bin", dtype=np.uint16), val_ids)


def test_long_document_is_tokenized_as_a_whole(tmp_path, tok):
    rng = random.Random(2)
    text = "\n".join(random_doc(rng, 1) + rng.choice(["", " ", "  ", "\n", "\n\n  "]) for _ in range(6000))
    assert len(text) > 3 * 65536  # prepare tokenizes it in several pieces
    (tmp_path / "long.txt").write_text(text)
    meta = prepare([tmp_path / "long.txt"], tmp_path / "out", tok, val_fraction=0.0)
    assert read_split(tmp_path / "out", "train.bin", meta) == tok.encode(text)
    assert meta["val_tokens"] == 0


def test_dtype_is_uint32_for_large_vocabularies(tmp_path):
    vocab = {f"w{i}": i for i in range(70000)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<|endoftext|>"])
    big = Tokenizer(backend, eos_token="<|endoftext|>")
    (tmp_path / "a.txt").write_text("w69999 w1 w65536")
    meta = prepare([tmp_path / "a.txt"], tmp_path / "out", big, val_fraction=0.0)
    assert meta["dtype"] == "uint32"
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint32).tolist() == [69999, 1, 65536]


def test_prepare_parquet(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = ["first document", "second one", "third"]
    pq.write_table(pa.table({"body": texts, "n": [1, 2, 3]}), tmp_path / "d.parquet")
    meta = prepare([tmp_path / "d.parquet"], tmp_path / "out", tok, val_fraction=0.0, text_field="body")
    assert split_docs(read_split(tmp_path / "out", "train.bin", meta), tok.eos_id) == [tok.encode(t) for t in texts]
    with pytest.raises(NanoforgeError, match=r"d\.parquet has no column 'text'"):
        prepare([tmp_path / "d.parquet"], tmp_path / "out2", tok)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", b"", r"empty\.txt is empty"),
        ("blank.md", b"  \n\n ", r"blank\.md is empty"),
        ("bin.txt", bytes(range(256)) * 4, r"bin\.txt looks like a binary file"),
        ("latin1.txt", "café".encode("latin-1"), r"latin1\.txt is not UTF-8 text"),
        ("d.jsonl", b'{"text": "a"}\n{"text": "b"}\n\n{"txt": "c"}\n', r"d\.jsonl line 4: field 'text' is missing"),
        ("n.jsonl", b'{"text": "a"}\n{"text": 5}\n', r"n\.jsonl line 2: field 'text' is not a string"),
        ("bad.jsonl", b'{"text": "a"}\n{"text": "b"\n', r"bad\.jsonl line 2: invalid JSON"),
        ("list.json", b'{"text": "a"}', r"list\.json must hold a JSON list"),
        ("r.json", b'[{"text": "a"}, {"body": "b"}]', r"r\.json record 1: field 'text' is missing"),
    ],
)
def test_bad_input_is_one_clear_error_and_nothing_is_written(tmp_path, tok, name, content, message):
    (tmp_path / name).write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(NanoforgeError, match=message):
        prepare([tmp_path / name], out, tok)
    assert not out.exists() or list(out.iterdir()) == []  # no shards, no meta.json, no temp folder


def test_failed_prepare_keeps_the_previous_good_output(tmp_path, tok):
    (tmp_path / "good.txt").write_text("alpha beta gamma")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"nope": 1}\n')
    out = tmp_path / "out"
    prepare([tmp_path / "good.txt"], out, tok)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(NanoforgeError, match="line 2"):
        prepare([tmp_path / "good.txt", tmp_path / "bad.jsonl"], out, tok)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_missing_input_and_empty_folder(tmp_path, tok):
    with pytest.raises(NanoforgeError, match="input not found"):
        prepare([tmp_path / "missing.txt"], tmp_path / "out", tok)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x.bin").write_bytes(b"\0")
    with pytest.raises(NanoforgeError, match="has no"):
        prepare([tmp_path / "folder"], tmp_path / "out", tok)
    with pytest.raises(NanoforgeError, match="val_fraction"):
        prepare([tmp_path / "folder"], tmp_path / "out", tok, val_fraction=1.0)


def test_cli_char_tokenizer(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("to be or not to be\n" * 50)
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args([str(tmp_path / "t.txt"), "--out", str(tmp_path / "out"), "--tokenizer", "char", "--val-fraction", "0.2"])
    assert run_cli(args) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["vocab_size"] == len(set("to be or not to be\n")) + 3
    assert (meta["train_tokens"], meta["val_tokens"]) == (760, 190)
    assert "train 760 tokens" in capsys.readouterr().out
    with pytest.raises(NanoforgeError, match="integer vocabulary size"):
        run_cli(parser.parse_args([str(tmp_path / "t.txt"), "--out", str(tmp_path / "o2"), "--tokenizer", "bpe:big"]))


# ---------------------------------------------------------------------- loader


def naive_doc_ids_and_positions(row, eot):
    doc_ids, positions, doc, pos = [], [], 0, 0
    for token in row:
        doc_ids.append(doc)
        positions.append(pos)
        doc, pos = (doc + 1, 0) if token == eot else (doc, pos + 1)
    return doc_ids, positions


def test_doc_ids_and_positions_match_naive():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (6, 50), generator=gen)  # eot=0 is frequent, also first/last/consecutive
    ids[0, 0] = ids[0, 1] = ids[1, -1] = 0
    doc_ids, positions = doc_ids_and_positions(ids, eot_id=0)
    for row, d, p in zip(ids.tolist(), doc_ids.tolist(), positions.tolist()):
        assert (d, p) == naive_doc_ids_and_positions(row, 0)


@pytest.fixture
def token_file(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 1000, size=5000).astype(np.uint16)
    tokens[rng.random(5000) < 0.05] = 0  # EOT = 0
    tokens.tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    return tmp_path / "train.bin", tokens


def test_loader_batches_are_windows_with_document_structure(token_file):
    path, tokens = token_file
    loader = PackedLoader(path, batch_size=4, seq_len=64, seed=1, eot_id=0)
    for _ in range(3):
        b = next(loader)
        assert b.input_ids.shape == b.targets.shape == b.doc_ids.shape == b.positions.shape == (4, 64)
        assert b.input_ids.dtype == torch.int64 and b.loss_mask is None
        for x, y, d, p in zip(b.input_ids.tolist(), b.targets.tolist(), b.doc_ids.tolist(), b.positions.tolist()):
            starts = [s for s in range(len(tokens) - 64) if tokens[s : s + 64].tolist() == x]
            assert any(tokens[s + 1 : s + 65].tolist() == y for s in starts)
            assert (d, p) == naive_doc_ids_and_positions(x, 0)
    moved = b.to("cpu")
    assert torch.equal(moved.input_ids, b.input_ids) and moved.loss_mask is None
    flat = PackedLoader(path, batch_size=2, seq_len=64, seed=1, eot_id=0, doc_masking=False)
    b = next(flat)
    assert (b.doc_ids == 0).all() and (b.positions == torch.arange(64)).all()


def test_loader_is_deterministic_and_resumes_exactly(token_file):
    path, _ = token_file
    make = lambda seed=7: PackedLoader(path, batch_size=3, seq_len=32, seed=seed, eot_id=0)  # noqa: E731
    straight = [next(make_it) for make_it in [make()] for _ in range(8)]
    again = make()
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(straight, (next(again) for _ in range(8))))
    other = next(make(seed=8))
    assert not torch.equal(other.input_ids, straight[0].input_ids)

    first = make()
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = make()
    resumed.load_state_dict(state)
    for expected in straight[5:]:
        got = next(resumed)
        assert all(torch.equal(getattr(got, f), getattr(expected, f)) for f in ("input_ids", "targets", "doc_ids", "positions"))
    with pytest.raises(NanoforgeError, match="seed"):
        make(seed=9).load_state_dict(state)


def test_data_parallel_ranks_read_their_rows_of_the_one_process_batches(token_file):
    """Rank i of n reads rows i*B/n.. of every batch: together, the batches one process reads, in order, at any
    n (so a layout change keeps the token order); evaluation batches too, the last one padded with rows that
    train nothing."""
    path, _ = token_file
    whole = PackedLoader(path, 4, 32, seed=0, eot_id=0)
    for n in (2, 4):
        ranks = [PackedLoader(path, 4, 32, seed=0, eot_id=0, shard=(i, n)) for i in range(n)]
        for _ in range(3):
            expected = next(whole)
            parts = [next(r) for r in ranks]
            for f in ("input_ids", "targets", "doc_ids", "positions"):
                assert torch.equal(torch.cat([getattr(p, f) for p in parts]), getattr(expected, f))
        whole = PackedLoader(path, 4, 32, seed=0, eot_id=0)
    evals = [list(PackedLoader(path, 4, 100, seed=0, eot_id=0, shard=(i, 2)).iter_eval(3, 100)) for i in range(2)]
    one = list(whole.iter_eval(3, 100))
    assert len(one) == len(evals[0]) == len(evals[1]) and one[-1].input_ids.shape[0] < 3
    for got0, got1, want in zip(*evals, one):
        rows = torch.cat([got0.input_ids, got1.input_ids])
        trained = torch.cat([got0.targets, got1.targets]) != IGNORE_INDEX
        assert torch.equal(rows[trained.any(1)], want.input_ids) and int(trained.sum()) == want.targets.numel()
    with pytest.raises(ValueError):
        PackedLoader(path, 3, 32, seed=0, eot_id=0, shard=(0, 2))


def test_iter_eval_walks_the_split_in_order(token_file):
    path, tokens = token_file
    loader = PackedLoader(path, batch_size=4, seq_len=100, seed=0, eot_id=0)
    batches = list(loader.iter_eval(batch_size=4, seq_len=100))
    rows = torch.cat([b.input_ids for b in batches])
    assert rows.shape == ((len(tokens) - 1) // 100, 100)
    assert rows.flatten().tolist() == tokens[: rows.numel()].tolist()
    assert torch.cat([b.targets for b in batches]).flatten().tolist() == tokens[1 : rows.numel() + 1].tolist()
    assert len(list(loader.iter_eval(4, 100, max_batches=2))) == 2


def test_loader_errors(tmp_path, token_file):
    path, _ = token_file
    with pytest.raises(NanoforgeError, match="fewer than seq_len"):
        PackedLoader(path, 1, 5000, seed=0, eot_id=0)
    with pytest.raises(NanoforgeError, match="not found"):
        PackedLoader(tmp_path / "val.bin", 1, 8, seed=0, eot_id=0)
    (tmp_path / "meta.json").unlink()
    with pytest.raises(NanoforgeError, match="meta.json not found"):
        PackedLoader(path, 1, 8, seed=0, eot_id=0)


def test_loader_reads_prepared_output(tmp_path, tok):
    rng = random.Random(4)
    (tmp_path / "a.txt").write_text("\n".join(random_doc(rng) for _ in range(100)))
    meta = prepare([tmp_path / "a.txt"], tmp_path / "out", tok)
    b = next(PackedLoader(tmp_path / "out" / "val.bin", 2, 16, seed=0, eot_id=meta["eos_id"]))
    assert b.input_ids.max() < tok.vocab_size


# ---------------------------------------------------------------------- SFT


def trained_text(tok, ids, mask):
    """The trained tokens, decoded run by run."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def test_render_alpaca_trains_exactly_the_answer_and_end_of_turn(tok):
    record = {"instruction": "Name two letters.", "input": "greek ones", "output": "alpha beta"}
    ids, mask = render(record, tok)
    expected = "<|im_start|>user\nName two letters.\n\ngreek ones<|im_end|>\n<|im_start|>assistant\nalpha beta<|im_end|>\n"
    assert tok.decode(ids) == expected and ids == tok.encode(expected, allow_special=True)
    assert trained_text(tok, ids, mask) == ["alpha beta" + IM_END]
    assert ids[max(i for i, m in enumerate(mask) if m)] == tok.eot_id
    no_input = render({"instruction": "Say hi.", "input": "", "output": "hi"}, tok)
    assert tok.decode(no_input[0]).startswith("<|im_start|>user\nSay hi.<|im_end|>")


def test_render_multi_turn_chat(tok):
    record = {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "alpha?"},
        {"role": "assistant", "content": " beta\n"},
        {"role": "user", "content": "gamma?"},
        {"role": "assistant", "content": "ünïcødé 😀"},
    ]}
    ids, mask = render(record, tok)
    assert trained_text(tok, ids, mask) == [" beta\n" + IM_END, "ünïcødé 😀" + IM_END]


def test_render_with_a_template_whose_turn_end_is_not_chatml(tmp_path, tok):
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}### assistant:\n{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    custom = Tokenizer.load(tmp_path)
    ids, mask = render({"instruction": "q", "output": "alpha"}, custom)
    assert trained_text(custom, ids, mask) == ["alpha" + IM_END]


def test_load_records_errors_name_the_line(tmp_path):
    assert len(load_records(INSTRUCTIONS)) == 1100
    cases = {
        "a.jsonl": ('{"instruction": "x", "output": "y"}\n{"instruction": "x", "input": "z"}\n', r"a\.jsonl line 2: field 'output' is missing"),
        "b.jsonl": ('{"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}\n', r"b\.jsonl line 1: messages\[1\] has role 'robot'"),
        "c.jsonl": ('{"messages": [{"role": "user", "content": "x"}]}\n', r"c\.jsonl line 1: no assistant message"),
        "d.json": ('[{"instruction": "x", "output": "y"}, {"prompt": "x"}]', r"d\.json record 1: expected Alpaca fields"),
        "e.jsonl": ('{"messages": [{"role": "user"}]}', r"e\.jsonl line 1: messages\[0\] is missing the string field 'content'"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_text(content)
        with pytest.raises(NanoforgeError, match=message):
            load_records(tmp_path / name)
    with pytest.raises(NanoforgeError, match="not found"):
        load_records(tmp_path / "missing.json")


def make_examples(n, rng, max_len=60):
    """Fake rendered examples: random ids, mask on a random tail (like an answer)."""
    examples = []
    for _ in range(n):
        length = rng.randint(2, max_len)
        answer = rng.randint(1, length - 1)
        examples.append(([rng.randint(1, 399) for _ in range(length)], [0] * (length - answer) + [1] * answer))
    return examples


def test_packer_keeps_examples_whole_and_uses_each_once_per_epoch(tok):
    rng = random.Random(5)
    examples = make_examples(200, rng) + [([1] * 80, [1] * 80)]  # one too long for seq_len 64: dropped
    packer = SFTPacker(examples, seq_len=64, batch_size=4, seed=0)
    assert packer.dropped == 1 and len(packer.examples) == 200
    rows_in_epoch = len(packer._epoch_rows(0))
    seen, rows = [], 0
    while rows < rows_in_epoch:
        b = next(packer)
        assert b.input_ids.shape == b.loss_mask.shape == (4, 64)
        assert torch.equal(b.targets == IGNORE_INDEX, ~b.loss_mask)
        for r in range(min(4, rows_in_epoch - rows)):  # the last batch may start the next epoch
            rows += 1
            d, p = b.doc_ids[r].tolist(), b.positions[r].tolist()
            for doc in sorted(set(d)):
                cols = [t for t in range(64) if d[t] == doc]
                assert cols == list(range(cols[0], cols[-1] + 1)) and [p[t] for t in cols] == list(range(len(cols)))
                ids = b.input_ids[r, cols].tolist() + [None]
                mask = [0] + b.loss_mask[r, cols].int().tolist()
                if not any(mask):  # padding at the end of the row
                    assert cols[-1] == 63 and not b.loss_mask[r, cols].any()
                    continue
                ids[-1] = b.targets[r, cols[-1]].item()  # the last target is the example's last token
                seen.append((ids, mask))
    originals = sorted((ids, mask) for ids, mask in examples if len(ids) <= 65)
    assert sorted(seen) == originals  # every example exactly once, never split across rows
    assert sum(len(ids) - 1 for ids, _ in originals) / (rows_in_epoch * 64) > 0.9  # tight packing


def test_packer_is_deterministic_and_resumes_exactly():
    examples = make_examples(60, random.Random(6), max_len=40)
    make = lambda: SFTPacker(examples, seq_len=48, batch_size=3, seed=2)  # noqa: E731
    straight = [next(p) for p in [make()] for _ in range(30)]  # several epochs
    first = make()
    for _ in range(17):
        next(first)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for expected in straight[17:]:
        got = next(resumed)
        assert all(torch.equal(getattr(got, f), getattr(expected, f)) for f in ("input_ids", "targets", "doc_ids", "positions", "loss_mask"))
    assert not torch.equal(straight[0].input_ids, next(SFTPacker(examples, seq_len=48, batch_size=3, seed=3)).input_ids)


def test_packer_shards_are_the_rows_of_one_process_batches():
    """Data-parallel rank i of n gets rows i*B/n.. of the batches one process packs, across epochs and resumes."""
    examples = make_examples(60, random.Random(6), max_len=40)
    whole = SFTPacker(examples, seq_len=48, batch_size=4, seed=2)
    ranks = [SFTPacker(examples, seq_len=48, batch_size=4, seed=2, shard=(i, 2)) for i in range(2)]
    for step in range(25):  # several epochs
        expected, parts = next(whole), [next(r) for r in ranks]
        for f in ("input_ids", "targets", "doc_ids", "positions", "loss_mask"):
            assert torch.equal(torch.cat([getattr(p, f) for p in parts]), getattr(expected, f)), (step, f)
    assert ranks[0].state_dict() == ranks[1].state_dict() == whole.state_dict()  # one data position for all ranks
    with pytest.raises(ValueError):
        SFTPacker(examples, seq_len=48, batch_size=3, seed=2, shard=(0, 2))


def test_packer_on_real_instruction_data(tok):
    examples = [render(r, tok) for r in load_records(INSTRUCTIONS)[:200]]
    b = next(SFTPacker(examples, seq_len=512, batch_size=2, seed=0))
    answers = b.targets[b.loss_mask]
    assert (answers == tok.eot_id).sum() >= 2 and b.loss_mask.float().mean() > 0.1


# ---------------------------------------------------------------------- offline defaults


def test_default_corpus_and_instructions_are_deterministic_and_usable(tok):
    corpus, records = default_corpus(), default_instructions()
    assert corpus == default_corpus() and records == default_instructions()
    size = sum(len(d.encode()) for d in corpus)
    assert 300_000 < size < 5_000_000 and len(corpus) >= 100
    assert any("assert" in d and "AssertionError" in d for d in corpus)  # a pydoc topic
    assert 1000 <= len(records) <= 10000
    for i, r in enumerate(records):
        to_messages(r, f"default record {i}")
        assert r["output"].strip() and set(r) == {"instruction", "input", "output"}
    assert any(r["instruction"] == "What does `json.dumps` do?" for r in records)
    zip_answers = {r["output"] for r in records if r["instruction"] in ("What does `zip` do?", "What does the zip function do?")}
    assert len(zip_answers) == 1 and "tuple" in zip_answers.pop()  # both phrasings, one answer
    ids, mask = render(records[0], tok)
    assert sum(mask) > 1
