"""The embedded default corpus, its character tokenizer and next-token training examples
(:func:`windows` cuts any token stream into them).

No download and no file: :func:`corpus` writes English-like text from a small probabilistic
grammar driven by a seeded ``random.Random``, so every machine trains on the same bytes. The
grammar has enough structure for a tiny model to learn within a few hundred steps (a closed
vocabulary, subject-verb agreement, numbers before plurals, questions ending in ``?``) and
enough variety that it cannot just memorise one sentence.

    text = corpus()                                  # str, about 300 KB
    inputs, targets = make_examples(text, block_size=64)  # (N, 64) int64 each
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from .errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

ALPHABET = "\n !',.?0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""Every character the tokenizer knows; token id = position in this string."""

VOCAB_SIZE = len(ALPHABET)
_INDEX = {ch: i for i, ch in enumerate(ALPHABET)}

DEFAULT_SEED = 1234
DEFAULT_CHARS = 300_000

# --------------------------------------------------------------------------- the grammar
# Nouns are (singular, plural); verbs are (third person singular, plural, past).

_NOUNS = [
    ("cat", "cats"), ("dog", "dogs"), ("fox", "foxes"), ("bird", "birds"), ("child", "children"),
    ("teacher", "teachers"), ("robot", "robots"), ("farmer", "farmers"), ("ship", "ships"),
    ("river", "rivers"), ("tree", "trees"), ("city", "cities"), ("box", "boxes"), ("lamp", "lamps"),
    ("garden", "gardens"), ("baker", "bakers"), ("horse", "horses"), ("wizard", "wizards"),
]
_NAMES = ["Ada", "Bo", "Cleo", "Dev", "Emil", "Fay", "Gus", "Hana", "Ivo", "Juno"]
_ADJECTIVES = [
    "small", "red", "quiet", "old", "bright", "heavy", "green", "lazy", "clever", "tall",
    "tired", "happy", "strange", "gentle", "loud", "young",
]
_TRANSITIVE = [
    ("sees", "see", "saw"), ("chases", "chase", "chased"), ("finds", "find", "found"),
    ("builds", "build", "built"), ("carries", "carry", "carried"), ("watches", "watch", "watched"),
    ("paints", "paint", "painted"), ("follows", "follow", "followed"), ("helps", "help", "helped"),
    ("likes", "like", "liked"),
]
_INTRANSITIVE = [
    ("sleeps", "sleep", "slept"), ("runs", "run", "ran"), ("sings", "sing", "sang"),
    ("waits", "wait", "waited"), ("laughs", "laugh", "laughed"), ("falls", "fall", "fell"),
]
_PREPOSITIONS = ["near", "under", "behind", "over", "beside", "inside"]
_ADVERBS = ["slowly", "quickly", "again", "today", "at night", "every morning", "once"]
_CONJUNCTIONS = ["and", "but", "because", "while", "so"]
_SINGULAR_DETERMINERS = ["the", "a", "every", "that", "my", "our", "one"]
_PLURAL_DETERMINERS = ["the", "some", "many", "those", "my", "our", "two", "three"]


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    """A noun phrase and whether it is plural."""
    if rng.random() < 0.15:
        return rng.choice(_NAMES), False
    singular, plural = rng.choice(_NOUNS)
    is_plural = rng.random() < 0.4
    if is_plural and rng.random() < 0.3:
        words = [str(rng.randint(2, 99))]
    else:
        words = [rng.choice(_PLURAL_DETERMINERS if is_plural else _SINGULAR_DETERMINERS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJECTIVES))
    words.append(plural if is_plural else singular)
    if words[0] == "a" and words[1][0] in "aeiou":
        words[0] = "an"
    return " ".join(words), is_plural


