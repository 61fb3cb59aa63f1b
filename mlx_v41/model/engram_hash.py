"""Engram addressing: the compressed token map, the prime bucket layout and per-position row ids.

Row ids depend only on token ids and are computed in int64 (products reach ~2^63; never use
float): host-side in numpy (`hash`, checked against the reference's vectors) or as MLX ops inside
the forward (`hash_lazy`). Reference: official inference/engram.py.
"""

import hashlib
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import numpy as np

DEAD = -1  # compressed id of an image-span position; also marks missing history
MULTIPLIER_SEED = 10007  # multipliers of layer L come from numpy default_rng(10007 * L)
INT64_MAX = 2**63 - 1

_CONFIG_KEYS = (
    "engram_layer_ids",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_vocab_size",
    "engram_compressed_vocab_size",
    "engram_pad_token_id",
    "engram_num_embeddings",
)


# --- bucket layout ------------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    if n < 4:
        return n >= 2
    if n % 2 == 0 or n % 3 == 0:
        return False
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


def engram_primes(layer_ids, max_ngram_size: int, n_heads: int, vocab_size: int) -> np.ndarray:
    """Table sizes of every hash column.

    Each (layer, order) restarts the search at ``vocab_size - 1`` and takes the next ``n_heads``
    primes above it that no earlier (layer, order) has used: one global used set, layer-major,
    order-major, head-minor.

    Returns:
        int64 ``[n_layers, max_ngram_size - 1, n_heads]``.
    """
    used = set()
    primes = np.zeros((len(layer_ids), max_ngram_size - 1, n_heads), dtype=np.int64)
    for layer in range(len(layer_ids)):
        for order in range(max_ngram_size - 1):
            candidate = vocab_size - 1
            for head in range(n_heads):
                candidate += 1
                while candidate in used or not _is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                primes[layer, order, head] = candidate
    return primes


def engram_offsets(primes: np.ndarray) -> np.ndarray:
    """First table row of each column: exclusive prefix sum of a layer's flattened primes.

    Returns:
        int64 ``[n_layers, (max_ngram_size - 1) * n_heads]``, column = order-major, head-minor.
    """
    flat = primes.reshape(primes.shape[0], -1)
    return np.cumsum(flat, axis=1) - flat


def engram_multipliers(layer_ids, max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd per-lookback multipliers; the bound keeps ``compressed_id * multiplier < 2^63``.

    The numpy ``default_rng`` stream (SeedSequence -> PCG64) is the contract with the reference.

    Returns:
        int64 ``[n_layers, max_ngram_size]``, index = lookback (0 = current token).
    """
    bound = (INT64_MAX // compressed_vocab_size) // 2
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(MULTIPLIER_SEED * int(layer_id))
        r = rng.integers(low=0, high=bound, size=max_ngram_size, dtype=np.int64)
        rows.append(2 * r + 1)
    return np.stack(rows).astype(np.int64)


def check_num_embeddings(primes: np.ndarray, num_embeddings) -> None:
    """Each layer's table must have exactly as many rows as its primes sum to."""
    expected = [int(s) for s in primes.reshape(primes.shape[0], -1).sum(axis=1)]
    if [int(n) for n in num_embeddings] != expected:
        raise ValueError(
            f"engram_num_embeddings {list(num_embeddings)} does not match the per-layer sums of "
            f"the Engram primes {expected}; the table layout would not cover the hash ranges."
        )


# --- compressed token map -----------------------------------------------------------------------


def _key_normalizer():
    from tokenizers import Regex, normalizers

    # U+E000 shields a token that is exactly one space from Strip, then becomes a space again.
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), "\ue000"),
            normalizers.Strip(),
            normalizers.Replace("\ue000", " "),
        ]
    )


