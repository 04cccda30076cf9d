"""The search of `hf_vegas.tune`: the three steps over the grid, each configuration one `generate` call."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from .. import traffic
from ..config import SELECTION_FIELDS, VegasConfig, resolve_config
from .report import TuneReport

TIMINGS = ("auto", "measured", "traffic")
# Arguments tune() sets on every generate call itself (the other VegasConfig fields go in `base_config`).
TUNED_KEYS = ("vegas_gamma", "vegas_sparsity", "vegas_config", "custom_generate", "max_new_tokens", "input_ids",
              "return_dict_in_generate")


def tune(
    model,
    prompts,
    tokenizer=None,
    *,
    gammas: Sequence[int] = (2, 4, 6, 8, 10),
    sparsities: Sequence[float] = (0.03, 0.05, 0.07, 0.1, 0.15),
    base_config: VegasConfig | None = None,
    max_new_tokens: int = 64,
    timing: str = "auto",
    plateau: float = 0.03,
    seed: int = 0,
    progress: bool = True,
    **generate_kwargs,
) -> TuneReport:
    r"""
    Choose `gamma` and `sparsity` for `model` on `prompts`; returns a [`TuneReport`] whose `config` to pass back as
    `vegas_config=`.

    Args:
        model: a causal LM, on the device it will generate on.
        prompts: a list of strings (with `tokenizer`), a `(batch, length)` LongTensor of token ids (right-aligned:
            left padding with `attention_mask` in `generate_kwargs`), or a list of 1-D LongTensors. All of them form
            one batch, as `generate` would run them.
        tokenizer: turns string prompts into a left-padded batch.
        gammas, sparsities: the grid (integers >= 1; ratios in (0, 1]).
        base_config: the other `VegasConfig` fields (policy, score, min_tokens, budget_boost, compile, ...). With
            `compile=True` and measured timing, the grid runs with CUDA graphs but uncompiled (each configuration
            would compile its own steps: minutes), and the chosen configuration and the dense path are then
            measured compiled (`TuneReport.compiled`); the returned config keeps `compile=True`.
        max_new_tokens: tokens generated per configuration (at least 8).
        timing: `"measured"`, `"traffic"` or `"auto"` (measured on CUDA, traffic elsewhere); see the module doc.
        plateau: step 1 keeps the smallest ratio whose tokens per iteration are within this fraction of the best.
        seed: `torch.manual_seed` before every configuration (sampling draws comparable tokens).
        progress: a tqdm bar over the configurations.
        generate_kwargs: passed to every `generate` call (`do_sample`, `temperature`, `top_p`, ...).
    """
    gammas, sparsities = _checked_grid(gammas, sparsities)
    base = base_config if base_config is not None else VegasConfig()
    if not isinstance(base, VegasConfig):
        raise ValueError(f"`base_config` must be a VegasConfig, got {type(base).__name__}.")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 8:
        raise ValueError(f"`max_new_tokens` must be an integer >= 8 (tokens per configuration), "
                         f"got {max_new_tokens!r}.")
    if timing not in TIMINGS:
        raise ValueError(f"`timing` must be one of {list(TIMINGS)}, got {timing!r}.")
    if not (isinstance(plateau, (int, float)) and 0 <= plateau < 1):
        raise ValueError(f"`plateau` must be a fraction in [0, 1), got {plateau!r}.")
    tuned = sorted(set(generate_kwargs) & set(TUNED_KEYS))
    if tuned:
        raise ValueError(f"tune() sets {tuned} itself; pass the other VegasConfig fields as `base_config`.")
    # Other `vegas_<field>` keys join the base config, so the report's config is the one every run used.
    flat = {key: generate_kwargs.pop(key) for key in [k for k in generate_kwargs if k.startswith("vegas_")]}
    base = resolve_config(base, **flat) if flat else base
    device = next(model.parameters()).device
    if timing == "auto":
        timing = "measured" if device.type == "cuda" else "traffic"
    ids, mask = _batch(prompts, tokenizer, model, device, generate_kwargs.pop("attention_mask", None))

    # Compiled steps are measured for the choice only: ranking uncompiled keeps one compile per kind of step.
    confirm = base.compile and timing == "measured"
    searched = dataclasses.replace(base, compile=False) if confirm else base
    runs = len(sparsities) * 2 + len(gammas) + (2 if timing == "measured" else 0) + (2 if confirm else 0)
    bar = _progress(runs, progress)
    run = _Runner(model, ids, mask, max_new_tokens, timing, seed, generate_kwargs, bar)
    grid: list[dict] = []
    compiled = None
    try:
        dense = run.dense(searched) if timing == "measured" else None
        top_gamma = max(gammas)
        step1 = [run.vegas(dataclasses.replace(searched, gamma=top_gamma, sparsity=s), dense,
                           "1: sparsity at max gamma") for s in sparsities]
        grid += step1
        best_tpi = max(r["tokens_per_iteration"] for r in step1)
        stable = min(r["sparsity"] for r in step1 if r["tokens_per_iteration"] >= (1 - plateau) * best_tpi)
        step2 = [run.vegas(dataclasses.replace(searched, gamma=g, sparsity=stable), dense, "2: gamma")
                 for g in gammas]
        grid += step2
        gamma = max(step2, key=lambda r: r["speedup"])["gamma"]
        step3 = [run.vegas(dataclasses.replace(searched, gamma=gamma, sparsity=s), dense,
                           "3: sparsity at chosen gamma") for s in sparsities]
        grid += step3
        best = max(step3, key=lambda r: r["speedup"])
        if confirm and best["speedup"] > 1:  # (a dense choice needs no confirmation)
            compiled_dense = run.dense(base)
            picked = dataclasses.replace(base, gamma=best["gamma"], sparsity=best["sparsity"])
            compiled = dict(dense_tokens_per_s=compiled_dense["tokens_per_s"],
                            dense_eager_reason=compiled_dense["eager_reason"],
                            **{k: v for k, v in run.vegas_once(picked, compiled_dense).items()
                               if k in ("gamma", "sparsity", "tokens_per_s", "tokens_per_iteration", "speedup",
                                        "eager_reason")})
        elif confirm:
            bar.total -= 2
    finally:
        bar.close()
    if best["speedup"] > 1 and (compiled is None or compiled["speedup"] > 1):
        config, note = dataclasses.replace(base, gamma=best["gamma"], sparsity=best["sparsity"]), None
    elif best["speedup"] > 1:
        config = dense_config(base)
        note = (f"the best configuration ({best['speedup']:.2f}x uncompiled) measured {compiled['speedup']:.2f}x the "
                "dense path compiled: the config is the dense path (gamma=0)")
    else:
        config = dense_config(base)
        note = (f"no configuration beat the dense path (best {best['speedup']:.2f}x, {timing}): the config is the "
                "dense path (gamma=0)")
    return TuneReport(config=config, grid=grid, chosen=best, dense=dense, timing=timing, plateau_sparsity=stable,
                      batch=int(ids.shape[0]), prompt_tokens=int(mask.sum(dim=1).max()), max_new_tokens=max_new_tokens,
                      device=str(device), note=note, compiled=compiled)


def dense_config(base: VegasConfig) -> VegasConfig:
    """`base` without drafting: gamma 0, the selection fields (which gamma 0 must leave alone) at their defaults."""
    defaults = {name: getattr(VegasConfig, name) for name in SELECTION_FIELDS}
    return dataclasses.replace(base, gamma=0, **defaults)


def _checked_grid(gammas, sparsities) -> tuple[list[int], list[float]]:
    gammas, sparsities = list(gammas), list(sparsities)
    if not gammas or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in gammas):
        raise ValueError(f"`gammas` must be a non-empty list of integers >= 1, got {gammas!r}.")
    if not sparsities or any(isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 1
                             for s in sparsities):
        raise ValueError(f"`sparsities` must be a non-empty list of ratios in (0, 1], got {sparsities!r}.")
    return sorted(set(gammas)), sorted(set(float(s) for s in sparsities))


def _batch(prompts, tokenizer, model, device, mask):
    """`(input_ids, attention_mask)` for the prompts, left-padded, on `device`. An `attention_mask` belongs to tensor
    prompts and a tokenizer to string prompts: with the other kind they would be ignored, so they are refused."""
    if isinstance(prompts, str):
        prompts = [prompts]
    tensor = isinstance(prompts, torch.Tensor)
    if mask is not None and not tensor:
        raise ValueError("`attention_mask` goes with a (batch, length) tensor of prompts; string and token-list "
                         "prompts are padded by tune() itself.")
    if tokenizer is not None and not (not tensor and prompts and all(isinstance(p, str) for p in prompts)):
        raise ValueError("`tokenizer` is only used to encode string prompts; these are token ids: leave it out.")
    if tensor:
        if prompts.dim() != 2 or prompts.is_floating_point():
            raise ValueError(f"`prompts` as a tensor must be (batch, length) token ids, got shape "
                             f"{tuple(prompts.shape)}.")
        ids = prompts
        mask = mask if mask is not None else torch.ones_like(ids)
    elif prompts and all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("String `prompts` need a `tokenizer` (or pass token ids).")
        if tokenizer.pad_token is None:
            raise ValueError("The tokenizer has no pad token to batch these prompts: set `tokenizer.pad_token`.")
        encoded = tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
        ids, mask = encoded.input_ids, encoded.attention_mask
    elif prompts and all(isinstance(p, torch.Tensor) and p.dim() == 1 for p in prompts):
        pad = model.generation_config.pad_token_id
        pad = 0 if pad is None else int(pad if isinstance(pad, int) else pad[0])
        width = max(p.numel() for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - p.numel():], mask[row, width - p.numel():] = p, 1
    else:
        raise ValueError("`prompts` must be a list of strings (with a tokenizer), a (batch, length) tensor of token "
                         "ids, or a list of 1-D token-id tensors.")
    return ids.to(device), mask.to(device)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm  # a transformers dependency

    return tqdm(total=total, desc="hf_vegas.tune", unit="config", disable=not enabled)


class _Runner:
    """One `generate` per configuration, timed or modelled; the dense path as the baseline."""

    def __init__(self, model, ids, mask, max_new_tokens, timing, seed, generate_kwargs, bar):
        self.model, self.ids, self.mask = model, ids, mask
        self.new, self.timing, self.seed, self.kwargs, self.bar = max_new_tokens, timing, seed, generate_kwargs, bar
        self.context = int(mask.sum(dim=1).max()) + max_new_tokens // 2  # the longest row, halfway through the decode
        # per kind (drafting or not: a drafting prefill also selects; compiled or not)
        self.prefill_s: dict[tuple[bool, bool], float] = {}
        # Steps revisit configurations (step 2's largest gamma at the plateau ratio is step 1's; step 3's plateau
        # ratio is step 2's best): each runs once, its record reused under the later step's name.
        self.done: dict[tuple[int, float], dict] = {}

    def _generate(self, config: VegasConfig, max_new_tokens: int):
        torch.manual_seed(self.seed)
        self._sync()
        start = time.perf_counter()
        out = self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=max_new_tokens,
                                  custom_generate="vegas", vegas_config=config, return_dict_in_generate=True,
                                  **self.kwargs)
        self._sync()
        return out, time.perf_counter() - start

    def _sync(self):
        if self.ids.device.type == "cuda":
            torch.cuda.synchronize(self.ids.device)

    def _warm_up(self, config: VegasConfig) -> None:
        """Runs until no new step is compiled or captured (each step kind is eager, then compiled, then captured,
        one call at a time: a short generation may need more than one call)."""
        from .. import graphs

        for _ in range(4):
            steps = graphs.pooled_graphs(self.model)
            before = steps.captures if steps is not None else None
            self._generate(config, self.new)
            steps = graphs.pooled_graphs(self.model)
            if steps is None or steps.captures == before or steps.disabled_reason is not None:
                return

    def _eager_reason(self) -> str | None:
        """Why the last generation ran its steps eagerly (a failed capture, graphs off), or None: a compiled
        measurement that fell back to eager steps would otherwise pass for a compiled one. Read right after the timed
        call: a later call of another capacity bucket replaces the pooled graphs."""
        from .. import graphs

        steps = graphs.pooled_graphs(self.model)
        return "not pooled (no CUDA graphs)" if steps is None else steps.disabled_reason

    def _decode_seconds(self, config: VegasConfig, seconds: float) -> float:
        kind = (config.gamma > 0, config.compile)
        if kind not in self.prefill_s:  # prefill-only calls, warm, once per kind for every configuration
            self._generate(config, 1)
            self.prefill_s[kind] = min(self._generate(config, 1)[1] for _ in range(2))
        return max(seconds - self.prefill_s[kind], 1e-9)

    def _made(self, out) -> int:
        """New tokens the rows generated after the prefill's first (rows that stop at EOS count what they made)."""
        accepted = out.accepted
        per_row = ((accepted + 1) * (accepted >= 0)).sum(dim=1).clamp_max(self.new - 1)
        return int(per_row.sum())

    def dense(self, base: VegasConfig) -> dict:
        config = dense_config(base)
        self._warm_up(config)
        out, seconds = self._generate(config, self.new)
        ran_eagerly = self._eager_reason()  # before the prefill-only calls, whose cache may take another pool bucket
        decode = self._decode_seconds(config, seconds)
        self.bar.update(1 if base.compile else 2)
        return dict(tokens_per_s=self._made(out) / decode, decode_seconds=decode, eager_reason=ran_eagerly)

    def vegas(self, config: VegasConfig, dense: dict | None, step: str) -> dict:
        key = (config.gamma, config.sparsity)
        if key not in self.done:
            self.done[key] = self._vegas(config, dense)
        self.bar.update(1)
        return {"step": step, **self.done[key]}

    def vegas_once(self, config: VegasConfig, dense: dict) -> dict:
        """`config` measured anew (the chosen configuration, compiled), not from the grid's records."""
        record = self._vegas(config, dense)
        self.bar.update(1)
        return record

    def _vegas(self, config: VegasConfig, dense: dict | None) -> dict:
        if self.timing == "measured":
            self._warm_up(config)  # this configuration's kernels, compilations and graphs
        out, seconds = self._generate(config, self.new)
        ran_eagerly = self._eager_reason() if self.timing == "measured" else None  # (as in `dense`)
        iterations = int(out.accepted.shape[1])
        if iterations == 0:
            raise ValueError("Every prompt ended at its first new token (EOS): there is nothing to tune on. Pass "
                             "prompts that continue, or `eos_token_id=None` to generate a fixed length.")
        # The batch iterates until its slowest row is done: its rate is tokens over iterations, not the rows' mean.
        made = self._made(out)
        batch_rate = made / self.ids.shape[0] / iterations
        rejected = out.accepted[out.accepted >= 0] < config.gamma
        rejection = float(rejected.float().mean()) if rejected.numel() else 0.0
        record = dict(gamma=config.gamma, sparsity=config.sparsity,
                      tokens_per_iteration=out.tokens_per_iteration, batch_tokens_per_iteration=batch_rate,
                      iterations=iterations, rejection=rejection)
        record["predicted_speedup"] = traffic.predicted_speedup(self.model, self.ids.shape[0], self.context, config,
                                                                batch_rate, rejection)
        if self.timing == "measured":
            decode = self._decode_seconds(config, seconds)
            record.update(tokens_per_s=made / decode, decode_seconds=decode, eager_reason=ran_eagerly)
            record["speedup"] = record["tokens_per_s"] / dense["tokens_per_s"]
        else:
            record["speedup"] = record["predicted_speedup"]
        return record
