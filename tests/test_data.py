"""The embedded corpus is the same everywhere, and examples are next-token windows of it."""

import hashlib

import pytest
import torch

from fsdpx.train.data import ALPHABET, DEFAULT_CHARS, VOCAB_SIZE, corpus, decode, encode, make_examples

# Pinned: if the grammar, the seed or Python's random.Random changes, these change and every
# earlier run stops being comparable. Update them only on purpose.
CORPUS_SHA256 = "db6659b5962d6a9be5c53ff46d8bd8025e5c5eee2faf4f6dbaff26b2d999d0ef"
INPUTS_32_SHA256 = "b9b575815478d80e23ec37f2e8d8452a27e1bb94d2a2bd02a22f92c51fea8e18"
TARGETS_32_SHA256 = "713fc1c3ca2ea2015a1e37fb848ef8236284bcee0f553a959668d1d6b08181d6"


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().astype("<i8").tobytes()).hexdigest()


@pytest.fixture(scope="module")
def text() -> str:
    return corpus()


def test_default_corpus_has_the_pinned_hash(text):
    assert len(text) == DEFAULT_CHARS
    assert hashlib.sha256(text.encode()).hexdigest() == CORPUS_SHA256


def test_default_examples_have_the_pinned_hash(text):
    inputs, targets = make_examples(text, 32)
    assert _sha256(inputs) == INPUTS_32_SHA256
    assert _sha256(targets) == TARGETS_32_SHA256


def test_corpus_is_a_function_of_length_and_seed():
    assert corpus(5000, seed=7) == corpus(5000, seed=7)
    assert corpus(5000, seed=7) != corpus(5000, seed=8)
    assert corpus(5000) == corpus(DEFAULT_CHARS)[:5000]  # a prefix of the longer text
    assert corpus(0) == ""


def test_corpus_uses_only_the_alphabet_and_reads_like_sentences(text):
    assert set(text) <= set(ALPHABET)
    assert text.count("\n") > 100 and text.count(". ") > 1000 and "?" in text and "!" in text


def test_encode_decode_round_trip(text):
    ids = encode(text[:2000])
    assert ids.dtype == torch.int64 and ids.shape == (2000,)
    assert int(ids.min()) >= 0 and int(ids.max()) < VOCAB_SIZE
    assert decode(ids) == text[:2000]


def test_encode_names_an_unknown_character():
    with pytest.raises(ValueError, match=r"'#' at position 3"):
        encode("abc#")


@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_examples_are_non_overlapping_windows_with_targets_shifted_by_one(block_size):
    text = corpus(1000, seed=3)
    inputs, targets = make_examples(text, block_size)
    n = (len(text) - 1) // block_size
    assert inputs.shape == targets.shape == (n, block_size)
    assert inputs.dtype == targets.dtype == torch.int64
    ids = encode(text)
    assert torch.equal(inputs.flatten(), ids[: n * block_size])
    assert torch.equal(targets.flatten(), ids[1 : n * block_size + 1])
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(targets[:-1, -1], inputs[1:, 0])


def test_examples_edge_cases():
    assert make_examples("ab", 4)[0].shape == (0, 4)
    with pytest.raises(ValueError, match="block_size"):
        make_examples("abc", 0)
