"""The throughput benchmark's draft-step bound (`benchmarks/throughput_records.py`, `draft_step`): what one sparse
draft step of an iteration reads (weights + selected KV + tail) over the bandwidth, beside the measured draft time per
step."""

import pathlib
import sys

from hf_vegas import VegasConfig
from hf_vegas import traffic
from tiny_models import tiny_model

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
from throughput_records import draft_step  # noqa: E402
from workloads import Workload  # noqa: E402


def test_draft_step_bound_is_the_iteration_minus_its_verification_per_draft():
    model = tiny_model("llama")
    workload = Workload("smollm2", batch=4, prompt_tokens=3000)
    config = VegasConfig(gamma=3, sparsity=0.07, min_tokens=64)
    bandwidth = 1e9  # bytes per second: 1 byte per ns
    out = draft_step(model, workload, new_tokens=64, config=config, split_ms={"draft": 6.0}, bandwidth=bandwidth)
    context = 3000 + 32
    kv_per_token = (traffic.dense_step_bytes(model, 4, context) - traffic.weight_bytes(model)) / (4 * context)
    # a draft reads the weights and, per row and layer, the budget plus a tail of up to 2 * gamma slots
    layers = model.config.num_hidden_layers
    per_layer = int(config.budget(context)) + 2 * config.gamma
    expected_bytes = traffic.weight_bytes(model) + 4 * per_layer * kv_per_token
    assert abs(out["draft_step_bound_ms"] - expected_bytes / bandwidth * 1e3) < 1e-9 * expected_bytes
    assert out["draft_step_ms"] == 2.0
    assert out["draft_step_x_bound"] == out["draft_step_ms"] / out["draft_step_bound_ms"]
    assert per_layer * layers < context * layers  # the draft reads less than a dense step: a bound below dense's
    assert out["draft_step_bound_ms"] < traffic.dense_step_bytes(model, 4, context) / bandwidth * 1e3
