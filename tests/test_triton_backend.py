"""`vegas_backend="triton"` end to end: same tokens as the reference backend and as vanilla, on every tiny
architecture; the backend choice is validated before any forward."""

import pytest
import torch

from hf_vegas.ops.backend import resolve_backend
from kernel_cases import DEVICE, import_kernels
from tiny_models import BUILDERS, generation_cache, ragged_batch, tiny_model

kernels_module = import_kernels()

SPARSE = dict(vegas_sparsity=0.1, vegas_min_tokens=8)
# On the CPU every kernel launch runs in Triton's Python interpreter (~30 ms), so these end-to-end runs are short
# (8 new tokens, gamma 3: ~0.5 s per forward of a tiny model); the kernels' own tests cover the shapes.
SHAPES = {"batch1": [80], "ragged3": [80, 61, 37]}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernel ops the attention dispatch calls, so a silent fall-back to the reference fails the test."""
    import hf_vegas_kernels

    calls = {"sparse_draft_attention": 0, "verify_attention": 0}
    for name in calls:
        original = getattr(hf_vegas_kernels, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(hf_vegas_kernels, name, counted)
    return calls


def _on_device(model, *tensors):
    """The kernels run on the GPU when there is one (else in Triton's CPU interpreter)."""
    return (model.to(DEVICE), *(t.to(DEVICE) for t in tensors))


@pytest.mark.parametrize("arch,shape", [(arch, "ragged3") for arch in BUILDERS] + [("qwen3", "batch1")])
def test_triton_greedy_matches_vanilla(arch, shape, kernel_calls):
    model, ids, mask = _on_device(tiny_model(arch), *ragged_batch(SHAPES[shape]))
    common = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3, vegas_backend="triton",
                         return_dict_in_generate=True, **SPARSE)
    cache = generation_cache(model, out)
    assert cache.backend == "triton"
    torch.testing.assert_close(out.sequences, expected, rtol=0, atol=0)
    assert bool((cache.selection.sel_count < cache.selection.sel_end).all()), "the selection must drop tokens"
    assert kernel_calls["sparse_draft_attention"] > 0 and kernel_calls["verify_attention"] > 0


def test_finished_rows_are_skipped_by_the_kernels(monkeypatch):
    """A row that met EOS while others decode gets length 0 in the kernels (they read nothing for it), and every row's
    tokens stay vanilla's."""
    import hf_vegas_kernels

    model, ids, mask = _on_device(tiny_model("llama", seed=2), *ragged_batch([60, 41, 33], seed=2))
    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    free = model.generate(ids, **common)[:, ids.shape[1]:]
    # An EOS that row 0 emits early and the other rows do not emit before their last tokens.
    eos = next(int(t) for t in free[0, 1:6] if not (free[1:, :-2] == t).any())
    kv_lens = []
    original = hf_vegas_kernels.sparse_draft_attention
    monkeypatch.setattr(hf_vegas_kernels, "sparse_draft_attention",
                        lambda *args, **kwargs: kv_lens.append(args[4].tolist()) or original(*args, **kwargs))
    expected = model.generate(ids, **common, eos_token_id=eos)
    out = model.generate(ids, **common, eos_token_id=eos, custom_generate="vegas", vegas_gamma=2,
                         vegas_backend="triton", **SPARSE)
    assert torch.equal(out, expected)
    assert any(lens[0] == 0 and min(lens[1:]) > 0 for lens in kv_lens), "row 0 finished first: skipped after"
    assert kv_lens[0][0] > 0


def test_triton_short_prompts_prefill_through_the_kernels(kernel_calls):
    """Prompts short enough that the prefill itself runs the verification kernel, left pads included."""
    model, ids, mask = _on_device(tiny_model("llama", seed=4), *ragged_batch([14, 9, 5], seed=4))
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=3, vegas_backend="triton",
                         vegas_sparsity=0.3, vegas_min_tokens=2)
    assert torch.equal(out, expected)
    assert kernel_calls["verify_attention"] > 0


