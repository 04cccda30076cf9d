"""CUDA-graph steps (`hf_vegas.graphs`): same tokens as the eager steps, captured once per bucket and reused across
`generate` calls, eager fallback with its reason logged once. The GPU tests skip on the CPU; the CPU tests drive the
same pool, restart and fallback code (on the CPU a capture fails, so the fallback is what runs)."""

import logging
import weakref

import pytest
import torch

import hf_vegas
from hf_vegas import graphs
from hf_vegas.cache import VegasCache
from hf_vegas.runner import StepRunner
from hf_vegas.config import VegasConfig
from hf_vegas._compat.internals import CACHE_KEYWORD
from tiny_models import BUILDERS, ragged_batch, tiny_model

SPARSE = dict(vegas_sparsity=0.1, vegas_min_tokens=8)
MOE_ARCHS = {"deepseek_v3"}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (CPU counterparts below)")


@pytest.fixture(autouse=True)
def _fresh_pool():
    graphs.release_graphs()
    graphs._LOGGED.clear()
    yield
    graphs.release_graphs()


def _generate(model, ids, mask, max_new_tokens=16, **kwargs):
    common = dict(attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=0, return_dict_in_generate=True)
    return model.generate(ids, **common, custom_generate="vegas", **SPARSE, **kwargs)


def _pooled_graphs(model) -> graphs.StepGraphs:
    steps = graphs.pooled_graphs(model)
    assert steps is not None, "the generation should have pooled its cache and graphs"
    return steps


@needs_gpu
@pytest.mark.parametrize("arch", list(BUILDERS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_graph_steps_give_the_eager_tokens(arch, backend):
    model = tiny_model(arch).cuda()
    ids, mask = (t.cuda() for t in ragged_batch([80, 61, 37]))
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    eager = _generate(model, ids, mask, vegas_gamma=4, vegas_backend=backend, vegas_cuda_graphs=False)
    graphed = _generate(model, ids, mask, vegas_gamma=4, vegas_backend=backend)
    torch.testing.assert_close(graphed.sequences, vanilla, rtol=0, atol=0)
    torch.testing.assert_close(graphed.accepted, eager.accepted, rtol=0, atol=0)
    steps = _pooled_graphs(model)
    if arch in MOE_ARCHS and steps.disabled_reason is not None:
        # transformers' eager MoE routing syncs with the host (`nonzero`), which a CUDA graph cannot hold: the steps
        # fall back to eager ones, with the reason logged, and the tokens above are still vanilla's.
        assert "capturing" in steps.disabled_reason
        return
    assert steps.disabled_reason is None
    assert steps.captures == 3 and steps.replays > 0, "one draft, one verify and one acceptance graph, replayed"


@needs_gpu
@pytest.mark.parametrize("policy,gamma", [("streaming", 3), ("vegas", 0)])
def test_graph_steps_streaming_and_dense(policy, gamma):
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in ragged_batch([50, 33]))
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    extra = SPARSE if gamma else {}
    common = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=0, do_sample=False)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=gamma, vegas_policy=policy, **extra)
    torch.testing.assert_close(out, vanilla, rtol=0, atol=0)
    assert _pooled_graphs(model).captures == (3 if gamma else 2), "draft, verify / decode, and acceptance graphs"


@needs_gpu
@pytest.mark.parametrize("gamma", [0, 4])
def test_compiled_graph_steps_give_the_vanilla_tokens(gamma):
    model = tiny_model("qwen3").cuda()
    ids, mask = (t.cuda() for t in ragged_batch([60, 41, 23]))
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    extra = SPARSE if gamma else {}
    common = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=0, do_sample=False, custom_generate="vegas")
    out = model.generate(ids, **common, vegas_gamma=gamma, vegas_compile=True, return_dict_in_generate=True, **extra)
    torch.testing.assert_close(out.sequences, vanilla, rtol=0, atol=0)
    steps = _pooled_graphs(model)
    assert steps.disabled_reason is None and steps.captures == (3 if gamma else 2)


