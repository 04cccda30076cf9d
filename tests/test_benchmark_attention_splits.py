"""`benchmarks/attention_splits.py` forces each split count it times (the number the launch really takes), puts the
launch settings back afterwards, and refuses counts below one before any GPU work."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import attention_splits  # noqa: E402
from hf_vegas_kernels import _launch  # noqa: E402
from hf_vegas_kernels.attention_splits import _num_splits  # noqa: E402


@pytest.mark.parametrize("sms", [132, 4])
@pytest.mark.parametrize("pairs", [32, 128, 200])
def test_each_forced_split_count_is_the_one_the_launch_takes(monkeypatch, sms, pairs):
    """Over a list whose blocks every count divides, the launch takes the forced count; over another it may take
    fewer, which the record's `splits_taken` says."""
    monkeypatch.setattr(_launch, "device_sm_count", lambda device: sms)
    monkeypatch.setitem(_launch.TUNING, "verify_wide_head", dict(_launch.TUNING["verify_wide_head"]))  # restored
    block_n = _launch.TUNING["verify_wide_head"]["block_n"]
    for splits in range(1, 13):
        attention_splits.force_splits("verify_wide_head", splits, pairs, fused_combine=False)
        assert attention_splits.splits_taken("verify_wide_head", block_n * 27720, pairs) == splits
        assert _launch.TUNING["verify_wide_head"]["fused_combine"] is False
    attention_splits.force_splits("verify_wide_head", 32, pairs)
    assert attention_splits.splits_taken("verify_wide_head", 32784, pairs) == 31  # 513 blocks: chunks of 17
    setting = _launch.TUNING["verify_wide_head"]
    assert attention_splits.splits_taken("verify_wide_head", 32784, pairs) == _num_splits(
        32784, pairs, block_n, setting["waves"], torch.device("cuda", 0))[0]


def test_counts_below_one_are_refused_before_any_gpu_work(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attention_splits.py", "--splits", "2", "0"])
    with pytest.raises(SystemExit):
        attention_splits.main()
    assert "--splits and --reps take counts of at least 1" in capsys.readouterr().err
