"""`vegas_gamma="auto"` (`hf_vegas.auto_gamma`): the controller's predictions and choices under known step times, and
the loop staying lossless while gamma moves from one iteration to the next (dense steps included)."""

import logging
import random

import pytest
import torch

import hf_vegas
from hf_vegas import auto_gamma, loop
from hf_vegas.assisted import assisted_generate
from hf_vegas.auto_gamma import GammaController, expected_tokens
from hf_vegas.config import AUTO_GAMMAS

from distribution import ROWS, chi_square_p_value, exact_distribution, vegas_samples
from tiny_models import ragged_batch, tiny_model

SPARSE = dict(vegas_sparsity=0.1, vegas_min_tokens=8)


def _draw(acceptance: list[float], gamma: int, rng: random.Random) -> int:
    """Drafts accepted when position i is accepted with chance acceptance[i] (the last entry beyond the list)."""
    accepted = 0
    while accepted < gamma and rng.random() < acceptance[min(accepted, len(acceptance) - 1)]:
        accepted += 1
    return accepted


def test_expected_tokens_matches_a_simulated_acceptance():
    rng = random.Random(0)
    for acceptance, gamma in [([0.9], 6), ([0.5], 2), ([0.99, 0.9, 0.6], 8), ([0.0], 4), ([0.95, 0.95, 0.3], 6)]:
        draws = 40_000
        mean = sum(_draw(acceptance, gamma, rng) + 1 for _ in range(draws)) / draws
        assert abs(mean - expected_tokens(acceptance, gamma)) < 0.03 * expected_tokens(acceptance, gamma)


class _FakeClock:
    """Drives a controller with given step times: every iteration of gamma g takes g * draft + rest[g] (or dense)."""

    def __init__(self, controller, monkeypatch, draft: float, rest: dict, dense: float):
        self.controller, self.draft, self.rest, self.dense, self.now = controller, draft, rest, dense, 0.0
        monkeypatch.setattr(auto_gamma.time, "perf_counter", lambda: self.now)

    def iterate(self, acceptance: list[float], rng: random.Random, rows: int, first_cost: float = 0.0,
                remaining: float | None = None) -> int:
        gamma = self.controller.gamma
        self.now += self.dense if gamma == 0 else gamma * self.draft + self.rest[gamma]
        if gamma not in self.controller.visited:
            self.now += first_cost  # a kernel compiling at the arm's first iteration
        marks = None if gamma == 0 else (0.0, gamma * self.draft)  # the draft's start and end on the host clock
        self.controller.observe([_draw(acceptance, gamma, rng) for _ in range(rows)], timed=True,
                                remaining=remaining, gamma=gamma, draft=marks)
        return gamma


def _run(monkeypatch, draft, rest, dense, acceptance, iterations=100, rows=16, first_cost=0.0):
    controller = GammaController(AUTO_GAMMAS, rows, torch.device("cpu"))
    clock = _FakeClock(controller, monkeypatch, draft, rest, dense)
    rng = random.Random(1)
    return controller, [clock.iterate(acceptance, rng, rows, first_cost) for _ in range(iterations)]


def _true_rate(gamma, draft, rest, dense, acceptance):
    return 1 / dense if gamma == 0 else expected_tokens(acceptance, gamma) / (gamma * draft + rest[gamma])


def test_a_cheap_draft_step_settles_on_the_best_drafting_gamma_after_trying_the_dense_path(monkeypatch):
    """The batch-64 shape: a draft step costs a quarter of a dense one, the verification a bit more than it."""
    draft, rest, dense, acceptance = 1.5, {g: 8.0 + 0.1 * g for g in AUTO_GAMMAS}, 6.0, [0.85]
    controller, gammas = _run(monkeypatch, draft, rest, dense, acceptance)
    best = max(AUTO_GAMMAS, key=lambda g: _true_rate(g, draft, rest, dense, acceptance))
    assert 0 in gammas, "the dense path could win until it is timed: it must be tried"
    settled = gammas[-1]
    assert gammas[-20:] == [settled] * 20 and settled > 0
    assert _true_rate(settled, draft, rest, dense, acceptance) >= (1 - auto_gamma.MARGIN) * _true_rate(
        best, draft, rest, dense, acceptance)
    assert controller.times.dense == pytest.approx(dense)


