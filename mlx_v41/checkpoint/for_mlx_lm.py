"""mlx-lm's entry into a converted folder. `mlx_v41.convert` writes `ENTRY_FILE` into the folder
and names it in config.json (`model_file`) and in tokenizer_config.json (`auto_map`), so that
mlx-lm's commands run with `--trust-remote-code` load this module's `Model`, which hands the
folder to `load_model` (Engram memory-mapped, experts under the memory plan), and its tokenizer,
which renders the V4.1 chat format.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Optional

import mlx.nn as nn
from transformers import PreTrainedTokenizerFast

from ..chat.tokenizer import apply_chat_template
from .load import load_model

ENTRY_FILE = "mlx_v41_model.py"  # config.json "model_file"
TOKENIZER_CLASS = "V41TokenizerFast"
OPTIONS_KEY = "mlx_v41"  # config key (set through mlx_lm.load's model_config) of load options
# mlx-lm cannot use these parts: its commands never feed images or DSpark drafts to the model.
DEFAULT_OPTIONS = {"dspark": False, "vision": False}
# `load_model` keywords an mlx-lm load may not set: it reads its own folder, in one process.
FIXED_OPTIONS = ("path", "placement")

ENTRY_SOURCE = f'''"""mlx-lm's entry into this folder (config.json "model_file",
tokenizer_config.json "auto_map"): run mlx-lm's commands with --trust-remote-code and mlx_v41
loads and runs the model (Engram tables memory-mapped, experts under its memory plan) and
renders the V4.1 chat format."""

from mlx_v41.checkpoint.for_mlx_lm import Model, {TOKENIZER_CLASS}, folder_args  # noqa: F401

ModelArgs = folder_args(__file__)
'''


def entry_config(config: dict) -> dict:
    """config.json of a converted folder, naming the entry file for mlx-lm."""
    return {**config, "model_file": ENTRY_FILE}


def entry_tokenizer_config(tokenizer_config: Optional[bytes]) -> bytes:
    """tokenizer_config.json (the source's, or a minimal one) naming the entry file's tokenizer
    class, which transformers loads when asked to trust remote code (and ignores otherwise)."""
    config = json.loads(tokenizer_config) if tokenizer_config else {
        "tokenizer_class": "PreTrainedTokenizerFast"}
    stem = ENTRY_FILE.removesuffix(".py")
    config["auto_map"] = {"AutoTokenizer": [None, f"{stem}.{TOKENIZER_CLASS}"]}
    return json.dumps(config, indent=2, ensure_ascii=False).encode()


class ModelArgs:
    """What mlx-lm builds `Model` from: the folder and `load_model`'s keyword options."""

    folder: Optional[Path] = None  # set for one folder by `folder_args`

    def __init__(self, options: dict):
        self.options = options

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        if cls.folder is None:
            raise ValueError("ModelArgs has no folder: mlx-lm must load it through the folder's "
                             f"{ENTRY_FILE}")
        return cls({**DEFAULT_OPTIONS, **_checked_options(config.get(OPTIONS_KEY) or {})})


def folder_args(entry_file) -> type:
    """`ModelArgs` for the folder holding `entry_file` (the entry file passes its `__file__`)."""
    return type("ModelArgs", (ModelArgs,), {"folder": Path(entry_file).resolve().parent})


def _checked_options(options: dict) -> dict:
    allowed = set(inspect.signature(load_model).parameters) - set(FIXED_OPTIONS)
    if not isinstance(options, dict):
        raise ValueError(f"{OPTIONS_KEY}: expected a dict of load_model options, got "
                         f"{type(options).__name__}")
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"{OPTIONS_KEY}.{unknown[0]}: not a load_model option (one of "
                         f"{', '.join(sorted(allowed))})")
    return dict(options)


class Model(nn.Module):
    """mlx_v41's model behind mlx-lm's interface: `model(inputs, cache=...)` gives the logits of
    every position, `make_cache()` our caches as `PromptCacheLayer`s.

    mlx-lm builds it, passes the folder's weights through `sanitize` (which drops them unread)
    and calls `load_weights`, which loads the folder with `load_model` instead."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args

    def sanitize(self, weights: dict) -> dict:
        return {}  # mlx.core.load is lazy: dropping them reads nothing

    def load_weights(self, file_or_weights, strict: bool = True) -> "Model":
        if "v41" in self or isinstance(file_or_weights, str) or len(file_or_weights):
            raise ValueError("mlx_v41 loads this model's weights from its folder and takes no "
                             "others (mlx-lm adapters are not supported)")
        self.v41 = load_model(self.args.folder, **self.args.options)
        return self

    def __call__(self, inputs, cache: Optional[list] = None):
        layers = None if cache is None else [c.layer for c in cache]
        return self.v41(inputs, cache=layers)

    @property
    def layers(self) -> list:
        return self.v41.model.layers

    def make_cache(self) -> list:
        return [PromptCacheLayer(c) for c in self.v41.make_cache()]


class PromptCacheLayer:
    """One `LayerCache` as mlx-lm's generation and prompt-cache helpers use it.

    `is_trimmable` says whether any trim is exact, as mlx-lm's rotating cache does: our rings
    undo a bounded number of tokens, and mlx-lm's prompt-cache store trims without reading the
    count back, so a partial trim would leave it a cache longer than it thinks."""

    def __init__(self, layer):
        self.layer = layer

    @property
    def offset(self) -> int:
        return self.layer.offset

    @property
    def state(self) -> list:
        return self.layer.state

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes

    def is_trimmable(self) -> bool:
        return self.layer.max_trim() == self.layer.offset

    def trim(self, n: int) -> int:
        return self.layer.trim(n)


class V41TokenizerFast(PreTrainedTokenizerFast):
    """The folder's tokenizer with the V4.1 chat format as its chat template (mlx-lm takes a
    tokenizer class that overrides `apply_chat_template` as one that has a template); the
    keywords' defaults are transformers'."""

    def apply_chat_template(self, conversation, tools=None, add_generation_prompt=False,
                            continue_final_message=False, enable_thinking=True,
                            reasoning_effort=None, tokenize=True, return_dict=False):
        text = apply_chat_template(conversation, tools=tools,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   enable_thinking=enable_thinking,
                                   reasoning_effort=reasoning_effort, return_dict=return_dict)
        return self.encode(text, add_special_tokens=False) if tokenize else text