@needs_gpu
@pytest.mark.parametrize("gamma", [0, 4])
def test_graph_steps_return_vanilla_scores_logits_and_continue_a_prompt_cache(gamma):
    """Scores and logits copied out of the graphs' output buffers before the next replay; a prefilled prompt cache
    and an embedded prompt (CPU counterparts: test_generate_features.py)."""
    import copy

    from transformers import DynamicCache

    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in ragged_batch([70, 41, 52]))
    prompt_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :30], attention_mask=mask[:, :30], **{CACHE_KEYWORD: prompt_cache})
    embeds = model.get_input_embeddings()(ids)
    common = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=0, do_sample=False, inputs_embeds=embeds,
                  return_dict_in_generate=True, output_scores=True, output_logits=True, repetition_penalty=1.2)
    vanilla = model.generate(ids, **common, **{CACHE_KEYWORD: copy.deepcopy(prompt_cache)})
    extra = SPARSE if gamma else {}
    out = model.generate(ids, **common, **{CACHE_KEYWORD: prompt_cache}, custom_generate="vegas", vegas_gamma=gamma,
                         **extra)
    assert _pooled_graphs(model).replays > 0
    torch.testing.assert_close(out.sequences, vanilla.sequences, rtol=0, atol=0)
    for name in ("scores", "logits"):
        torch.testing.assert_close(torch.stack(getattr(out, name)), torch.stack(getattr(vanilla, name)),
                                   rtol=1e-3, atol=1e-3)


@needs_gpu
def test_graph_sampling_draws_the_eager_tokens():
    """Draft sampling and speculative acceptance run inside the graphs, on bit-identical logits, drawing from the
    default generator's Philox stream at the offsets the eager ops use: one seed gives the eager tokens."""
    model = tiny_model("qwen3", seed=3).cuda()
    ids, mask = (t.cuda() for t in ragged_batch([60, 41], seed=3))
    runs = []
    for use_graphs in (False, True):
        torch.manual_seed(7)
        runs.append(_generate(model, ids, mask, vegas_gamma=3, do_sample=True, temperature=0.6, top_p=0.95,
                              vegas_cuda_graphs=use_graphs).sequences)
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


@needs_gpu
def test_graphs_replayed_by_a_later_call_follow_its_settings():
    """A pooled graph bakes in what it captured: a later call of the same bucket with other processor settings, another
    length budget or other EOS ids must get graphs of its own or feed them as inputs, never replay stale ones."""
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in ragged_batch([60, 41, 52]))
    settings = [dict(do_sample=True, temperature=0.6, top_p=0.95), dict(do_sample=True, temperature=1.3, top_k=5),
                dict(do_sample=True, temperature=0.6, top_p=0.95, min_p=0.05)]
    for sampling in settings:
        runs = []
        for use_graphs in (False, True):
            torch.manual_seed(11)
            runs.append(_generate(model, ids, mask, vegas_gamma=3, vegas_cuda_graphs=use_graphs, **sampling).sequences)
        torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0, msg=f"graphs differ from eager at {sampling}")
    greedy = dict(attention_mask=mask, pad_token_id=0, do_sample=False)
    for max_new, eos in ((16, None), (9, None), (16, 7), (12, [7, 11])):
        vanilla = model.generate(ids, **greedy, max_new_tokens=max_new, eos_token_id=eos)
        out = model.generate(ids, **greedy, max_new_tokens=max_new, eos_token_id=eos, custom_generate="vegas",
                             vegas_gamma=3, **SPARSE)
        torch.testing.assert_close(out, vanilla, rtol=0, atol=0, msg=f"max_new_tokens={max_new}, eos={eos}")
    assert _pooled_graphs(model).replays > 0


def _sampling_after_greedy(model, ids, mask):
    """(sampling run alone, the same sampling run after a greedy call of the same bucket), one seed."""
    sampling = dict(vegas_gamma=4, do_sample=True, temperature=0.6, top_p=0.95)
    torch.manual_seed(5)
    alone = _generate(model, ids, mask, **sampling).sequences
    graphs.release_graphs(model)
    _generate(model, ids, mask, vegas_gamma=4, do_sample=False)  # captures draft, verify and acceptance for greedy
    torch.manual_seed(5)
    return alone, _generate(model, ids, mask, **sampling).sequences  # reuses the verify graph, captures the rest


@needs_gpu
def test_sampling_after_greedy_reads_intact_drafts():
    """Sampling after a greedy call of the same bucket captures its draft step after the verification graph that both
    share. In one shared memory pool the verification's intermediates overwrote those drafts and their scores (an
    H100 run at batch 64 hit out-of-range draft tokens, another accepted every draft): each graph has its own."""
    model = tiny_model("llama", seed=4).cuda()
    ids, mask = (t.cuda() for t in ragged_batch([90, 71, 64], seed=4))
    alone, after_greedy = _sampling_after_greedy(model, ids, mask)
    torch.testing.assert_close(after_greedy, alone, rtol=0, atol=0)
    steps = _pooled_graphs(model)
    assert steps.captures == 5, "greedy's three graphs, then sampling's draft and acceptance (verify is shared)"
    pools = [state.graph.pool() for state in steps._steps.values() if isinstance(state, graphs._Captured)]
    assert len(set(pools)) == len(pools) == 5, "every captured step must own its memory pool"


