"""Tokenizers: one `Tokenizer` class over a Hugging Face `tokenizers.Tokenizer`.

Whatever the vocabulary (a byte-level BPE trained here, nanoGPT's
character-level Shakespeare, or a GPT-2 / Llama 3 / Qwen `tokenizer.json`), it
is held by the `tokenizers` library, so saving is always `tokenizer.json` plus
`tokenizer_config.json` and Hugging Face's `AutoTokenizer` can read ours.

Three special tokens matter:
  - end of text (`eos_id`): separates documents in pretraining data;
  - end of turn (`eot_id`): closes a chat message, e.g. `<|im_end|>`; the
    assistant's answer is trained to end with it and generation stops at it;
  - begin of text (`bos_id`, often None): Llama 3's templates write it themselves.

Our own tokenizers use ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`) and
save it as `chat_template`, so HF's `apply_chat_template` renders the same text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from nanoforge.errors import NanoforgeError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHAT_ROLES = ("system", "user", "assistant")  # the roles of the chats nanoforge trains on and serves (no tools)

# ChatML, written the way HF chat templates are, so it can be saved and reused.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# End-of-text spellings of the model families we load (GPT-2/Qwen, Llama 3, SentencePiece).
_END_OF_TEXT_NAMES = (ENDOFTEXT, "<|end_of_text|>", "</s>")
# Tokens that end generation when they exist in a vocabulary (ChatML, Llama 3 turn ends).
_STOP_NAMES = (*_END_OF_TEXT_NAMES, IM_END, "<|eot_id|>", "<|eom_id|>")


def _token_content(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class UnknownCharacters(NanoforgeError):
    """Text holding characters that the vocabulary cannot encode (a character-level vocabulary has no
    unknown token); `chars` lists them."""

    def __init__(self, chars: list[str]):
        super().__init__(f"cannot tokenize the text: characters outside the tokenizer's vocabulary: {chars[:10]!r}")
        self.chars = chars


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token: str,
        eot_token: str | None = None,
        bos_token: str | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.eos_token = eos_token
        self.eot_token = eot_token or eos_token
        self.bos_token = bos_token
        self.chat_template = chat_template or CHATML_TEMPLATE
        for name in (self.eos_token, self.eot_token, self.bos_token):
            if name is not None and backend.token_to_id(name) is None:
                raise NanoforgeError(f"special token {name!r} is not in the tokenizer's vocabulary")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """Train a GPT-2-style byte-level BPE; ids 0..2 are the special tokens."""
        minimum = 256 + len(SPECIAL_TOKENS)
        if vocab_size < minimum:
            raise NanoforgeError(f"BPE vocab_size must be at least {minimum} (256 bytes + special tokens), not {vocab_size}")
        backend = tokenizers.Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
            show_progress=True,  # a bar on the terminal for large corpora
        )
        backend.train_from_iterator(texts, trainer)
        return cls(backend, eos_token=ENDOFTEXT, eot_token=IM_END)

    @classmethod
    def char_level(cls, text: str) -> Tokenizer:
        """nanoGPT's character tokenizer: id i is the i-th of sorted(set(text)).

        The special tokens come after the characters, so Tiny Shakespeare's 65
        characters keep ids 0..64. A character that is not in the vocabulary
        cannot be encoded: `encode` raises NanoforgeError naming it (no unk token).
        """
        chars = sorted(set(text))
        if not chars:
            raise NanoforgeError("cannot build a character-level tokenizer from empty text")
        backend = tokenizers.Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}))
        # Every character is its own word ([\s\S] matches newlines too); decoding concatenates.
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens(list(SPECIAL_TOKENS))
        return cls(backend, eos_token=ENDOFTEXT, eot_token=IM_END)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load a model directory (with tokenizer.json) or a tokenizer.json file.

        tokenizer_config.json (or special_tokens_map.json) beside it supplies
        eos/bos tokens and the chat template when present, as Hugging Face does.
        """
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise NanoforgeError(f"tokenizer file not found: {file}", param="tokenizer")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:
            raise NanoforgeError(f"{file} is not a valid tokenizer.json: {str(e).splitlines()[0]}", param="tokenizer") from e
        folder = file.parent
        config: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
            if (folder / name).is_file():
                config.update(_read_json(folder / name))
        template = config.get("chat_template")
        if isinstance(template, list):  # HF's named templates: [{"name": ..., "template": ...}]
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        if template is None and (folder / "chat_template.jinja").is_file():  # transformers >= 4.50 layout
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")

        def present(name: str | None) -> str | None:
            return name if name is not None and backend.token_to_id(name) is not None else None

        config_eos = present(_token_content(config.get("eos_token")))
        # End of text: the vocabulary's own spelling, else whatever the config calls eos.
        eos = next((n for n in _END_OF_TEXT_NAMES if present(n)), None) or config_eos
        if eos is None:
            raise NanoforgeError(f"{file} has no end-of-text token ({', '.join(_END_OF_TEXT_NAMES)}) and no eos_token in tokenizer_config.json")
        # End of turn: chat models name it as their eos (Qwen: <|im_end|>, Llama 3: <|eot_id|>).
        eot = config_eos or present(IM_END) or eos
        return cls(backend, eos_token=eos, eot_token=eot, bos_token=present(_token_content(config.get("bos_token"))), chat_template=template)

    def to_dict(self) -> dict:
        """Everything that makes this tokenizer, as JSON-able values (`from_dict` rebuilds it exactly)."""
        return {"tokenizer_json": self.backend.to_str(), "eos_token": self.eos_token, "eot_token": self.eot_token,
                "bos_token": self.bos_token, "chat_template": self.chat_template}

    @classmethod
    def from_dict(cls, d: dict) -> Tokenizer:
        """The tokenizer that `to_dict` described."""
        return cls(tokenizers.Tokenizer.from_str(d["tokenizer_json"]), eos_token=d["eos_token"],
                   eot_token=d["eot_token"], bos_token=d["bos_token"], chat_template=d["chat_template"])

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (loadable by HF AutoTokenizer)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            # Like Qwen: eos is the end of a turn, and end of text doubles as padding.
            "eos_token": self.eot_token,
            "pad_token": self.eos_token,
            "bos_token": self.bos_token,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    # ------------------------------------------------------------------ encode / decode

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self.backend.token_to_id(self.eos_token)

    @property
    def eot_id(self) -> int:
        return self.backend.token_to_id(self.eot_token)

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: end of text, end of turn, and known turn ends in the vocabulary."""
        ids = {self.backend.token_to_id(name) for name in _STOP_NAMES}
        return frozenset(ids - {None} | {self.eos_id, self.eot_id})

    @functools.cached_property
    def _literal_backend(self) -> tokenizers.Tokenizer:
        """A copy that reads special-token strings as plain text (for untrusted text)."""
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`, as a piece of a longer sequence: special-token strings become special ids
        only if allowed, and nothing is added around it (no BOS). A prompt is `encode_prompt`'s."""
        return self.encode_batch([text], allow_special=allow_special)[0]

    def encode_batch(self, texts: Sequence[str], *, allow_special: bool = False) -> list[list[int]]:
        """`encode` for many texts at once (the tokenizers library runs them in parallel)."""
        return [e.ids for e in self._encode(texts, allow_special=allow_special, add_special_tokens=False)]

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids exactly as the model's own tokenizer makes them, i.e. `tokenizer(text)` in
        transformers: special-token strings are read as special tokens, and the post-processor of
        tokenizer.json adds what the model expects around a sequence (Llama 3's adds <|begin_of_text|>;
        GPT-2's and Qwen's add nothing, whatever tokenizer_config.json calls a BOS token). Every front door
        (`generate`, `LLM`, the server, `bench serve`) encodes prompt text with this."""
        return self.encode_prompt_batch([text])[0]

    def encode_prompt_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._encode(texts, allow_special=True, add_special_tokens=True)]

    def encode_with_offsets(self, text: str, *, allow_special: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids plus each token's (start, end) character span in `text`."""
        encoding = self._encode([text], allow_special=allow_special, add_special_tokens=False)[0]
        return encoding.ids, encoding.offsets

    def _encode(self, texts: Sequence[str], *, allow_special: bool, add_special_tokens: bool) -> list:
        backend = self.backend if allow_special else self._literal_backend
        try:
            return backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        except Exception as e:  # vocabularies without an unk token (char-level) fail on unknown characters
            unknown = self.unknown_characters(texts, allow_special=allow_special)
            if not unknown:
                raise  # not the text's fault: keep the traceback
            raise UnknownCharacters(unknown) from e

    def unknown_characters(self, texts: Sequence[str], *, allow_special: bool = True) -> list[str]:
        """Characters of `texts` that a vocabulary without an unknown token (character-level) cannot encode,
        sorted; those inside special-token strings (a chat template's markup) are not counted when those
        strings are read as special tokens."""
        if allow_special:
            for token in self.backend.get_added_tokens_decoder().values():
                texts = [t.replace(token.content, "") for t in texts]
        return sorted({c for t in texts for c in set(t) if self.backend.token_to_id(c) is None})

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    # ------------------------------------------------------------------ chat

    @functools.cached_property
    def _compiled_template(self):
        return _jinja_env().from_string(self.chat_template)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Render messages ([{"role": ..., "content": ...}]) as the model's prompt text."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise NanoforgeError(f"messages[{i}] must be an object with string 'role' and 'content'", param="messages")
        from jinja2 import TemplateError

        try:
            return self._compiled_template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eot_token,  # what HF calls eos_token in a chat model's config
                pad_token=self.eos_token,
            )
        except TemplateError as e:  # templates reject e.g. roles that do not alternate
            raise NanoforgeError(f"chat template rejected the messages: {e}", param="messages") from e

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat. As in HF, special-token strings inside message
        contents are read as special tokens too (the template's markup needs them)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), allow_special=True)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NanoforgeError(f"{path} is not valid JSON: {e}", param="tokenizer") from e
    if not isinstance(data, dict):
        raise NanoforgeError(f"{path} must hold a JSON object", param="tokenizer")
    return data


@functools.cache
def _jinja_env():
    """A sandboxed jinja2 environment configured like transformers' chat-template renderer."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of text, for servers.

    A byte-level token can hold part of a UTF-8 character (an emoji is often
    2-4 tokens). We keep a short window of ids: `push` decodes the window with
    and without the new ids and returns the difference, but only once the text
    no longer ends in U+FFFD (an incomplete character); then the window slides.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: text before it has been emitted and is final
        self.read_offset = 0  # ids before this have been emitted as text

    def _pending(self) -> tuple[str, str]:
        window = self.ids[self.prefix_offset :]
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        return prefix, self.tokenizer.decode(window, self.skip_special)

    def _advance(self, prefix: str, full: str) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self.ids.append(token_id)
        prefix, full = self._pending()
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            return self._advance(prefix, full)
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (at the end of generation)."""
        return self._advance(*self._pending())