def build_token_map(tokenizer_json_path, compressed_vocab_size: int | None = None) -> np.ndarray:
    """Map every raw token id to its Engram compressed id (index of its key by first appearance).

    The key of token t is the normalised raw decode of ``[t]`` (specials kept, no clean-up of
    tokenisation spaces); a partial UTF-8 token (decode holds U+FFFD) keys on its token string.

    Args:
        tokenizer_json_path: the checkpoint's ``tokenizer.json``.
        compressed_vocab_size: if given, the number of distinct keys must equal it.

    Returns:
        int32 ``[vocab]`` with ``vocab`` = the tokenizer size including added tokens.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json_path))
    normalizer = _key_normalizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[t] for t in range(vocab)], skip_special_tokens=False)
    key_ids: dict[str, int] = {}
    token_map = np.empty(vocab, dtype=np.int32)
    for t, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(t)
        else:
            key = normalizer.normalize_str(text) or text
        token_map[t] = key_ids.setdefault(key, len(key_ids))
    if compressed_vocab_size is not None and len(key_ids) != compressed_vocab_size:
        raise ValueError(
            f"{tokenizer_json_path} yields {len(key_ids)} distinct Engram keys but "
            f"engram_compressed_vocab_size is {compressed_vocab_size}; every multiplier depends "
            f"on that size, so this tokenizer does not match the checkpoint."
        )
    return token_map


def load_token_map(tokenizer_json_path, cache_dir=None, compressed_vocab_size: int | None = None):
    """``build_token_map``, cached in cache_dir as ``engram_token_map-<sha256 of the file>.npy``."""
    if cache_dir is None:
        return build_token_map(tokenizer_json_path, compressed_vocab_size)
    digest = hashlib.sha256(Path(tokenizer_json_path).read_bytes()).hexdigest()
    path = Path(cache_dir) / f"engram_token_map-{digest}.npy"
    if path.exists():
        token_map = np.load(path)
        if compressed_vocab_size is None or int(token_map.max()) + 1 == compressed_vocab_size:
            return token_map
    token_map = build_token_map(tokenizer_json_path, compressed_vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, token_map)
    return token_map


# --- per-position row ids -----------------------------------------------------------------------


class EngramHasher:
    """Row ids of every Engram layer's table for a batch of token ids, with carried history.

    History is the last ``max_ngram_size - 1`` compressed ids of each sequence (most recent last),
    ``DEAD`` (-1) where missing or inside an image span; a fresh sequence is all ``DEAD``.
    """

    def __init__(
        self,
        layer_ids,
        max_ngram_size: int,
        n_heads: int,
        vocab_size: int,
        compressed_vocab_size: int,
        pad_token_id: int,
        num_embeddings,
        token_map,
    ):
        if max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be >= 2, got {max_ngram_size}.")
        if len(num_embeddings) != len(layer_ids):
            raise ValueError(
                f"engram_num_embeddings has {len(num_embeddings)} entries but "
                f"engram_layer_ids has {len(layer_ids)}."
            )
        self.layer_ids = [int(i) for i in layer_ids]
        self.max_ngram_size = int(max_ngram_size)
        self.n_heads = int(n_heads)
        self.compressed_vocab_size = int(compressed_vocab_size)
        self.primes = engram_primes(self.layer_ids, max_ngram_size, n_heads, vocab_size)
        check_num_embeddings(self.primes, num_embeddings)
        self.offsets = engram_offsets(self.primes)
        self.multipliers = engram_multipliers(self.layer_ids, max_ngram_size, compressed_vocab_size)
        self.token_map = self._check_token_map(token_map)
        self.pad_id = int(self.token_map[pad_token_id])
        self._device = None  # the tables as MLX arrays, made on first use

    @classmethod
    def from_config(cls, config, token_map) -> "EngramHasher":
        """Build from an object (or mapping) carrying the HF ``text_config`` Engram keys."""
        get = config.__getitem__ if isinstance(config, Mapping) else partial(getattr, config)
        layer_ids, ngram, heads, vocab, cvocab, pad, rows = (get(k) for k in _CONFIG_KEYS)
        return cls(layer_ids, ngram, heads, vocab, cvocab, pad, rows, token_map)

    @property
    def history_length(self) -> int:
        return self.max_ngram_size - 1

    @property
    def n_columns(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    def _check_token_map(self, token_map) -> np.ndarray:
        token_map = np.asarray(token_map, dtype=np.int64)
        size = int(token_map.max()) + 1 if token_map.size else 0
        is_valid = token_map.ndim == 1 and token_map.min(initial=0) >= 0
        if not is_valid or size != self.compressed_vocab_size:
            raise ValueError(
                f"the Engram token map has {size} compressed ids but engram_compressed_vocab_size "
                f"is {self.compressed_vocab_size}."
            )
        return token_map

    def fresh_history(self, batch: int) -> np.ndarray:
        """History of ``batch`` sequences with nothing before them: int64 ``[B, max_ngram - 1]``."""
        return np.full((batch, self.history_length), DEAD, dtype=np.int64)

    def compress(self, ids) -> np.ndarray:
        """Raw token ids (any shape) -> int64 compressed ids."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.token_map.shape[0]):
            raise ValueError(f"token ids must lie in [0, {self.token_map.shape[0]}).")
        return self.token_map[ids]

    def hash(self, ids, history=None, dead=None):
        """Row ids of raw token ids.

        Args:
            ids: int ``[B, S]`` raw token ids.
            history: int64 ``[B, max_ngram - 1]`` previous compressed ids, or None for fresh.
            dead: optional bool ``[B, S]``, True at image-span positions.

        Returns:
            ``(row_ids, new_history)``: int64 ``[B, S, n_layers, (max_ngram - 1) * n_heads]``
            (offsets included; column = order-major, head-minor) and int64 ``[B, max_ngram - 1]``.
        """
        if dead is None:
            return self.hash_compressed(self.compress(ids), history)
        dead = np.asarray(dead, dtype=bool)
        # Ids under the mask are never looked up, so image placeholders need not be valid tokens.
        compressed = np.where(dead, DEAD, self.compress(np.where(dead, 0, ids)))
        return self.hash_compressed(compressed, history)

    def hash_compressed(self, compressed, history=None):
        """``hash`` on compressed ids ``[B, S]`` where ``DEAD`` (-1) marks image-span positions."""
        compressed = np.asarray(compressed, dtype=np.int64)
        if compressed.ndim != 2:
            raise ValueError(f"ids must be [B, S], got shape {compressed.shape}.")
        vocab = self.compressed_vocab_size
        if compressed.size and not DEAD <= compressed.min() <= compressed.max() < vocab:
            raise ValueError(f"compressed ids must lie in [-1, {vocab}).")
        batch, length = compressed.shape
        history = self._check_history(history, batch)
        lookback = padded_lookback(compressed, history, self.pad_id)
        rolling = ngram_hashes(lookback, self.multipliers)  # [B, S, n_layers, max_ngram - 1]
        ids = rolling[..., None] % self.primes + self.offsets.reshape(self.primes.shape)
        row_ids = ids.reshape(batch, length, len(self.layer_ids), self.n_columns)
        new_history = np.concatenate([history, compressed], axis=1)[:, -self.history_length :]
        return row_ids, new_history

    def hash_lazy(self, ids, history, dead=None):
        """`hash` as MLX ops, so the row ids join the lazy graph and the ids never go to the
        host for hashing (a decode step's token is still being computed when the next step is
        built). Token ids are not range-checked here.

        Args:
            ids: int ``mx.array [B, S]`` raw token ids.
            history: int ``mx.array [B, h]`` (h >= 0) previous compressed ids, -1 for missing.
            dead: optional bool ``mx.array [B, S]``, True at image-span positions.
        Returns:
            ``(row_ids int32 [B, S, n_layers, columns], compressed int32 [B, S])``.
        """
        import mlx.core as mx

        if self._device is None:
            self._device = (mx.array(self.token_map.astype(np.int32)),
                            mx.array(self.multipliers), mx.array(self.primes),
                            mx.array(self.offsets.reshape(self.primes.shape)))
        token_map, multipliers, primes, offsets = self._device
        batch, length = ids.shape
        compressed = mx.take(token_map, ids.astype(mx.int32))
        if dead is not None:
            compressed = mx.where(dead, DEAD, compressed)
        depth = self.history_length
        missing = mx.full((batch, max(0, depth - history.shape[1])), DEAD, mx.int32)
        window = mx.concatenate([missing, history[:, -depth:].astype(mx.int32), compressed], 1)
        tokens = mx.stack([window[:, depth - k:depth - k + length] for k in range(depth + 1)], -1)
        # The walk back stops at the first DEAD or missing id (padded_lookback).
        blocked = mx.cummax((tokens == DEAD).astype(mx.int32), axis=-1) > 0
        lookback = mx.where(blocked, self.pad_id, tokens).astype(mx.int64)
        products = lookback[:, :, None, :] * multipliers          # [B, S, n_layers, K + 1]
        rolling, orders = products[..., 0], []
        for k in range(1, depth + 1):
            rolling = mx.bitwise_xor(rolling, products[..., k])
            orders.append(rolling)
        rows = mx.stack(orders, -1)[..., None] % primes + offsets   # [B, S, L, K, heads]
        rows = rows.reshape(batch, length, len(self.layer_ids), self.n_columns)
        return rows.astype(mx.int32), compressed

    def _check_history(self, history, batch: int) -> np.ndarray:
        if history is None:
            return self.fresh_history(batch)
        history = np.asarray(history, dtype=np.int64)
        if history.shape != (batch, self.history_length):
            raise ValueError(
                f"history must be [{batch}, {self.history_length}], got shape {history.shape}."
            )
        return history