def test_sampling_after_greedy_through_the_pool_on_cpu(pooled_on_cpu):
    """CPU counterpart: the same calls through the pooled cache (captures fail, steps run eagerly) draw the tokens of
    a sampling run alone."""
    model = tiny_model("llama", seed=4)
    alone, after_greedy = _sampling_after_greedy(model, *ragged_batch([90, 71, 64], seed=4))
    torch.testing.assert_close(after_greedy, alone, rtol=0, atol=0)


@needs_gpu
def test_graphs_are_reused_across_calls_and_recaptured_when_weights_move():
    model = tiny_model("llama").cuda()
    first_ids, first_mask = (t.cuda() for t in ragged_batch([70, 52], seed=1))
    second_ids, second_mask = (t.cuda() for t in ragged_batch([66, 60], seed=2))  # same capacity bucket
    first = _generate(model, first_ids, first_mask, vegas_gamma=4, do_sample=False)
    steps = _pooled_graphs(model)
    cache = graphs.pooled_cache(model)
    second = _generate(model, second_ids, second_mask, vegas_gamma=4, do_sample=False)
    assert graphs.pooled_cache(model) is cache and _pooled_graphs(model) is steps
    assert getattr(first, CACHE_KEYWORD) is None and getattr(second, CACHE_KEYWORD) is None, \
        "outputs never hold the pooled cache"
    assert steps.captures == 3, "the second call replays the first call's graphs"
    vanilla = model.generate(second_ids, attention_mask=second_mask, max_new_tokens=16, do_sample=False,
                             pad_token_id=0)
    torch.testing.assert_close(second.sequences, vanilla, rtol=0, atol=0)
    model.to(torch.float64).to(torch.float32)  # new weight tensors: the old graphs would read freed memory
    third = _generate(model, second_ids, second_mask, vegas_gamma=4, do_sample=False)
    assert _pooled_graphs(model) is not steps
    torch.testing.assert_close(third.sequences, vanilla, rtol=0, atol=0)


@needs_gpu
def test_failed_capture_falls_back_eagerly_with_one_warning(caplog):
    model = tiny_model("llama").cuda()

    def syncs_while_capturing(module, args):
        if torch.cuda.is_current_stream_capturing():
            args[0].sum().item()  # a host synchronisation: refused inside a capture

    model.model.layers[1].register_forward_pre_hook(syncs_while_capturing)
    ids, mask = (t.cuda() for t in ragged_batch([50, 33]))
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    with caplog.at_level(logging.WARNING, logger="hf_vegas"):
        for _ in range(2):
            out = _generate(model, ids, mask, vegas_gamma=3, do_sample=False)
            torch.testing.assert_close(out.sequences, vanilla, rtol=0, atol=0)
    warnings = [r for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "capturing the" in warnings[0].getMessage()


@needs_gpu
def test_a_failed_capture_leaves_the_random_generator_usable():
    """A capture that fails after drawing random numbers (the sampled steps draw inside the graph) must not leave
    CUDA's generator marked as capturing: the eager steps' sampling and the user's own random ops go on working."""
    model = tiny_model("llama").cuda()

    def syncs_while_capturing(module, args):
        if torch.cuda.is_current_stream_capturing():
            args[0].sum().item()

    model.model.layers[1].register_forward_pre_hook(syncs_while_capturing)
    ids, mask = (t.cuda() for t in ragged_batch([50, 33]))
    torch.manual_seed(0)
    for _ in range(2):
        out = _generate(model, ids, mask, vegas_gamma=3, do_sample=True, top_p=0.9)
        assert out.sequences.shape[1] == ids.shape[1] + 16
    assert "capturing the" in _pooled_graphs(model).disabled_reason
    assert torch.rand(1000, device="cuda").std() > 0.1


@needs_gpu
def test_auto_gamma_replays_its_graphs_and_a_later_call_starts_where_the_last_ended():
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in ragged_batch([80, 61, 37]))
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    first = _generate(model, ids, mask, vegas_gamma="auto", max_new_tokens=40)
    second = _generate(model, ids, mask, vegas_gamma="auto", max_new_tokens=40)
    for out in (first, second):
        torch.testing.assert_close(out.sequences, vanilla, rtol=0, atol=0)
    assert second.gammas[0] == first.gammas[-1]
    steps = _pooled_graphs(model)
    assert steps.disabled_reason is None and steps.replays > 0