@pytest.mark.parametrize("policy,score", [("vegas", "logits"), ("vegas", "weights"), ("last_token", "weights"),
                                          ("streaming", "weights")])
def test_triton_policies_match_reference_backend(policy, score):
    """Same selections, same acceptance, same tokens as the torch reference backend."""
    model, ids, mask = _on_device(tiny_model("mistral", seed=1), *ragged_batch([70, 44], seed=1))
    common = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, custom_generate="vegas",
                  vegas_gamma=3, vegas_policy=policy, vegas_score=score, return_dict_in_generate=True, **SPARSE)
    torch_out = model.generate(ids, **common, vegas_backend="torch")
    triton_out = model.generate(ids, **common, vegas_backend="triton")
    assert torch.equal(triton_out.sequences, torch_out.sequences)
    assert torch.equal(triton_out.accepted, torch_out.accepted)


@pytest.mark.usefixtures("short_windows_draft")
@pytest.mark.parametrize("score", ["logits", "weights"])
def test_triton_windowed_sparse_layers_match_reference_backend(score):
    """Sliding-window layers drafting sparsely inside their window (tests/test_sliding_windows.py): the kernels select
    inside the window and mask what a draft's window left as the reference ops do, and greedy stays vanilla's."""
    model, ids, mask = _on_device(tiny_model("mistral_short_window"), *ragged_batch([80, 47], seed=2))
    common = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    vegas = dict(custom_generate="vegas", vegas_gamma=3, vegas_score=score, return_dict_in_generate=True, **SPARSE)
    torch_out = model.generate(ids, **common, **vegas, vegas_backend="torch")
    triton_out = model.generate(ids, **common, **vegas, vegas_backend="triton")
    assert torch.equal(triton_out.sequences, model.generate(ids, **common))
    assert torch.equal(triton_out.accepted, torch_out.accepted)
    sel = generation_cache(model, triton_out).selection
    assert sel.windows == {0: 40, 1: 40} and bool((sel.cand_start > 0).all())


@pytest.mark.parametrize("balance", [False, True])
def test_triton_boosted_budget_matches_reference_backend(monkeypatch, balance):
    """`budget_boost`: the boosted rows' longer lists run in more splits of the draft kernel (`split_len`; 16-slot
    blocks here, so these short lists need them), each row's own list divided over them where `balance` says so;
    selections, acceptance and tokens stay the reference backend's."""
    from hf_vegas_kernels import _launch
    from hf_vegas_kernels import attention as attention_kernels

    monkeypatch.setitem(_launch.TUNING, "sparse", {**_launch.TUNING["sparse"], "block_n": 16, "waves": 0,
                                                  "balance": balance})
    splits = []
    num_splits = attention_kernels._num_splits

    def recorded(*args):
        result = num_splits(*args)
        split_len = args[6]  # (list_len, programs, block_n, waves, device, nearest, split_len, fill)
        if split_len is not None:  # a draft (dense and verify kernels pass none)
            splits.append(result[0])
        return result

    monkeypatch.setattr(attention_kernels, "_num_splits", recorded)
    model, ids, mask = _on_device(tiny_model("mistral", seed=1), *ragged_batch([70, 44], seed=1))
    common = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, custom_generate="vegas",
                  vegas_gamma=3, vegas_budget_boost=4.0, return_dict_in_generate=True, **SPARSE)
    torch_out = model.generate(ids, **common, vegas_backend="torch")
    triton_out = model.generate(ids, **common, vegas_backend="triton")
    assert (torch_out.accepted < 3).any(), "some draft was rejected: a boost ran"
    assert max(splits) > 1, "the boosted lists took several splits"
    assert torch.equal(triton_out.sequences, torch_out.sequences)
    assert torch.equal(triton_out.accepted, torch_out.accepted)


