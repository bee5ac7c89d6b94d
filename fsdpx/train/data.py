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
from typing import TYPE_CHECKING

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