def _clause(rng: random.Random, tense: int | None = None) -> str:
    """Subject, agreeing verb, optional object, place and adverb. ``tense``: 0/1 present, 2 past."""
    subject, plural = _noun_phrase(rng)
    past = (tense if tense is not None else rng.randrange(3)) == 2
    form = 2 if past else (1 if plural else 0)
    if rng.random() < 0.6:
        words = [subject, rng.choice(_TRANSITIVE)[form], _noun_phrase(rng)[0]]
    else:
        words = [subject, rng.choice(_INTRANSITIVE)[form]]
    if rng.random() < 0.3:
        words += [rng.choice(_PREPOSITIONS), _noun_phrase(rng)[0]]
    if rng.random() < 0.25:
        words.append(rng.choice(_ADVERBS))
    return " ".join(words)


def _question(rng: random.Random) -> str:
    subject, plural = _noun_phrase(rng)
    verb = rng.choice(_TRANSITIVE)[1]
    return f"{'do' if plural else 'does'} {subject} {verb} {_noun_phrase(rng)[0]}?"


def _sentence(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.12:
        text = _question(rng)
    elif r < 0.18:
        adjective = rng.choice(_ADJECTIVES)
        text = f"what {'an' if adjective[0] in 'aeiou' else 'a'} {adjective} {rng.choice(_NOUNS)[0]}!"
    elif r < 0.45:
        tense = rng.randrange(3)
        text = f"{_clause(rng, tense)}, {rng.choice(_CONJUNCTIONS)} {_clause(rng, tense)}."
    else:
        text = _clause(rng) + "."
    return text[0].upper() + text[1:]


def corpus(num_chars: int = DEFAULT_CHARS, *, seed: int = DEFAULT_SEED) -> str:
    """English-like text of exactly ``num_chars`` characters, all in :data:`ALPHABET`.

    Guarantees: a pure function of ``(num_chars, seed)``: the same string on every machine and
    Python 3 version (``random.Random`` with an int seed is specified to be reproducible;
    ``tests/test_data.py`` pins the hash). Paragraphs of 3 to 7 sentences, separated by a
    newline. ``num_chars <= 0`` gives ``""``."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7))) + "\n"
        parts.append(paragraph)
        size += len(paragraph)
    return "".join(parts)[: max(num_chars, 0)]


# --------------------------------------------------------------------------- tokenizer


def encode(text: str) -> Tensor:
    """Token ids ``(len(text),)`` int64, one per character. A character outside
    :data:`ALPHABET` raises ``ValueError`` naming it and its position."""
    try:
        import torch  # here, not above: the configuration reads this module's sizes without torch

        return torch.tensor([_INDEX[ch] for ch in text], dtype=torch.int64)
    except KeyError as err:
        pos = next(i for i, ch in enumerate(text) if ch not in _INDEX)
        raise ValueError(f"character {err.args[0]!r} at position {pos} is not in the tokenizer's alphabet") from None


UNKNOWN = "\ufffd"
"""What :func:`decode` writes for an id outside the alphabet (a model whose vocabulary is larger
than the corpus's samples such ids): Unicode's replacement character, as UTF-8 decoding does."""


def decode(ids: Tensor | list[int]) -> str:
    """Inverse of :func:`encode`: ``decode(encode(s)) == s`` for every ``s`` over the alphabet.
    An id outside ``0..VOCAB_SIZE - 1`` is written :data:`UNKNOWN`, never an error
    (``tests/test_pretrained_weights.py::test_a_vocabulary_larger_than_the_alphabet_samples_and_finishes``)."""
    return "".join(ALPHABET[int(i)] if 0 <= int(i) < VOCAB_SIZE else UNKNOWN for i in ids)


# --------------------------------------------------------------------------- examples


def make_examples(text: str, block_size: int) -> tuple[Tensor, Tensor]:
    """Next-token examples of ``text`` under the character tokenizer: ``windows(encode(text),
    block_size)``. ``block_size < 1`` raises ``ValueError``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return windows(encode(text), block_size)


def windows(ids: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Next-token examples of a token stream ``ids`` ``(L,)``: ``(inputs, targets)``, both
    ``(N, block_size)`` int64.

    Guarantees: row ``i`` of ``inputs`` is tokens ``[i * block_size, (i + 1) * block_size)``
    (non-overlapping windows, so each token is in exactly one example, which keeps an
    example's privacy unit simple); ``targets`` is the same window shifted by one token.
    ``N = (L - 1) // block_size``; the leftover tail is dropped. ``block_size < 1`` raises
    ``ValueError``."""
    import torch

    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids = ids.to(torch.int64)
    n = max(len(ids) - 1, 0) // block_size
    inputs = ids[: n * block_size].view(n, block_size)
    targets = ids[1 : n * block_size + 1].view(n, block_size)
    return inputs, targets


# --------------------------------------------------------------------------- token files larger than memory

CHUNK_TOKENS = 1 << 21
"""Tokens per read of a streaming pass over a mapped file (:func:`stream_chunks`): 4 MiB of uint16."""


DIGEST_SEGMENT = 1 << 25
"""Tokens per separately hashed segment of :meth:`Windows.digest` (64 MiB of uint16)."""

DIGEST_THREADS = 8
"""Threads hashing segments at once (each holds one read buffer of :data:`CHUNK_TOKENS`)."""


def stream_chunks(ids: Any, start: int = 0, stop: int | None = None, *, size: int | None = None) -> Iterator[Any]:
    """``ids[start:stop]`` as numpy arrays of at most ``size`` (:data:`CHUNK_TOKENS`) tokens
    each, in order, in the stream's own dtype. A file-backed stream (``np.memmap``) is read with plain reads into one buffer, not
    through the map: a pass over a 10 GB file must not leave 10 GB of mapped pages resident
    (counted in the process's RSS); each chunk is valid until the next is yielded."""
    import numpy as np

    size = size or CHUNK_TOKENS
    stop = len(ids) if stop is None else min(stop, len(ids))
    filename = getattr(ids, "filename", None)
    if filename is None or not isinstance(ids, np.memmap):
        array = ids.numpy() if hasattr(ids, "numpy") else ids  # a ChunkedStream slices a copy of the chunk only
        for lo in range(start, stop, size):
            yield array[lo: min(lo + size, stop)]
        return
    dtype = ids.dtype
    buffer = np.empty(min(size, max(stop - start, 0)), dtype=dtype)
    with open(filename, "rb", buffering=0) as f:
        f.seek(ids.offset + start * dtype.itemsize)
        for lo in range(start, stop, size):
            n = min(size, stop - lo)
            view = memoryview(buffer[:n]).cast("B")
            got = f.readinto(view)
            while got < len(view):  # a short read (a pipe, a network file): read the rest
                more = f.readinto(view[got:])
                if not more:
                    raise EOFError(f"{filename}: the file ended at token {lo + got // dtype.itemsize}")
                got += more
            yield buffer[:n]


class ChunkedStream:
    """A token stream held as pieces (1-D numpy arrays of one dtype: zero-copy views of the
    buffers of a memory-mapped Arrow table, a saved dataset's token-ids column), indexed as the
    one array they concatenate to: ``len``, ``dtype``, ``[lo:hi]`` (a copy of that slice only) and
    ``[positions]`` (an integer array of any shape). Nothing is concatenated whole."""

    def __init__(self, pieces: Sequence[Any]) -> None:
        import numpy as np

        self.pieces = [p for p in pieces if len(p)]
        self.dtype = self.pieces[0].dtype if self.pieces else np.dtype(np.int64)
        self.starts = np.cumsum([0, *(len(p) for p in self.pieces)])  # (pieces + 1,)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: Any) -> Any:
        import numpy as np

        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                raise IndexError("a ChunkedStream slices with step 1")
            first = int(np.searchsorted(self.starts, lo, "right")) - 1
            parts, at = [], lo
            for i in range(max(first, 0), len(self.pieces)):
                if at >= hi:
                    break
                start = int(self.starts[i])
                parts.append(self.pieces[i][at - start: hi - start])
                at = start + len(self.pieces[i])
            return np.concatenate(parts) if parts else np.zeros(0, self.dtype)
        positions = np.asarray(key, dtype=np.int64)
        flat = positions.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"positions out of range for {len(self)} tokens")
        piece = np.searchsorted(self.starts, flat, "right") - 1
        out = np.empty(flat.shape, self.dtype)
        for i in np.unique(piece).tolist():
            mine = piece == i
            out[mine] = self.pieces[i][flat[mine] - self.starts[i]]
        return out.reshape(positions.shape)


def read_rows(stream: Any, starts: Any, length: int) -> Any:
    """``(B, length)`` array of ``stream[s:s + length]`` for each ``s`` of ``starts``, in the
    stream's dtype. A file-backed stream (``np.memmap``) is read row by row with ``preadv``, not
    through the map: on Linux 6.x the page cache holds a file in large folios and a fault maps a
    whole folio, so each row touched through the map made 1 to 2 MB resident (64 rows of a
    128 MiB file: +87 MB of RSS); a read copies only the row's bytes."""
    import os

    import numpy as np

    starts = np.asarray(starts, dtype=np.int64)
    filename = getattr(stream, "filename", None)
    if filename is None or not isinstance(stream, np.memmap):
        return stream[starts[:, None] + np.arange(length, dtype=np.int64)]
    out = np.empty((len(starts), length), dtype=stream.dtype)
    size = stream.dtype.itemsize
    fd = os.open(filename, os.O_RDONLY)
    try:
        for row, start in zip(out, starts.tolist()):
            view = memoryview(row).cast("B")
            if os.preadv(fd, [view], stream.offset + start * size) != len(view):
                raise EOFError(f"{filename}: the file ended before token {start + length}")
    finally:
        os.close(fd)
    return out


def id_range(ids: Any) -> tuple[int, int]:
    """``(min, max)`` of a token stream (``(0, -1)`` when empty), chunk by chunk in the stream's
    own dtype: no int64 copy of it, and a mapped file is read, not mapped."""
    if hasattr(ids, "numel"):  # a tensor in memory
        return (int(ids.min()), int(ids.max())) if ids.numel() else (0, -1)
    low, top, _ = scan(ids, 0)
    return low, top


def scan(ids: Any, hashed: int, tag: str = "", *, threads: int = DIGEST_THREADS) -> tuple[int, int, str]:
    """``(min, max, digest)`` of a token stream in one pass: its ids' range (``(0, -1)`` when
    empty) and ``"v2:"`` with the SHA-256 of the dtype, ``tag``, ``hashed`` and the SHA-256 of each
    :data:`DIGEST_SEGMENT` tokens of ``ids[:hashed]`` as stored. The segments are read (plain
    reads, :func:`stream_chunks`) and hashed by up to ``threads`` threads (hashlib and numpy let
    go of the GIL); they are fixed, so the digest does not depend on the threads."""
    import hashlib
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    length = len(ids)
    hashed = min(hashed, length)

    def segment(lo: int) -> tuple[int | None, int | None, bytes]:
        h, low, top = hashlib.sha256(), None, None
        for chunk in stream_chunks(ids, lo, min(lo + DIGEST_SEGMENT, length)):
            if len(chunk):
                a, b = int(chunk.min()), int(chunk.max())
                low, top = (a, b) if low is None else (min(low, a), max(top, b))
            head = chunk[: max(0, hashed - lo)]
            lo += len(chunk)
            if len(head):
                h.update(memoryview(np.ascontiguousarray(head)).cast("B"))
        return low, top, h.digest()

    h = hashlib.sha256(f"fsdpx.tokens.v2:{np.dtype(ids.dtype).str}:{tag}:{hashed}".encode())
    low, top = None, None
    starts = range(0, length, DIGEST_SEGMENT)
    with ThreadPoolExecutor(max(1, min(threads, os.cpu_count() or 1, len(starts) or 1))) as pool:
        for lo, (a, b, part) in zip(starts, pool.map(segment, starts)):
            if a is not None:
                low, top = (a, b) if low is None else (min(low, a), max(top, b))
            if lo < hashed:
                h.update(part)
    return (0, -1, "v2:" + h.hexdigest()) if low is None else (low, top, "v2:" + h.hexdigest())


class VocabularyError(ConfigError):
    """The data holds token ids the model's vocabulary does not cover."""


class BackgroundDigest:
    """:func:`scan`'s digest of ``ids[:hashed]``, computed by one daemon thread once
    :meth:`start` is called (``loop.run`` calls it after the first step, so that step competes
    with no hash of the whole file; ``scan``'s own threads would take every core).
    :meth:`ready` says whether it is known; :meth:`value` starts it if need be, waits for it and
    raises what the hashing raised. Proven by
    ``tests/test_large_data.py::test_a_fresh_segment_waits_for_the_digest_only_to_record_it``."""

    def __init__(self, ids: Any, hashed: int, tag: str) -> None:
        import threading

        self._value: str | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = scan(ids, hashed, tag, threads=1)[2]
            except BaseException as e:  # noqa: BLE001 - handed to whoever asks for the value
                self._error = e

        self._thread = threading.Thread(target=run, name="fsdpx-data-digest", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start hashing (again: nothing)."""
        with self._lock:
            if self._thread.ident is None:
                self._thread.start()

    def ready(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive()

    def value(self) -> str:
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class Windows:
    """The examples of a token stream ``(L,)`` held as it is stored (a ``np.memmap`` of uint16,
    uint32, ...), cut on demand: row ``i`` is tokens ``[i * block_size + shift, (i + 1) *
    block_size + shift)`` as int64, ``n = (L - 1) // block_size`` rows. ``shift`` 0 gives
    :func:`windows`' inputs, 1 its targets.

    Guarantees: ``Windows(s, b, k)[idx]`` equals ``windows(torch.from_numpy(s).long(), b)[k][idx]``
    for any rows ``idx`` (an int, a slice, an index array or tensor; a ``(rows, columns)`` pair
    indexes the rows, then the columns of the result): the same int64 values, so a run on a
    mapped file takes the batches and losses of the same tokens held in memory
    (``tests/test_large_data.py``). Only the rows asked for are read (:func:`read_rows`: from
    a file, by ``preadv``) and made int64; the stream is never copied whole."""

    def __init__(self, stream: Any, block_size: int, shift: int, *, digest: str | BackgroundDigest | None = None,
                 vocab: int | None = None, where: str = "the token file") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if shift not in (0, 1):
            raise ValueError(f"shift must be 0 (inputs) or 1 (targets), got {shift}")
        self.stream, self.block_size, self.shift = stream, block_size, shift
        self.shape = (max(len(stream) - 1, 0) // block_size, block_size)
        self._digest = digest
        self.vocab, self.where = vocab, where

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Windows({self.shape[0]} x {self.block_size} of {self.stream.dtype}, shift {self.shift})"

    def __getitem__(self, key: Any) -> Tensor:
        import numpy as np
        import torch

        if isinstance(key, tuple):
            rows, *columns = key
            picked = self[rows]
            return picked[tuple(columns)] if picked.ndim == 1 else picked[(slice(None), *columns)]
        if isinstance(key, (int, np.integer)) or (isinstance(key, (torch.Tensor, np.ndarray)) and key.ndim == 0):
            key = int(key)
            if not -self.shape[0] <= key < self.shape[0]:
                raise IndexError(f"row {key} of {self.shape[0]}")
            return self[np.array([key % self.shape[0]])][0]
        if isinstance(key, slice):
            rows = np.arange(self.shape[0], dtype=np.int64)[key]
        else:
            rows = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
            rows = rows.astype(np.int64, copy=False).reshape(-1)
            if rows.size and (rows.min() < -self.shape[0] or rows.max() >= self.shape[0]):
                raise IndexError(f"rows out of range for {self.shape[0]} examples")
            rows = rows % max(self.shape[0], 1)
        starts = rows * self.block_size + self.shift  # (B,)
        out = np.asarray(read_rows(self.stream, starts, self.block_size), dtype=np.int64)
        if self.vocab is not None:
            check_ids(out, starts, self.vocab, self.where, np.dtype(self.stream.dtype).itemsize)
        return torch.from_numpy(out)

    def digest(self) -> str:
        """The digest of the tokens the examples hold (``[0, n * block_size + 1)``) as stored,
        with their shape: :func:`scan`'s (given at construction when the source's scan made it).
        One read of the file, hashed by threads: a fraction of the cost of hashing every
        example's int64 bytes, which :meth:`legacy_digest` does."""
        if self._digest is None:
            self._digest = scan(self.stream, self.shape[0] * self.block_size + 1, str(self.shape))[2]
        if isinstance(self._digest, BackgroundDigest):
            self._digest = self._digest.value()
        return self._digest

    def digest_ready(self) -> bool:
        """Whether :meth:`digest` returns at once (no hash of the file left to wait for)."""
        return not isinstance(self._digest, BackgroundDigest) or self._digest.ready()

    def start_digest(self) -> None:
        """Start hashing the file in the background, if its digest is one still to compute."""
        if isinstance(self._digest, BackgroundDigest):
            self._digest.start()

    def legacy_digest(self, targets: "Windows") -> str:
        """The digest :func:`fsdpx.train.segments.data_digest` gives the same examples held as
        int64 tensors (the shape, then every example's int64 bytes, inputs then targets), read
        chunk by chunk: how a checkpoint written before token files were mapped is recognised."""
        import hashlib

        import numpy as np

        h = hashlib.sha256()
        end = self.shape[0] * self.block_size
        for shift in (self.shift, targets.shift):
            h.update(str(tuple(self.shape)).encode())
            for chunk in stream_chunks(self.stream, shift, shift + end):
                h.update(memoryview(np.ascontiguousarray(chunk, dtype=np.int64)).cast("B"))
        return h.hexdigest()


def mapped_windows(stream: Any, block_size: int, *, digest: str | BackgroundDigest | None = None,
                   vocab: int | None = None, where: str = "the token file") -> tuple[Windows, Windows]:
    """:func:`windows` of a stream held as stored (a ``np.memmap``): ``(inputs, targets)`` cut
    on demand (:class:`Windows`); ``digest``: :meth:`Windows.digest`'s, known or being computed;
    ``vocab``: every row read is checked against it (:func:`check_ids`, naming ``where``)."""
    return (Windows(stream, block_size, 0, digest=digest, vocab=vocab, where=where),
            Windows(stream, block_size, 1, digest=digest, vocab=vocab, where=where))


def check_ids(rows: Any, starts: Any, vocab: int, where: str, itemsize: int) -> None:
    """Raise :class:`VocabularyError` unless every id of ``rows`` (``(B, T)`` int64, row ``i``
    read from token ``starts[i]`` of the file) is in ``[0, vocab)``, naming ``where``, the first
    bad id and its offset in the file (token and byte). Two reductions over the batch."""
    import numpy as np

    if rows.size == 0 or (rows.min() >= 0 and rows.max() < vocab):
        return
    i, j = (int(k[0]) for k in np.nonzero((rows < 0) | (rows >= vocab)))
    token = int(starts[i]) + j
    raise VocabularyError(f"{where} holds token id {int(rows[i, j])} at token {token} (byte {token * itemsize}),"
                          f" but the model's vocabulary has {vocab} ids (0..{vocab - 1}): give the model a larger"
                          " vocab_size, or fix the file")
