"""`hf_vegas.tune`: choose gamma and the sparsity ratio for a model on the user's own prompts (paper §3.4).

    report = hf_vegas.tune(model, prompts, tokenizer=tokenizer, max_new_tokens=64)
    out = model.generate(**inputs, custom_generate="vegas", vegas_config=report.config)
    report.save("tune.json"); report.plot("tune.png")

The three steps of the paper: (1) at the largest gamma, sweep the sparsity ratio until the tokens accepted per
iteration stop rising (the smallest ratio within `plateau` of the best); (2) at that ratio, sweep gamma for
throughput; (3) at the chosen gamma, re-adjust the ratio for throughput (a configuration two steps share runs once).
Every configuration generates on the same batch (sampling with the same seed: once with traffic timing; with
measured timing after warm-up calls, and with prefill-only calls timed once per kind), so acceptance is the model's
own on these prompts. Predictions use the
batch's tokens per iteration (the batch runs until its slowest row is done) and the boosted budgets its rows drew.

Throughput comes from one of two sources, which the report names (`timing`): "measured" (the wall time of each
decode, after subtracting the prefill, with CUDA synchronised; the default on CUDA), or "traffic" (the bytes each
step must read, `hf_vegas.traffic`: a GPU decode at long context is memory-bound, so the speedup over the dense
path is the ratio of bytes per token; the default elsewhere, as a CPU's timings say little about a GPU's).
If no configuration beats the dense path (`gamma=0`), the report's config is the dense path and says so.

`python -m hf_vegas.tune --help`: the same from the command line, on the embedded SmolLM2 or a local model folder.
(`hf_vegas.tune` is the function; its modules are `hf_vegas.tune.search`, `.report` and `.cli`, imported with
`from hf_vegas.tune import ...`.) Other `vegas_<field>` keywords join `base_config`.
"""

from .report import TuneReport
from .search import TIMINGS, dense_config, tune

__all__ = ["TIMINGS", "TuneReport", "dense_config", "tune"]
