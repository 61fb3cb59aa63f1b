"""The checkpoint's tokenizer: tokenizer.json / tokenizer_config.json behind mlx-lm's
TokenizerWrapper, with the V4.1 chat format as its chat template, the end-of-turn stop ids, and a
byte-exact streaming detokenizer that never emits half a UTF-8 character.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

# mlx-lm first: it silences transformers' advisory warnings (no PyTorch, model type) on import.
from mlx_lm.tokenizer_utils import (NaiveStreamingDetokenizer, StreamingDetokenizer,
                                    TokenizerWrapper)

from . import format as cf
from ..errors import CheckpointError

# Tokens the renderer emits for a plain conversation; each must be one token of the vocabulary.
CHAT_TOKENS = (cf.BOS, cf.EOS, cf.SYSTEM, cf.USER, cf.ASSISTANT, cf.THINK_START, cf.THINK_END)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ByteLevelStreamingDetokenizer(StreamingDetokenizer):
    """Streaming detokenizer for byte-level BPE: each token adds its bytes to an incremental
    UTF-8 decoder, which holds back an incomplete character until its last byte arrives (and
    replaces invalid bytes with U+FFFD). Linear in the number of tokens; special tokens add their
    own text. `text` equals the tokenizer's decode with special tokens kept."""

    def __init__(self, tokenizer):
        char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.token_bytes = [
            added[i].encode() if i in added else
            b"".join(bytes([char_to_byte[c]]) if c in char_to_byte else c.encode() for c in p)
            for i, p in enumerate(pieces)]
        self.reset()

    def reset(self):
        self.offset = 0
        self.tokens = []
        self.text = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add_token(self, token):
        self.tokens.append(token)
        # Ids past the tokenizer (padded embedding rows) have no text.
        piece = self.token_bytes[token] if token < len(self.token_bytes) else b""
        self.text += self._decoder.decode(piece)

    def finalize(self):
        self.text += self._decoder.decode(b"", final=True)


def apply_chat_template(messages, tools=None, add_generation_prompt=True,
                        continue_final_message=False, enable_thinking=True,
                        reasoning_effort=None, *, tokenize=False, return_dict=False):
    """mlx-lm's chat-template call, rendered by `chat_format.encode_messages`.

    `enable_thinking` picks thinking or chat mode; `tools` go into the first system message
    (one is added when there is none); `continue_final_message` leaves the last assistant turn
    open. Any other keyword is a TypeError, so a misspelling cannot silently give a default.
    `tokenize` and `return_dict` are taken as mlx-lm's callers pass them (False): the result
    is text, which the `Tokenizer` wrapper tokenizes.
    """
    if tokenize:
        raise ValueError("apply_chat_template: tokenize=True needs the Tokenizer "
                         "(tokenizer.apply_chat_template); this function returns text")
    if return_dict:
        raise ValueError("apply_chat_template: return_dict=True is not supported (the result "
                         "is text, or token ids through the Tokenizer)")
    messages = [dict(m) for m in messages]
    if tools:
        if not messages or messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0]["tools"] = list(tools)
    if continue_final_message and messages and messages[-1].get("role") == "assistant":
        messages[-1]["wo_eos"] = True
    text = cf.encode_messages(messages, "thinking" if enable_thinking else "chat",
                              reasoning_effort)
    if not add_generation_prompt and messages and messages[-1].get("role") == "user":
        for header in (cf.ASSISTANT + cf.THINK_START, cf.ASSISTANT + cf.THINK_END):
            text = text.removesuffix(header)
    return text


class Tokenizer(TokenizerWrapper):
    """mlx-lm's TokenizerWrapper for a V4.1 checkpoint (`load_tokenizer`).

    `eos_token_ids` holds EOS and the chat format's end-of-turn ids; `missing_chat_tokens` lists
    chat tokens the vocabulary lacks (then only raw prompts can be used).
    """

    def __init__(self, tokenizer, detokenizer_class, eos_token_ids):
        super().__init__(tokenizer, detokenizer_class, eos_token_ids=eos_token_ids,
                         chat_template=apply_chat_template)
        vocab = tokenizer.get_vocab()
        self._missing = [t for t in CHAT_TOKENS if t not in vocab
                         or tokenizer.encode(t, add_special_tokens=False) != [vocab[t]]]

    @property
    def missing_chat_tokens(self) -> list:
        return list(self._missing)

    def encode_prompt(self, text: str, add_bos: bool = True) -> list:
        """Token ids of a prompt text, special tokens matched as single tokens. With `add_bos`,
        BOS is put first unless the text already starts with it (a rendered chat prompt does)."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        bos = self._tokenizer.convert_tokens_to_ids(cf.BOS)
        if add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def encode_chat(self, messages, thinking: bool, reasoning_effort=None) -> list:
        """Render `messages` with the V4.1 chat format and tokenize them."""
        if self._missing:
            raise ValueError(f"the tokenizer has no single token for {self._missing[0]}, so it "
                             "cannot encode the chat format; use a raw prompt")
        return self.apply_chat_template(messages, enable_thinking=thinking,
                                        reasoning_effort=reasoning_effort)


def _is_byte_level(tokenizer_json: Path) -> bool:
    decoder = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    return "ByteLevel" in kinds


def load_tokenizer(folder, eos_token_ids=()) -> Tokenizer:
    """The tokenizer of a model folder (tokenizer.json, optionally tokenizer_config.json).

    Args:
        folder: the model folder.
        eos_token_ids: extra stop ids (e.g. the config's `eos_token_id`); EOS and the chat
            format's end-of-turn tokens are always included.
    Raises:
        CheckpointError: tokenizer.json is missing or unreadable.
    """
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: tokenizer.json not found (the model folder needs the "
                              "published tokenizer files)")
    try:
        hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
        is_byte_level = _is_byte_level(path)
    except Exception as e:  # tokenizers/transformers raise bare Exceptions on bad files
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: not a readable tokenizer ({message})") from None
    vocab = hf.get_vocab()
    # END_OF_TURN_TOKENS are ids of the published vocabulary: map them by their text.
    names = {i: t for t, i in cf.SPECIAL_TOKEN_IDS.items()}
    turn_ends = (names[i] for i in cf.END_OF_TURN_TOKENS)
    stops = {vocab[t] for t in turn_ends if t in vocab} | {int(i) for i in eos_token_ids}
    detokenizer = ByteLevelStreamingDetokenizer if is_byte_level else NaiveStreamingDetokenizer
    return Tokenizer(hf, detokenizer, sorted(stops))