def test_a_draft_step_as_dear_as_a_dense_one_decodes_densely_and_says_so_once(monkeypatch, caplog):
    """The batch-1 shape: weights dominate, a draft step costs what a dense step does."""
    with caplog.at_level(logging.INFO, logger="hf_vegas"):
        _, gammas = _run(monkeypatch, draft=5.0, rest={g: 5.5 for g in AUTO_GAMMAS}, dense=5.0, acceptance=[0.7])
    assert gammas[-40:] == [0] * 40
    said = [r.getMessage() for r in caplog.records if "decodes densely" in r.getMessage()]
    assert len(said) == 1 and "x the dense path" in said[0]


def test_low_acceptance_prefers_short_drafts_and_high_acceptance_long_ones(monkeypatch):
    rest = {g: 8.0 for g in AUTO_GAMMAS}
    _, low = _run(monkeypatch, draft=1.0, rest=rest, dense=7.9, acceptance=[0.5])
    _, high = _run(monkeypatch, draft=1.0, rest=rest, dense=7.9, acceptance=[0.97])
    assert low[-1] < high[-1]
    assert low[-1] == max(AUTO_GAMMAS, key=lambda g: _true_rate(g, 1.0, rest, 7.9, [0.5]))
    assert high[-1] == max(AUTO_GAMMAS)


def test_acceptance_that_falls_with_depth_is_modelled_per_position(monkeypatch):
    """Drafts past the second are mostly rejected: one per-token rate would favour long drafts, the per-position
    estimate finds that two pay best."""
    rest, acceptance = {g: 8.0 for g in AUTO_GAMMAS}, [0.97, 0.95, 0.2]
    controller, gammas = _run(monkeypatch, draft=1.0, rest=rest, dense=7.9, acceptance=acceptance)
    assert max(AUTO_GAMMAS, key=lambda g: _true_rate(g, 1.0, rest, 7.9, acceptance)) == 2
    assert gammas[-30:] == [2] * 30
    estimate = controller.acceptance(0)
    assert estimate[0] > 0.85 and estimate[2] < 0.5


def test_an_arms_first_iteration_is_not_timed(monkeypatch):
    """A kernel that compiles at an arm's first iteration (eager steps have no graph preparations to flag it) must
    not rule the arm out."""
    draft, rest, dense, acceptance = 1.0, {g: 8.0 for g in AUTO_GAMMAS}, 7.9, [0.97]
    controller, gammas = _run(monkeypatch, draft, rest, dense, acceptance, first_cost=500.0)
    assert gammas[-1] == max(AUTO_GAMMAS)
    assert max(controller.times.rest.values()) < 9.0 and controller.times.draft_step < 1.5


def test_untimed_iterations_leave_the_times_alone(monkeypatch):
    controller = GammaController(AUTO_GAMMAS, 2, torch.device("cpu"))
    clock = _FakeClock(controller, monkeypatch, draft=1.0, rest={g: 4.0 for g in AUTO_GAMMAS}, dense=3.0)
    controller.observe([None, None], timed=True)  # the first sync only starts the clock
    clock.now += 1000.0  # a capture or a compilation
    controller.observe([3, 6], timed=False)
    assert controller.times.draft_step is None and not controller.times.rest
    clock.iterate([0.9], random.Random(0), 2)
    assert controller.times.rest[controller.gamma] == pytest.approx(4.0)


def test_a_draft_queued_ahead_on_the_host_clock_counts_in_the_iteration_that_verifies_it(monkeypatch):
    """Off CUDA a draft queued ahead runs at once, inside the iteration that queued it; its time moves to the next
    iteration, which verifies it, so an arm's rest of an iteration stays its own when the arm changes (here: draft
    steps of 1 s, 10 s of verification and acceptance, gamma 2 twice then gamma 8 twice, each draft queued ahead)."""
    controller = GammaController((2, 8), 1, torch.device("cpu"))
    now = [0.0]
    monkeypatch.setattr(auto_gamma.time, "perf_counter", lambda: now[0])
    controller.start_clock()
    now[0] += 2.0  # the first draft, in order
    marks = (0.0, 2.0)
    for ran, following in [(2, 2), (2, 8), (8, 8), (8, None)]:
        now[0] += 10.0  # verification and acceptance
        queued = None
        if following is not None:  # the next draft, run at once
            queued = (now[0], now[0] + following)
            now[0] += following
        controller.observe([ran], timed=True, gamma=ran, draft=marks, queued=queued)
        marks = queued
    assert controller.times.rest == {2: pytest.approx(10.0), 8: pytest.approx(10.0)}
    assert controller.times.draft_step == pytest.approx(1.0)