def padded_lookback(compressed: np.ndarray, history: np.ndarray, pad_id: int) -> np.ndarray:
    """Lookback tokens ``x_k`` (k = 0 .. K) of every position, K = history length.

    The walk back from a position stops at the first DEAD or missing id: that token and every
    older one become ``pad_id``, so history never reaches across an image span.

    Args:
        compressed: int64 ``[B, S]`` compressed ids, ``DEAD`` at image positions.
        history: int64 ``[B, K]`` the ids before ``compressed`` (most recent last).

    Returns:
        int64 ``[B, S, K + 1]``, index k = the token k positions back.
    """
    length, depth = compressed.shape[1], history.shape[1]
    window = np.concatenate([history, compressed], axis=1)
    tokens = np.stack([window[:, depth - k : depth - k + length] for k in range(depth + 1)], -1)
    blocked = np.logical_or.accumulate(tokens == DEAD, axis=-1)
    return np.where(blocked, pad_id, tokens)


def ngram_hashes(lookback: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
    """Rolling XOR of ``x_k * mult[k]`` over k: the hash of orders 2 .. max_ngram per layer.

    Args:
        lookback: int64 ``[B, S, max_ngram]`` from ``padded_lookback``.
        multipliers: int64 ``[n_layers, max_ngram]``.

    Returns:
        int64 ``[B, S, n_layers, max_ngram - 1]`` (non-negative: every product is below 2^63).
    """
    products = lookback[:, :, None, :] * multipliers
    return np.bitwise_xor.accumulate(products, axis=-1)[..., 1:]
