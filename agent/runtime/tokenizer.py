"""Tokenizer with the model's own chat template, stop tokens and streaming detokenisation.

A chat prompt ends either with the template's generation prompt (a new assistant turn begins) or,
to continue an answer, with the final assistant message left open: the template's text up to
where that message's content begins, then the content as it was sent, and no end-of-turn marker
after it (:func:`open_final_message`), so that the model goes on with the same answer.

A token's bytes (:meth:`ChatTokenizer.token_bytes`: what a client is told of each token whose
log-probability it asked for) are read from its vocabulary entry as the tokenizer spells it
(:func:`piece_bytes`), so a token that holds part of a character still has its own bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_END_MARKERS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "</s>",
    "<|eom_id|>",
)

# what stands for the final message's content while the template renders: where it shows, the
# content begins (the template may wrap it in anything, but must show it)
OPEN_MARK = "LAKESHARD-OPEN-ANSWER-5f0c"


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: a byte-level BPE vocabulary spells each byte
    with one printable character (printable Latin-1 bytes as themselves, the rest from U+0100)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_CHARS = _byte_alphabet()
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def piece_bytes(piece: str, scheme: str | None) -> bytes | None:
    """A vocabulary entry's bytes, as its tokenizer spells them: ``byte_level`` (byte-level BPE:
    GPT-2's alphabet, :data:`BYTE_CHARS`) or ``sentencepiece`` (a space as ``▁``, a byte without
    a piece of its own as ``<0xAB>``); None when the scheme is unknown or the entry is not
    spelled in it."""
    if scheme == "byte_level":
        return bytes(BYTE_CHARS[c] for c in piece) if all(c in BYTE_CHARS for c in piece) else None
    if scheme == "sentencepiece":
        m = _SP_BYTE.match(piece)
        return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
    return None


def spelling(tok: Any, vocab: dict[str, int]) -> str | None:
    """How a tokenizer spells its tokens' bytes: ``byte_level`` or ``sentencepiece`` (see
    :func:`piece_bytes`), from its decoder where it is a fast one, else from its vocabulary;
    None when neither."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
        if '"ByteLevel"' in decoder:
            return "byte_level"
        if '"ByteFallback"' in decoder or '"Metaspace"' in decoder:
            return "sentencepiece"
    if sum(c in vocab for c in BYTE_CHARS) > 200:  # most of GPT-2's byte alphabet: byte-level BPE
        return "byte_level"
    return "sentencepiece" if "<0x00>" in vocab else None


class NotContinuable(ValueError):
    """The conversation has no final assistant message to go on with, or the chat template does
    not show that message's content (it leaves it out, or rewrites it)."""


def open_final_message(
    render: Callable[[list[dict[str, str]]], str], messages: Sequence[dict[str, str]]
) -> tuple[str, str]:
    """The prompt that continues the final (assistant) message of ``messages``, in two parts: the
    template's text before that message's content, and the content as sent (never trimmed by
    the template: the model goes on after exactly what it said). ``render`` is the chat template
    applied to messages without a generation prompt. Raises :class:`NotContinuable`."""
    if not messages or messages[-1].get("role") != "assistant":
        raise NotContinuable("the last message must be the assistant's: the answer to continue")
    text = render([*messages[:-1], {**messages[-1], "content": OPEN_MARK}])
    at = text.rfind(OPEN_MARK)
    if at < 0:
        raise NotContinuable("this model's chat template does not show the final assistant message")
    return text[:at], messages[-1]["content"]


class ChatTokenizer:
    def __init__(self, tokenizer_dir: Path, config_path: Path | None = None) -> None:
        from transformers import AutoTokenizer

        self.tok: Any = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        stops: set[int] = set()
        if self.tok.eos_token_id is not None:
            stops.add(int(self.tok.eos_token_id))
        if config_path is not None and config_path.is_file():
            eos = json.loads(config_path.read_text()).get("eos_token_id")
            stops.update(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
        vocab = self.tok.get_vocab()
        stops.update(vocab[m] for m in _END_MARKERS if m in vocab)
        self.stop_ids = frozenset(stops)
        special = set(getattr(self.tok, "all_special_tokens", ())) | set(self.tok.get_added_vocab())
        # the most characters one token can cover (byte-level BPE and SentencePiece keys spell
        # a token's text one character per byte or character): a bound for ``min_tokens``
        self.max_token_chars = max((len(k) for k in vocab if k not in special), default=1) or 1
        self._special = special
        self._scheme = spelling(self.tok, vocab)
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token's text (part of a character's, for a token that splits one);
        a special token's are its name's."""
        got = self._bytes.get(token_id)
        if got is None:
            piece = str(self.tok.convert_ids_to_tokens(int(token_id)))
            got = piece.encode() if piece in self._special else piece_bytes(piece, self._scheme)
            if got is None:  # a tokenizer whose spelling is not known here: the token decoded alone
                got = str(self.tok.decode([int(token_id)])).encode()
            if len(self._bytes) < 1 << 18:
                self._bytes[token_id] = got
        return got

    def min_tokens(self, messages: Sequence[dict[str, str]]) -> int:
        """A lower bound on ``len(chat_ids(messages))``, at once: to refuse a huge prompt untokenized."""
        return sum(len(m.get("content", "")) for m in messages) // self.max_token_chars

    def chat_ids(self, messages: Sequence[dict[str, str]], continue_final: bool = False) -> list[int]:
        """The prompt's ids: ``messages`` through the chat template, ending with its generation
        prompt, or (``continue_final``) with the final assistant message left open. The open
        message's content is tokenized on its own, as the model's tokens followed the template's
        (the ids begin as those of the conversation before it, with its generation prompt)."""
        if continue_final:
            prefix, content = open_final_message(self._render, messages)
            return self.encode(prefix) + self.encode(content)
        if self.tok.chat_template:
            out = self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return [int(i) for i in ids]
        return self.encode(_plain(messages) + "\nassistant:")

    def _render(self, messages: list[dict[str, str]]) -> str:
        """``messages`` as the prompt's text, without a generation prompt."""
        if self.tok.chat_template:
            return str(self.tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False))
        return _plain(messages)

    def text_ids(self, text: str) -> list[int]:
        """A raw prompt's ids (a legacy completion's: no chat template), begun as the model's
        tokenizer begins a text (its BOS token, where it has one)."""
        return [int(i) for i in self.tok.encode(text, add_special_tokens=True)]

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


def _plain(messages: Sequence[dict[str, str]]) -> str:
    """A conversation as text, for a model without a chat template."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


class StreamDecoder:
    """Feed token ids one at a time, get text deltas; holds back incomplete UTF-8 sequences."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def text(self) -> str:
        return self._tok.decode(self._ids)