@pytest.mark.parametrize("top_k", [20, 0])
def test_triton_sampling_draws_the_same_tokens_as_reference_backend(top_k, monkeypatch):
    """Sampling uses the kernels' draft and target probabilities, top-p filter and draft race; with one seed both
    backends draw alike. Without top-k the temperature runs inside the top-p kernel (on the CPU its fp32 reciprocal
    may move a score by one ulp against the warper's exact division: not enough to change these draws)."""
    model, ids, mask = _on_device(tiny_model("qwen3", seed=3), *ragged_batch([60, 33], seed=3))
    common = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=1.3, top_k=top_k, top_p=0.9,
                  pad_token_id=0, custom_generate="vegas", vegas_gamma=3, **SPARSE)
    torch.manual_seed(7)
    torch_out = model.generate(ids, **common, vegas_backend="torch")
    filter_top_p, temperatures = kernels_module.top_p_filter, []

    def spy(scores, top_p, filter_value=float("-inf"), temperature=None):
        temperatures.append(temperature)
        return filter_top_p(scores, top_p, filter_value, temperature)

    monkeypatch.setattr(kernels_module, "top_p_filter", spy)
    torch.manual_seed(7)
    triton_out = model.generate(ids, **common, vegas_backend="triton")
    assert torch.equal(triton_out, torch_out)
    assert temperatures and set(temperatures) == ({1.3} if top_k == 0 else {None}), "folded exactly without top-k"


def test_triton_in_hf_assisted_loop():
    from hf_vegas.assisted import assisted_generate

    model, ids = _on_device(tiny_model("llama"), ragged_batch([50])[0])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = assisted_generate(model, ids, max_new_tokens=12, do_sample=False, pad_token_id=0, vegas_gamma=3,
                            vegas_backend="triton", **SPARSE)
    assert torch.equal(out, expected)


def test_auto_picks_reference_on_cpu_and_triton_on_cuda():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    if torch.cuda.is_available():
        assert resolve_backend("auto", torch.device("cuda")) == "triton"


def test_triton_on_cpu_without_interpreter_is_refused_before_any_forward(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model("llama")
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    ids, mask = ragged_batch([20])
    with pytest.raises(ValueError, match="vegas_backend='triton'.*CUDA"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate="vegas", vegas_backend="triton")
    assert forwards == [] and model.config._attn_implementation == "sdpa"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's bf16 limit concerns CPU runs only")
def test_bf16_model_under_the_interpreter_is_refused_before_any_forward():
    model = tiny_model("llama").to(torch.bfloat16)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    ids, mask = ragged_batch([20])
    with pytest.raises(ValueError, match="vegas_backend='triton'.*bfloat16"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate="vegas", vegas_backend="triton")
    assert forwards == []


def test_a_layer_attending_twice_selects_once(kernel_calls, monkeypatch):
    """DiffLlama attends twice per layer (two value halves, the same queries and keys): the layer emits its scores
    and selects at its first call only, so a verification (and the prefill) selects every layer in one launch (a
    second selection of the last layer would build an index on the host, which a CUDA graph capture refuses)."""
    import hf_vegas_kernels

    selections = []
    original = hf_vegas_kernels.select_topk
    monkeypatch.setattr(hf_vegas_kernels, "select_topk", lambda *a, **k: selections.append(1) or original(*a, **k))
    model, ids, mask = _on_device(tiny_model("diffllama"), *ragged_batch([70, 44]))
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **common)
    out = model.generate(ids, **common, custom_generate="vegas", vegas_gamma=2, vegas_backend="triton",
                         vegas_cuda_graphs=False, return_dict_in_generate=True, **SPARSE)  # graphs replay uncounted
    assert torch.equal(out.sequences, expected)
    verifications = out.accepted.shape[1]
    layers = model.config.num_hidden_layers
    assert kernel_calls["verify_attention"] == verifications * layers  # not twice per layer
    assert len(selections) == verifications + 1  # one launch per verification, and the prefill's