@needs_gpu
def test_a_moving_gamma_captures_each_arms_steps_once_and_replays_them(monkeypatch):
    """gamma='auto' forced through every arm in turn (CPU counterpart: tests/test_auto_gamma.py's schedule): one
    draft, verify and acceptance graph per drafting arm, one dense step and its acceptance, all replayed."""
    from hf_vegas.auto_gamma import GammaController
    from hf_vegas.config import AUTO_GAMMAS

    cycle = [*AUTO_GAMMAS, 0]
    observed = []

    def observe(self, accepted, timed, remaining=None, **marks):  # (the arm that ran and its draft's marks)
        # Each choice holds for two iterations: the draft queued ahead runs the choice before the last sync, so a
        # choice replaced at every sync would never run where a draft was queued (the dense arm, here).
        observed.append(1)
        if len(observed) % 2 == 0:
            self.gamma = cycle[(cycle.index(self.gamma) + 1) % len(cycle)]

    monkeypatch.setattr(GammaController, "observe", observe)
    model = tiny_model("llama").cuda()
    ids, mask = (t.cuda() for t in ragged_batch([80, 61, 37]))
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=100, do_sample=False, pad_token_id=0)
    out = _generate(model, ids, mask, vegas_gamma="auto", max_new_tokens=100)
    torch.testing.assert_close(out.sequences, vanilla, rtol=0, atol=0)
    ran = out.gammas.tolist()
    assert all(ran.count(g) >= 2 for g in cycle), str(ran)
    steps = _pooled_graphs(model)
    assert steps.disabled_reason is None
    assert steps.captures == 3 * len(AUTO_GAMMAS) + 2 and steps.replays > steps.captures


# -- CPU counterparts -------------------------------------------------------------------------------------------


def test_cpu_runs_eagerly_and_says_why_once(caplog):
    model = tiny_model("llama")
    ids, mask = ragged_batch([40, 25])
    with caplog.at_level(logging.INFO, logger="hf_vegas"):
        for _ in range(2):
            out = _generate(model, ids, mask, vegas_gamma=3, do_sample=False)
    assert model not in graphs._POOL, "nothing is pooled without graphs"
    reasons = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert reasons == ["hf_vegas runs its steps eagerly: CUDA graphs need a CUDA device, the model is on cpu."]
    assert getattr(out, CACHE_KEYWORD).capacity == 40 + 16 + 2 * 3 + 1, "no bucket rounding without graphs"


@pytest.fixture
def pooled_on_cpu(monkeypatch):
    """Lift the device check so CPU models go through the pool; their captures fail as on a CPU-only build (also on
    a GPU box, where capturing CPU ops would record an empty graph)."""
    device_check = graphs.no_graph_reason
    monkeypatch.setattr(graphs, "no_graph_reason",
                        lambda config, device, layer_devices=None: device_check(config, "cuda", layer_devices))

    def no_cuda():
        raise RuntimeError("no CUDA graphs for a CPU model")

    monkeypatch.setattr(graphs.torch.cuda, "CUDAGraph", no_cuda)


def test_pooled_cache_restarts_cleanly_and_a_failed_capture_falls_back(pooled_on_cpu, caplog):
    """The pool hands the same cache to the next call of the bucket (restarted), and the capture at each step kind's
    second call fails, which must fall back to eager with one warning."""
    model = tiny_model("qwen3")
    prompts = [ragged_batch([70, 52], seed=1), ragged_batch([66, 60], seed=2)]
    outputs, caches = [], []
    with caplog.at_level(logging.WARNING, logger="hf_vegas"):
        for ids, mask in prompts:
            outputs.append(_generate(model, ids, mask, vegas_gamma=4, do_sample=False))
            caches.append(graphs.pooled_cache(model))
    assert caches[1] is caches[0] and all(getattr(out, CACHE_KEYWORD) is None for out in outputs)
    assert caches[0].capacity == graphs.CAPACITY_BUCKET
    for (ids, mask), out in zip(prompts, outputs):
        vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(out.sequences, vanilla, rtol=0, atol=0)
    assert len([r for r in caplog.records if "capturing the" in r.getMessage()]) == 1
    cache = weakref.ref(caches[0])
    del caches
    hf_vegas.release_graphs(model)
    assert model not in graphs._POOL and cache() is None, "released caches are freed"


