"""Every causal-LM architecture of the installed transformers gives vanilla's greedy tokens through hf_vegas or is
refused before any forward (`tests/architectures.py`). An architecture this generic shrinking cannot make tiny is
skipped with the reason; the hand-made tiny models of `tests/tiny_models.py` cover the important ones in depth."""

import pytest

from architectures import causal_lm_architectures, check


@pytest.mark.parametrize("model_type", causal_lm_architectures())
def test_architecture_is_identical_or_refused_before_any_forward(model_type):
    verdict, detail = check(model_type)
    if verdict == "not built":
        pytest.skip(f"no tiny {model_type} model: {detail}")
    assert verdict in ("identical", "refused"), f"{model_type}: {verdict}: {detail}"
