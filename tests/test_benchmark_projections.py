"""`benchmarks/projections.py --sweep` marks which swept setting is the one the kernels take now: the launcher's own
rule (`linear_settings.launch_setting`, `qkv_rope`'s row block and stages), tall launches included."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import projections  # noqa: E402

_launch = pytest.importorskip("hf_vegas_kernels._launch")


def test_the_current_setting_is_the_launchers_at_short_and_tall_row_counts():
    from hf_vegas_kernels import linear_settings, qkv_rope

    gate_up = [torch.empty(1536, 576, dtype=torch.bfloat16)] * 2
    output = [torch.empty(576, 576, dtype=torch.bfloat16)]
    for rows in (4, 64, 448):
        assert projections._current_setting("gated", rows, gate_up) == linear_settings.launch_setting(
            "gated", rows, [1536, 1536], 2, 576)
        assert projections._current_setting("linear(o)", rows, output) == linear_settings.launch_setting(
            "linear", rows, [576], 2, 576)
    tall, short = (projections._current_setting("gated", rows, gate_up) for rows in (448, 64))
    gated = _launch.LINEAR_TUNING["gated"]
    assert (short["block_n"], short["num_stages"]) == (gated["block_n"], gated["num_stages"])
    assert (tall["block_n"], tall["num_stages"]) == (gated["tall_block_n"], gated["tall_num_stages"])
    rope = projections._current_setting("qkv_rope", 448, output * 3)
    assert rope == dict(block_m=qkv_rope._row_block(448), block_k=_launch.LINEAR_TUNING["qkv_rope"]["block_k"],
                        num_warps=_launch.LINEAR_TUNING["qkv_rope"]["num_warps"], num_stages=qkv_rope._stages(448))
