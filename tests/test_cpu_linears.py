"""CPU linears with the weights on the left (`hf_vegas.cpu_linears`): the same products as `F.linear` up to rounding,
only on few rows, only on plain fp32 CPU layers, and the model is left exactly as it was."""

import pytest
import torch
from torch import nn

from hf_vegas import cpu_linears
from hf_vegas.cpu_linears import weights_left_linears
from tiny_models import ragged_batch, tiny_model


@pytest.mark.parametrize("rows", [1, 3, 7, cpu_linears.MAX_ROWS, cpu_linears.MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_the_products_match_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(37, 53, bias=bias)
    x = torch.randn(rows, 1, 37)  # a (rows, tokens, features) input, as a batch of one-token steps
    with torch.no_grad():
        want = layer(x)
        with weights_left_linears(layer) as changed:
            got = layer(x)
    assert changed == 1
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_plain_fp32_cpu_layers_change_and_all_are_restored():
    plain, half, hooked = nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8)
    hooked.register_forward_hook(lambda module, args, out: out)
    model = nn.Sequential(plain, half, hooked)
    with pytest.raises(RuntimeError, match="inside"):
        with weights_left_linears(model) as changed:
            assert changed == 1 and "forward" in vars(plain)
            assert "forward" not in vars(half) and "forward" not in vars(hooked)
            raise RuntimeError("an error inside the block")
    assert all("forward" not in vars(m) for m in model), "the model is left as it was, also on an exception"
    with weights_left_linears(model, enabled=False) as changed:
        assert changed == 0 and "forward" not in vars(plain)


def test_generate_on_the_cpu_uses_them_and_restores_the_model(monkeypatch):
    """The CPU path runs its few-row linears this way (the greedy tokens stay vanilla's: test_greedy_equivalence),
    prefills keep `F.linear`, and no layer keeps the instance forward after `generate`."""
    model = tiny_model("llama")
    ids, mask = ragged_batch([40, 25])
    seen = []
    original = cpu_linears._weights_left

    def spy(module):
        forward = original(module)

        def recording(x):
            seen.append(x.numel() // x.shape[-1])
            return forward(x)
        return recording

    monkeypatch.setattr(cpu_linears, "_weights_left", spy)
    vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         custom_generate="vegas", vegas_gamma=3, vegas_min_tokens=8)
    torch.testing.assert_close(out, vanilla, rtol=0, atol=0)
    assert any(r <= cpu_linears.MAX_ROWS for r in seen) and any(r > cpu_linears.MAX_ROWS for r in seen)
    assert all("forward" not in vars(m) for m in model.modules() if isinstance(m, nn.Linear))