def test_a_pooled_bucket_keeps_its_times_and_starts_where_the_last_call_ended(monkeypatch):
    bucket = object.__new__(type("Bucket", (), {}))  # any weak-referenceable object stands for pooled graphs
    first = GammaController(AUTO_GAMMAS, 4, torch.device("cpu"), pool_key=bucket, decoding="greedy")
    clock = _FakeClock(first, monkeypatch, draft=5.0, rest={g: 5.5 for g in AUTO_GAMMAS}, dense=5.0)
    rng = random.Random(0)
    for _ in range(60):
        clock.iterate([0.7], rng, 4)
    assert first.gamma == 0
    second = GammaController(AUTO_GAMMAS, 4, torch.device("cpu"), pool_key=bucket, decoding="greedy")
    assert second.gamma == 0 and second.times is first.times
    sampling = GammaController(AUTO_GAMMAS, 4, torch.device("cpu"), pool_key=bucket, decoding="sample")
    assert sampling.gamma == 6 and sampling.times is not first.times, "another decoding's steps take other times"
    assert GammaController(AUTO_GAMMAS, 4, torch.device("cpu")).gamma == 6  # a fresh bucket starts in the middle


# -- the loop with a moving gamma -------------------------------------------------------------------------------


@pytest.fixture
def schedule(monkeypatch):
    """Replaces the controller's decisions with a fixed cycle of gammas, one per iteration (0: a dense step). Returns
    the gamma each iteration should run: the choice as of the synchronisation before it, or, when its draft was
    queued ahead (`queued_for` counts which iterations), as of the one before that."""
    cycle, queued_for = [2, 0, 8, 4, 0, 0, 6, 2, 8], set()

    def observe(self, accepted, timed, remaining=None, gamma=None, draft=None, queued=None):
        assert (draft is None) == (gamma == 0), "a drafting iteration's draft is timed, a dense one has none"
        self.step = getattr(self, "step", 0) + 1
        self.gamma = cycle[self.step % len(cycle)]

    draft_ahead = loop.DecodeLoop._draft_ahead

    def counted(decode_loop):
        queued_for.add(len(decode_loop.gammas))  # the index of the iteration that will verify it
        return draft_ahead(decode_loop)

    monkeypatch.setattr(GammaController, "observe", observe)
    monkeypatch.setattr(loop.DecodeLoop, "_draft_ahead", counted)

    def expected(iterations: int) -> list[int]:
        choice = [6] + [cycle[s % len(cycle)] for s in range(1, iterations)]  # after the s-th synchronisation
        return [choice[i - 1] if i in queued_for else choice[i] for i in range(iterations)]

    return expected, queued_for


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_stays_vanilla_while_gamma_moves(arch, schedule):
    model = tiny_model(arch)
    ids, mask = ragged_batch([80, 61, 37])
    common = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma="auto", return_dict_in_generate=True,
                         **SPARSE)
    torch.testing.assert_close(out.sequences, expected, rtol=0, atol=0)
    expected, queued_for = schedule
    ran = out.gammas.tolist()
    assert ran == expected(len(ran)), "the output records the gamma each iteration ran"
    assert {0, 2, 4, 8} <= set(ran), "dense steps and every arm ran"
    assert len(queued_for) >= 3, "drafts were queued ahead, a choice acting one iteration later"
    dense = out.gammas == 0
    assert bool((out.accepted[:, dense] <= 0).all()) and bool((out.accepted[:, ~dense] >= 1).any())


@pytest.mark.parametrize("start,then", [(2, 0), (0, 2)])
def test_sampling_keeps_vanilla_distribution_while_gamma_moves(start, then, monkeypatch):
    """Three new tokens take two iterations: a short draft then a dense step, or a dense step then a draft."""
    monkeypatch.setattr(auto_gamma, "START", start)
    monkeypatch.setattr(GammaController, "observe",
                        lambda self, accepted, timed, **kwargs:
                        setattr(self, "gamma", then))
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    counts, out = vegas_samples(model, prompt, vegas_gamma="auto", vegas_sparsity=0.05, vegas_min_tokens=2)
    p_value = chi_square_p_value(counts, exact_distribution(model, prompt), ROWS)
    print(f"moving gamma: p={p_value:.3g} gammas={out.gammas.tolist()}")
    assert out.gammas.tolist()[:2] == [start, then]
    drafted = out.accepted[:, 0 if start else 1]
    assert ((drafted >= 0) & (drafted < 2)).any(), "some drafts must be rejected to exercise resampling"
    assert p_value > 1e-3


