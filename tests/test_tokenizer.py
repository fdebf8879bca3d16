"""Tokenizer: BPE and char-level construction, save/load (also through HF), chat templates, streaming decode."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoforge.errors import NanoforgeError
from nanoforge.tokenizer import CHATML_TEMPLATE, ENDOFTEXT, IM_END, IM_START, IncrementalDecoder, Tokenizer
from conftest import SHARED_DATA

SHAKESPEARE = str(SHARED_DATA / "tinyshakespeare.txt")

# Mixed scripts, emoji (4-byte UTF-8, some as multi-codepoint sequences), tabs and runs of spaces.
SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café — déjà vu; Größe, Straße; 日本語のテキスト; 한국어; Ελληνικά; עברית",
    "emoji: 😀 🚀 👩‍👩‍👧 🇫🇷 and a thumbs up 👍🏽!",
    "code:\n\tdef f(x):\n\t    return x  +  1\n\n\n  trailing   spaces   ",
]


def corpus(n=300):
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from it this be are or an".split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(n)]
    return lines + SAMPLES * 5


@pytest.fixture(scope="module")
def bpe():
    return Tokenizer.train_bpe(corpus(), vocab_size=400)


@pytest.fixture(scope="module")
def shakespeare():
    with open(SHAKESPEARE, encoding="utf-8") as f:
        return f.read()


def test_bpe_roundtrip_and_special_ids(bpe):
    assert bpe.vocab_size == 400
    assert (bpe.eos_id, bpe.eot_id) == (0, 2)  # <|endoftext|>, <|im_start|>, <|im_end|> come first
    assert bpe.stop_ids == {0, 2}
    for text in SAMPLES:
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    # Training learned merges: common words are single tokens, so text compresses.
    assert len(bpe.encode("the of and to in")) < len("the of and to in") / 2


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_bpe_roundtrips_any_unicode(text):
    tok = _BPE_FOR_HYPOTHESIS
    assert tok.decode(tok.encode(text)) == text


_BPE_FOR_HYPOTHESIS = Tokenizer.train_bpe(corpus(50), vocab_size=300)


def test_special_strings_in_text_stay_text_unless_allowed(bpe):
    text = f"a{ENDOFTEXT}b{IM_END}"
    plain = bpe.encode(text)
    assert bpe.eos_id not in plain and bpe.eot_id not in plain
    assert bpe.decode(plain) == text
    special = bpe.encode(text, allow_special=True)
    assert special.count(bpe.eos_id) == 1 and special[-1] == bpe.eot_id
    assert bpe.decode(special, skip_special=True) == "ab"


def test_bpe_rejects_too_small_vocab():
    with pytest.raises(NanoforgeError, match="at least 259"):
        Tokenizer.train_bpe(["abc"], vocab_size=100)


def test_char_level_matches_nanogpt_mapping(shakespeare):
    tok = Tokenizer.char_level(shakespeare)
    chars = sorted(set(shakespeare))  # nanoGPT's data/shakespeare_char/prepare.py
    stoi = {c: i for i, c in enumerate(chars)}
    assert len(chars) == 65 and tok.vocab_size == 68
    assert [tok.backend.token_to_id(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [65, 66, 67]
    assert (tok.eos_id, tok.eot_id) == (65, 67)
    piece = shakespeare[:20000]
    assert tok.encode(piece) == [stoi[c] for c in piece]
    assert tok.decode(tok.encode(piece)) == piece
    assert tok.encode("hi" + ENDOFTEXT, allow_special=True) == [stoi["h"], stoi["i"], 65]


def test_char_level_unknown_character_is_a_clear_error(shakespeare):
    tok = Tokenizer.char_level(shakespeare)
    with pytest.raises(NanoforgeError, match=r"outside the tokenizer's vocabulary: \['€'\]"):
        tok.encode("price: 3€")
    with pytest.raises(NanoforgeError, match="empty"):
        Tokenizer.char_level("")


def test_chatml_template_matches_hand_built_string(bpe):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!\nHow are you?"}, {"role": "assistant", "content": "Fine."}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!\nHow are you?<|im_end|>\n<|im_start|>assistant\nFine.<|im_end|>\n"
    assert bpe.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert bpe.apply_chat_template(messages[:2]) == expected[: expected.index("Fine.")]
    ids = bpe.encode_chat(messages[:2])
    assert ids.count(bpe.backend.token_to_id(IM_START)) == 3 and ids.count(bpe.eot_id) == 2
    assert bpe.decode(ids) == bpe.apply_chat_template(messages[:2])


def test_chat_template_rejects_malformed_messages(bpe):
    with pytest.raises(NanoforgeError, match=r"messages\[1\]"):
        bpe.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant"}])


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_save_load_and_hf_give_same_ids(kind, bpe, shakespeare, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = bpe if kind == "bpe" else Tokenizer.char_level(shakespeare)
    texts = SAMPLES if kind == "bpe" else [shakespeare[:3000], "To be, or not to be?"]
    tok.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    from_file = Tokenizer.load(tmp_path / "tokenizer.json")
    hf_file = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    hf_auto = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in texts:
        ids = tok.encode(text)
        assert loaded.encode(text) == ids == from_file.encode(text)
        assert hf_file.encode(text, add_special_tokens=False) == ids
        assert hf_auto.encode(text, add_special_tokens=False) == ids
    assert (loaded.eos_id, loaded.eot_id, loaded.vocab_size, loaded.chat_template) == (tok.eos_id, tok.eot_id, tok.vocab_size, CHATML_TEMPLATE)
    assert hf_auto.eos_token_id == tok.eot_id  # like Qwen: eos in the config is the end of a turn
    messages = [{"role": "user", "content": "Speak, speak."}, {"role": "assistant", "content": "Resolved."}]
    for gen in (True, False):
        assert hf_auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == loaded.apply_chat_template(messages, gen)


# A Llama-3-style template: BOS, header tokens, stripped contents, raise_exception.
LLAMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def test_hf_style_config_template_and_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    base = Tokenizer.train_bpe(corpus(50), vocab_size=300)
    base.backend.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    base.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(chat_template=LLAMA_STYLE_TEMPLATE, bos_token="<|begin_of_text|>", eos_token={"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))

    tok = Tokenizer.load(tmp_path)
    eot = tok.backend.token_to_id("<|eot_id|>")
    assert (tok.eot_id, tok.eos_id, tok.bos_id) == (eot, 0, tok.backend.token_to_id("<|begin_of_text|>"))
    assert {0, eot} <= tok.stop_ids
    messages = [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "Hello"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert rendered == AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(NanoforgeError, match="bad role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_load_errors_name_the_file(tmp_path, bpe):
    with pytest.raises(NanoforgeError, match="not found"):
        Tokenizer.load(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')  # truncated
    with pytest.raises(NanoforgeError, match=r"tokenizer\.json is not a valid tokenizer\.json"):
        Tokenizer.load(tmp_path)
    bpe.save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(NanoforgeError, match=r"tokenizer_config\.json is not valid JSON"):
        Tokenizer.load(tmp_path)


def _stream(tok, ids):
    decoder = IncrementalDecoder(tok, skip_special=False)
    pieces = [decoder.push(i) for i in ids]
    return pieces, pieces + [decoder.flush()]


def test_incremental_decoder_never_splits_characters(bpe):
    text = "Héllo 😀 wörld 👩‍👩‍👧 日本語 🇫🇷!" + IM_END
    ids = bpe.encode(text, allow_special=True)
    pieces, with_flush = _stream(bpe, ids)
    assert "".join(with_flush) == bpe.decode(ids) == text
    assert with_flush[-1] == ""  # nothing held back once the text is complete
    assert not any("\ufffd" in p for p in pieces)
    # The emoji really are split across byte tokens: some pushes had to wait.
    assert len(ids) > len([p for p in pieces if p])


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_incremental_decoder_matches_full_decode(text):
    tok = _BPE_FOR_HYPOTHESIS
    ids = tok.encode(text)
    pieces, with_flush = _stream(tok, ids)
    assert "".join(with_flush) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_flushes_an_incomplete_character(bpe):
    ids = bpe.encode("a😀")
    decoder = IncrementalDecoder(bpe)
    assert [decoder.push(i) for i in ids[:-1]][0] == "a"  # the emoji's last byte is missing
    assert decoder.flush() == bpe.decode(ids[:-1])[1:]  # the held-back bytes, as U+FFFD
