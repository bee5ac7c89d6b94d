"""Philox4x32-10 (privacy.philox): Random123's known answers, and the torch-ops rounds equal
the compiled host rounds on random counters and keys, broadcasting included."""

import numba
import numpy as np
import torch

from privacy.philox import philox_host, philox_torch

# Random123 (github.com/DEShawResearch/random123) tests/kat_vectors, the "philox4x32 10" lines:
# counter (4 words), key (2 words), expected output (4 words).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@numba.njit
def _host(words):  # noqa: ANN001, ANN202
    out = np.empty((words.shape[0], 4), dtype=np.uint64)
    for i in range(words.shape[0]):
        w = words[i]
        out[i, 0], out[i, 1], out[i, 2], out[i, 3] = philox_host(w[0], w[1], w[2], w[3], w[4], w[5])
    return out


def test_host_and_torch_rounds_give_random123s_known_answers():
    for counter, key, expected in KNOWN_ANSWERS:
        host = _host(np.array([counter + key], dtype=np.uint64))[0]
        assert tuple(int(v) for v in host) == expected
        ops = philox_torch(*(torch.tensor([v], dtype=torch.int64) for v in counter + key))
        assert tuple(int(v[0]) for v in ops) == expected


def test_torch_rounds_equal_host_rounds_on_random_words_and_broadcast_keys():
    words = np.random.default_rng(0).integers(0, 2**32, (20_000, 6), dtype=np.uint64)
    host = _host(words).astype(np.int64)
    t = torch.from_numpy(words.astype(np.int64))
    ops = torch.stack(philox_torch(*t.unbind(1)), 1)
    assert torch.equal(ops, torch.from_numpy(host))
    # one key per row of a grid, counters along it: the shapes the device sampler uses
    keys, counters = t[:4, 4:], t[:5, 0]
    grid = torch.stack(philox_torch(counters.view(1, 5), t[:4, 1:2], t[:4, 2:3], t[:4, 3:4],
                                    keys[:, :1], keys[:, 1:]), -1)
    for r in range(4):
        for c in range(5):
            one = np.array([[counters[c], *t[r, 1:4], *keys[r]]], dtype=np.uint64)
            assert grid[r, c].tolist() == _host(one)[0].astype(np.int64).tolist()