def test_auto_greedy_on_the_real_model_is_vanilla(smollm2):
    model, tokenizer = smollm2
    ids = hf_vegas.real_models.long_prompt(tokenizer, 1024)
    expected = model.generate(ids, max_new_tokens=48, do_sample=False)
    out = model.generate(ids, max_new_tokens=48, do_sample=False, custom_generate="vegas", vegas_gamma="auto",
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.gammas[0] == 6 and out.gammas.numel() == out.accepted.shape[1]


def test_fixed_gammas_are_recorded_as_they_ran():
    model = tiny_model("llama")
    ids, mask = ragged_batch([30, 20])
    for gamma in (0, 3):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                             custom_generate="vegas", vegas_gamma=gamma, return_dict_in_generate=True)
        assert out.gammas.tolist() == [gamma] * out.accepted.shape[1]


def test_the_assisted_loop_refuses_auto():
    model = tiny_model("llama")
    ids, _ = ragged_batch([30])
    with pytest.raises(ValueError, match="vegas_gamma='auto'"):
        assisted_generate(model, ids, vegas_gamma="auto", max_new_tokens=4)


def test_an_unprepared_arm_must_pay_for_its_preparation_over_the_tokens_left(monkeypatch):
    """gamma 8 is predicted 14 % faster than 6 here (it borrows 6's verification time), and its graphs were never
    prepared in this bucket. Preparing an arm cost 200 s (the untimed iterations measured at the start, against 16 s
    per iteration); over 100 tokens left (about 14 iterations) the gain saves 29 s, so the arm stays; over a million
    tokens it pays, and it moves. An arm already timed in the bucket needs no such payback."""
    def controller_after_start(remaining):
        controller = GammaController((6, 8), 4, torch.device("cpu"))
        clock = _FakeClock(controller, monkeypatch, draft=1.0, rest={6: 10.0, 8: 10.0}, dense=1e9)
        controller.observe([None] * 4, timed=True)  # the first sync starts the clock
        for _ in range(2):  # the start arm's graphs prepared: two untimed iterations
            clock.now += 100.0
            controller.observe([6] * 4, timed=False)
        rng = random.Random(0)
        for _ in range(20):
            clock.iterate([1.0], rng, 4, remaining=remaining)
        return controller, clock, rng

    assert controller_after_start(None)[0].times.prepare == pytest.approx(200.0)
    assert controller_after_start(1e6)[0].gamma == 8
    assert controller_after_start(None)[0].gamma == 8, "without a count of the tokens left, nothing holds a move back"
    stays, clock, rng = controller_after_start(100.0)  # last: its clock is the one `time.perf_counter` reads
    rates = stays.rates()
    assert rates[8] > 1.1 * rates[6], "gamma 8 predicts more than the margin"
    assert 100 * (1 / rates[6] - 1 / rates[8]) < 200.0
    assert stays.gamma == 6, "100 tokens at this gain do not pay 200 s of preparation"
    stays.times.rest[8] = 10.0  # timed before in this bucket: prepared
    for _ in range(4):
        clock.iterate([1.0], rng, 4, remaining=100.0)
    assert stays.gamma == 8


def test_another_arms_stale_time_does_not_keep_it_out():
    """Seen at batch 1 on the H100: gamma 6's rest of an iteration, timed once while its kernels were still warming,
    stayed 10x too high while gamma 8 ran, so 6 never looked better again. Every arm is predicted with the current
    arm's rest (it barely depends on gamma): the drafts past the 6th, mostly rejected, make 6 the better arm."""
    controller = GammaController((6, 8), 1, torch.device("cpu"))
    controller.gamma = 8
    controller.times.draft_step, controller.times.rest = 1.0, {6: 40.0, 8: 3.6}
    for _ in range(30):  # positions 1-6 accepted, 7 rejected
        controller._count(0, 6, 8)
    rates = controller.rates()
    assert rates[6] > 1.05 * rates[8]
    assert rates[6] == pytest.approx(expected_tokens(controller.acceptance(0), 6) / (6 * 1.0 + 3.6))


def test_a_fresh_buckets_first_preparation_is_measured_whole(monkeypatch):
    """The clock starts before the first iteration (`start_clock`, after the prefill's synchronisation): the eager
    warm-up of the start arm counts in the preparation cost, not only the capture after it."""
    controller = GammaController(AUTO_GAMMAS, 2, torch.device("cpu"))
    clock = _FakeClock(controller, monkeypatch, draft=1.0, rest={g: 4.0 for g in AUTO_GAMMAS}, dense=3.0)
    controller.start_clock()
    clock.now += 30.0  # the eager warm-up (kernels compile)
    controller.observe([6, 6], timed=False)
    clock.now += 20.0  # the capture
    controller.observe([6, 6], timed=False)
    clock.iterate([0.9], random.Random(0), 2)
    assert controller.times.prepare == pytest.approx(50.0)
