"""The Triton draft-token race (`hf_vegas_kernels.race_argmax`) against its reference and against multinomial."""

import pytest
import torch

from hf_vegas_kernels import naive
from kernel_cases import DEVICE, import_kernels

kernels = import_kernels()


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernel allocates starts as NaN (integers: the most negative value), so an unwritten or
    unmerged entry shows."""
    def nan_empty(*shape, dtype, device):
        junk = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, junk, dtype=dtype, device=device)

    monkeypatch.setattr(kernels.race._launch, "empty", nan_empty)


def _case(kind: str, rows: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=gen) * 3
    race = torch.empty(rows, vocab).exponential_(1, generator=gen)
    if kind == "filtered":  # after top-k / top-p: most scores -inf, never drawn
        scores[torch.rand(rows, vocab, generator=gen) < 0.9] = float("-inf")
        scores[:, -1] = 0.0  # at least one kept token per row, the last one (crosses every chunk)
    elif kind == "ties":  # equal keys in several chunks: the lowest index wins, as torch.argmax
        scores.fill_(1.0)
        race.fill_(1.0)
    elif kind == "nan_rows":  # a NaN score never wins; an all-NaN row gives 0
        scores[0] = float("nan")
        if rows > 1:
            scores[1, ::2] = float("nan")
    elif kind == "zero_draw":  # a draw of 0 makes its token's key +inf; against a -inf score the key is NaN
        race[:, vocab // 2] = 0.0
        if rows > 1:
            scores[1, vocab // 2] = float("-inf")
    return scores.to(DEVICE), race.to(DEVICE)


@pytest.mark.parametrize("kind", ["plain", "filtered", "ties", "nan_rows", "zero_draw"])
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 255), (5, 257), (2, 700), (7, 1100)])
def test_race_argmax_equals_the_reference(kind, rows, vocab, poisoned):
    scores, race = _case(kind, rows, vocab, seed=rows * vocab)
    want = naive.race_argmax(scores, race)
    got = kernels.race_argmax(scores, race)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, want), (got, want)
    if kind == "ties":
        assert bool((got == 0).all())
    if kind == "nan_rows":
        assert int(got[0]) == 0 and (rows == 1 or int(got[1]) % 2 == 1)
    if kind == "zero_draw" and rows > 1:
        assert int(got[0]) == vocab // 2 and int(got[1]) != vocab // 2


@pytest.mark.parametrize("kind", ["plain", "filtered", "ties", "nan_rows"])
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 255), (5, 257), (7, 1100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_without_draws_equals_the_reference(kind, rows, vocab, dtype, poisoned):
    """`race` None: a greedy draft's argmax of the logits in their own dtype; where no score is NaN it is exactly
    `torch.argmax` (ties: the lowest index)."""
    scores = _case(kind, rows, vocab, seed=rows + vocab)[0].to(dtype)
    got = kernels.race_argmax(scores, None)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, naive.race_argmax(scores, None)), got
    if kind != "nan_rows":
        assert torch.equal(got, scores.argmax(dim=-1))
    else:
        assert int(got[0]) == 0 and (rows == 1 or int(got[1]) % 2 == 1)


def test_race_argmax_twice_in_a_row_reuses_its_tickets(poisoned):
    """The per-row tickets are zeroed by the merging program: a second launch merges again (a ticket left nonzero
    would skip the merge and leave the poisoned output)."""
    for seed in range(3):
        scores, race = _case("plain", 4, 1100, seed)
        assert torch.equal(kernels.race_argmax(scores, race), naive.race_argmax(scores, race))


def test_race_argmax_rejects_mismatched_shapes():
    scores = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="race_argmax: scores and race"):
        kernels.race_argmax(scores, torch.ones(2, 9, device=DEVICE))