def test_cache_state_keeps_its_tensors_through_every_step():
    """A graph reads the addresses it saw at capture: the cache's cross-step state must only change in place."""
    model = tiny_model("llama")
    config = VegasConfig(gamma=3, sparsity=0.2, min_tokens=4)
    ids, mask = ragged_batch([30, 21])
    cache = VegasCache(model.config, 2, 64, config)
    runner = StepRunner(model, cache, None, do_sample=False)
    names = {"plan": ("lengths", "row_active", "left_pad", "verify_end"),
             "selection": ("sel_idx", "sel_count", "sel_end", "rejection")}
    from hf_vegas.attention import active_cache, vegas_attention

    def state():
        return {(part, name): getattr(getattr(cache, part), name) for part, group in names.items() for name in group}

    with vegas_attention(model), active_cache(cache):
        left_pad = (mask == 0).sum(dim=1)
        before = state()
        runner.prefill(ids, left_pad=left_pad)
        tokens = torch.zeros(2, 64, dtype=torch.long)
        for _ in range(2):
            drafts, _ = runner.draft(ids[:, -1], tokens, [30, 30])
            runner.verify(ids[:, -1], drafts)
            cache.plan.rollback(cache.plan.lengths - 2)
            cache.selection.note_acceptance(torch.tensor([1, 3]), torch.tensor([True, True]))
        cache.restart()
    after = state()
    for key, tensor in before.items():
        assert after[key] is tensor, f"cache.{'.'.join(key)} was replaced, not written in place"


def test_a_new_bucket_frees_the_previous_one(pooled_on_cpu, monkeypatch):
    """Switching shape bucket must free the old cache before allocating the new one (two would not fit at 32K)."""
    model = tiny_model("llama")
    ids, mask = ragged_batch([30, 20])
    common = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=0, return_dict_in_generate=True)
    model.generate(ids, **common, custom_generate="vegas", vegas_gamma=0)
    first = weakref.ref(graphs.pooled_cache(model))
    allocated = []
    original = VegasCache.__init__

    def spy(self, *args, **kwargs):
        allocated.append(first() is None)
        original(self, *args, **kwargs)

    monkeypatch.setattr(VegasCache, "__init__", spy)
    model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3)
    assert allocated == [True], "the gamma=0 cache was still alive when the gamma=3 one was built"


def test_a_busy_pooled_cache_is_never_shared(pooled_on_cpu):
    """A generation started while another holds the pooled cache (a streamer or thread calling generate) gets its
    own cache, eagerly; the pool is untouched."""
    model = tiny_model("llama")
    config = VegasConfig(gamma=3)
    with graphs.cache_for(model, 2, 100, config, "cpu", "torch") as (outer, outer_graphs):
        with graphs.cache_for(model, 2, 100, config, "cpu", "torch") as (inner, inner_graphs):
            assert inner is not outer and inner_graphs is None and outer_graphs is not None
        assert graphs._POOL[model].busy
    assert not graphs._POOL[model].busy
    with graphs.cache_for(model, 2, 100, config, "cpu", "torch") as (again, _):
        assert again is outer, "a finished generation hands the pooled cache back"


def test_an_eager_generation_frees_an_idle_pooled_cache(pooled_on_cpu, monkeypatch):
    model = tiny_model("llama")
    ids, mask = ragged_batch([30, 20])
    common = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=0, return_dict_in_generate=True)
    model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3)
    pooled = weakref.ref(graphs.pooled_cache(model))
    assert model in graphs._POOL
    model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3, vegas_cuda_graphs=False)
    assert model not in graphs._POOL and pooled() is None


def test_compile_without_graphs_warns_once(caplog):
    model = tiny_model("llama")
    ids, mask = ragged_batch([30, 20])
    with caplog.at_level(logging.WARNING, logger="hf_vegas"):
        for _ in range(2):
            _generate(model, ids, mask, vegas_gamma=3, vegas_compile=True, do_sample=False)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["vegas_compile=True has no effect: CUDA graphs need a CUDA device, the model is on cpu."]


def test_the_pool_key_reads_tensor_parallel_shards_where_their_weights_live(tmp_path):
    """Graphs replay with the weights' addresses, so the pool is keyed by them (`_weights_fingerprint`). A `DTensor`
    parameter (`tp_plan="auto"`) has no data pointer of its own (0): the key reads its rank's shard, so sharded
    weights that moved (reloaded, replaced) get new graphs. CPU: one rank of gloo."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed gloo backend")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(8, 4, bias=False)
        model.weight = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)]))
        assert model.weight.data_ptr() == 0, "a DTensor has its own address now: this test shows nothing"
        before = graphs._weights_fingerprint(model)
        assert before == (model.weight.to_local().data_ptr(),) and before != (0,)
        model.weight = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)]))  # "reloaded"
        assert graphs._weights_fingerprint(model) != before
    finally:
        torch.distributed.destroy_process_group()
