"""`VegasConfig`: every knob of Vegas self-speculative decoding, validated in one place.

A config arrives either whole (`vegas_config=VegasConfig(...)`) or as flat `vegas_<field>=` keyword
arguments to `generate`; `resolve_config` merges the two (flat keys win) and rejects unknown keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

from . import selection

SCORES = ("logits", "weights")
POLICIES = tuple(selection.POLICIES)  # one class per policy in `hf_vegas.selection`
BACKENDS = ("torch", "triton", "auto")
SELECTION_HEADS = ("local", "all")
TP_ALL_REDUCES = ("nccl", "symmetric_memory")
# The draft lengths `gamma="auto"` moves between (each a step shape with graphs of its own), and 0: the dense path.
AUTO_GAMMAS = (2, 4, 6, 8)
# A sliding window drafts sparsely when it is longer than SHORT_WINDOW slots and its budget is under 1 / ratio of it.
# Hybrid models' short windows (Gemma-3's 512 and 1024, gpt-oss' 128) hold the local context beside full layers that
# hold the long one, and cost a draft little: they always draft with their whole window.
SHORT_WINDOW = 1024
SPARSE_WINDOW_RATIO = 4


@dataclass(frozen=True)
class VegasConfig:
    r"""
    Configuration of Vegas self-speculative decoding.

    Args:
        gamma (`int` or `"auto"`, *optional*, defaults to 6):
            Number of tokens drafted per iteration. Each iteration verifies `gamma` draft tokens plus the bonus
            position in one full-attention forward. `0` turns drafting off: plain one-token-per-step decoding over the
            same cache, kernels and CUDA graphs (the dense baseline of the benchmarks); the selection fields must
            then keep their defaults, as nothing reads them. `"auto"` chooses it during the generation among
            `AUTO_GAMMAS` and 0, from the acceptance so far and the measured step times (`hf_vegas.auto_gamma`);
            any choice is lossless.
        sparsity (`float`, *optional*, defaults to 0.07):
            Fraction of the prefix that draft attention reads, in `(0, 1]`, per (sequence, sparse layer). A
            sliding-window layer's prefix is what its window holds of it: `len` below is then `min(len, window - 1)`.
        min_tokens (`int`, *optional*, defaults to 256):
            Lower bound of the per-sequence budget: `budget = clamp(ceil(sparsity * len), min_tokens, len)`. With
            the sparsity, it also decides which sliding-window layers draft sparsely (`drafts_window_sparsely`).
        budget_boost (`float`, *optional*, defaults to 2.0):
            Up to this multiple of the budget for a sequence whose drafts are being rejected: each sequence's budget
            is scaled by `1 + (budget_boost - 1) * r`, where `r` is a running average (half-life one iteration) of
            whether its last verifications rejected a draft. A batch decodes until its slowest sequence is done,
            and the slow ones are those whose drafts a small budget misleads; `1.0` gives every sequence the same
            budget. Any value is lossless (drafts never decide the output). 2.0 measured best on SmolLM2 at batch
            64 x 7.5K on an H100 (README, "Budget boost").
        score (`str`, *optional*, defaults to `"weights"`):
            How verification rates prefix tokens: `"logits"` averages the raw attention logits of the first draft row
            and the bonus row over all query heads (paper Eq. 3); `"weights"` averages their softmax weights
            instead (the reference implementation's default, and the better of the two on SmolLM2, see README).
        policy (`str`, *optional*, defaults to `"vegas"`):
            `"vegas"` selects from verification scores (Collect-2-Query); `"streaming"` is the StreamingLLM baseline
            (attention sinks + most recent tokens); `"last_token"` is the SpecExtend-style baseline that selects
            from the scores of the verification row of the last accepted token only; `"oracle"` lets each draft
            step read the candidates its own query weighs most (it scores the whole prefix at every draft step: an
            upper bound for acceptance studies, never faster).
        selection_heads (`str`, *optional*, defaults to `"local"`):
            Under tensor parallelism (`from_pretrained(..., tp_plan="auto")`), whose query heads rate the slots:
            `"local"` each rank its own heads, for its own KV heads, with no communication; `"all"` every head, the
            paper's Collect-2-Query average, all-reduced across the ranks once per verification (every rank then
            drafts from the same slots). On one device the two are the same. Either is lossless: the selection only
            decides how many drafts are accepted, and every rank accepts the same.
        tp_all_reduce (`str`, *optional*, defaults to `"nccl"`):
            Under tensor parallelism on 2 GPUs, how the row-parallel projections' partial outputs are summed:
            `"nccl"` as transformers does (`torch.distributed.all_reduce`); `"symmetric_memory"` through a one-shot
            all-reduce over a buffer both GPUs map, for the decode, draft and verification steps (sums larger than
            that, as a prefill's, stay NCCL's). The sums are the same bit for bit; a `(16, 4096)` bf16 one took 7.6
            us against NCCL's 18.5 in a CUDA graph (2 x H200, `benchmarks/all_reduce.py`), and Vegas at the Qwen3-8B
            shape 16 x 32K ran 4.5 % faster with it. Not the default: a rank that fails inside a forward leaves
            the other GPU waiting at the kernel's barrier, which has no timeout (README "Multi-GPU").
        backend (`str`, *optional*, defaults to `"auto"`):
            `"torch"` runs the plain-PyTorch ops (`hf_vegas_kernels.naive`), `"triton"` the Triton kernels, `"auto"`
            picks Triton on CUDA when it is available and the plain-PyTorch ops otherwise.
        cuda_graphs (`bool`, *optional*, defaults to `True`):
            Capture the draft, verify and decode forwards as CUDA graphs and replay them (see `hf_vegas.graphs`).
            Only on CUDA; elsewhere, with the `"last_token"` policy, or when a capture fails, the steps run eagerly and
            the reason is logged once. The cache and graphs are kept for the next `generate` call of the same shape
            bucket; `hf_vegas.release_graphs()` frees them.
        compile (`bool`, *optional*, defaults to `False`):
            `torch.compile` the draft, verify and decode forwards before capturing them (needs `cuda_graphs`): fuses
            each layer's norms, rotary embedding and activations, which otherwise run as hundreds of tiny kernels per
            forward. Costs a compilation at the first calls of each step shape and batch. Fused kernels may round
            differently from eager ones in half precision (as any kernel change may); in fp32 the tokens match
            vanilla greedy (tested on the GPU).
        fuse_projections (`bool`, *optional*, defaults to `True`):
            With the Triton backend, a decoder layer whose code is transformers' own Llama layer (or Qwen3's attention)
            runs in five launches instead of ~15 (q/k/v + rotary + cache write, the attention, the output projection +
            residual + norm, gate/up + activation, down + residual + norm): in draft steps (of at most 512 rows; a few
            rows for weights over 16 MiB), and from batch 64 on, for weights of at most 16 MiB per launch in bf16 or
            fp32, in the verification and dense steps too, at every gamma. Those steps pick the tokens, so they round
            as these kernels do: the verification and the dense path (`vegas_gamma=0`) alike, and in half precision
            otherwise than the model's own layers (on the CPU nothing is fused). Other layers run their q/k/v and
            gate/up projections as one kernel each in draft steps only (layers with weights over 16 MiB: in draft steps
            of at most 16 rows, their output and down projections through the same kernel; under tensor parallelism
            each rank's partial product, which transformers then sums over the ranks). The weights stay where they are;
            the model is restored when `generate` returns (see `hf_vegas.fused_layers` and
            `hf_vegas.fused_projections`).
    """

    gamma: int | str = 6
    sparsity: float = 0.07
    min_tokens: int = 256
    budget_boost: float = 2.0
    score: str = "weights"
    policy: str = "vegas"
    selection_heads: str = "local"
    tp_all_reduce: str = "nccl"
    backend: str = "auto"
    cuda_graphs: bool = True
    compile: bool = False
    fuse_projections: bool = True

    def __post_init__(self):
        integer = not isinstance(self.gamma, bool) and isinstance(self.gamma, int) and self.gamma >= 0
        if self.gamma != "auto" and not integer:
            raise ValueError(f"`vegas_gamma` must be an integer >= 0 (0: no drafting) or 'auto', got {self.gamma!r}.")
        for name in ("cuda_graphs", "compile", "fuse_projections"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`vegas_{name}` must be True or False, got {getattr(self, name)!r}.")
        if self.compile and not self.cuda_graphs:
            raise ValueError("`vegas_compile=True` compiles the captured steps: it needs `vegas_cuda_graphs=True`.")
        if isinstance(self.sparsity, bool) or not isinstance(self.sparsity, (int, float)):
            raise ValueError(f"`vegas_sparsity` must be a float in (0, 1], got {self.sparsity!r}.")
        if not (0.0 < float(self.sparsity) <= 1.0) or math.isnan(self.sparsity):
            raise ValueError(f"`vegas_sparsity` must be in (0, 1], got {self.sparsity!r}.")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise ValueError(f"`vegas_min_tokens` must be an integer >= 1, got {self.min_tokens!r}.")
        boost = self.budget_boost
        if isinstance(boost, bool) or not isinstance(boost, (int, float)) or not (1.0 <= float(boost) < math.inf):
            raise ValueError(f"`vegas_budget_boost` must be a finite number >= 1.0 (1.0: the same budget for every "
                             f"sequence), got {boost!r}.")
        for name, allowed in (("score", SCORES), ("policy", POLICIES), ("selection_heads", SELECTION_HEADS),
                              ("tp_all_reduce", TP_ALL_REDUCES), ("backend", BACKENDS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"`vegas_{name}` must be one of {list(allowed)}, got {value!r}.")
        if self.policy == "oracle" and self.score != "weights":
            raise ValueError("`vegas_policy='oracle'` ranks by each draft query's own softmax weights: leave "
                             f"`vegas_score` at 'weights' (got {self.score!r}).")
        if self.gamma == 0:
            unused = [f"vegas_{name}" for name in SELECTION_FIELDS if getattr(self, name) != _DEFAULTS[name]]
            if unused:
                raise ValueError(
                    f"`vegas_gamma=0` decodes without drafts, so {unused} would have no effect; leave them unset."
                )

    @property
    def max_gamma(self) -> int:
        """The longest draft this config can run (what the cache and the selection are sized for)."""
        return max(AUTO_GAMMAS) if self.gamma == "auto" else self.gamma

    def budget(self, length: int) -> int:
        """Number of prefix tokens a draft reads out of `length` candidates (before any boost)."""
        return min(max(math.ceil(self.sparsity * length), self.min_tokens), length)

    def drafts_window_sparsely(self, window: int) -> bool:
        """Whether a sliding-window layer of `window` positions drafts sparsely inside its window: when the window
        is longer than `SHORT_WINDOW` (1024) slots and a draft would read under a quarter of it
        (`4 * budget(window) < window`). Shorter windows (Gemma-3's 512 and 1024, gpt-oss' 128) draft with their
        whole window."""
        return window > SHORT_WINDOW and SPARSE_WINDOW_RATIO * self.budget(window) < window

    def boost(self, rejection):
        """The factor a sequence's budget is scaled by at a rejection average `rejection` (a float or a tensor)."""
        return 1 + (float(self.budget_boost) - 1) * rejection

    def max_budget(self, length: int) -> int:
        """The most prefix tokens a boosted sequence's draft reads out of `length` candidates."""
        return math.ceil(min(self.budget(length) * float(self.budget_boost), length))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __repr__(self) -> str:
        changed = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        ]
        return f"VegasConfig({', '.join(changed)})"


FIELDS = tuple(f.name for f in dataclasses.fields(VegasConfig))
# read only when drafting
SELECTION_FIELDS = ("sparsity", "min_tokens", "budget_boost", "score", "policy", "selection_heads")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(VegasConfig)}
FLAT_KEYS = tuple(f"vegas_{name}" for name in FIELDS)
KEYS = ("vegas_config", *FLAT_KEYS)  # every `vegas_*` argument `generate` takes through hf_vegas


def check_keys(keys) -> None:
    """Raise a `ValueError` naming each of `keys` that is not a Vegas argument, with the closest one. The entry points
    check the `vegas_*` keys of a call this way before transformers sees them: it would report a misspelt one only as
    a model input the model does not use."""
    unknown = sorted(k for k in keys if k not in KEYS)
    if unknown:
        raise ValueError(f"Unknown Vegas argument(s) {_with_suggestions(unknown, KEYS)}. Allowed: {list(KEYS)}.")


def _with_suggestions(names: list[str], allowed) -> str:
    """`'vegas_gama' (did you mean 'vegas_gamma'?), 'vegas_x'`: each name with its closest allowed one, if any."""
    described = []
    for name in names:
        close = difflib.get_close_matches(name, allowed, n=1)
        described.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return ", ".join(described)


def resolve_config(vegas_config: VegasConfig | dict | None = None, **flat: Any) -> VegasConfig:
    """Merge a `VegasConfig` (or a dict of its fields) with flat `vegas_<field>` overrides.

    Flat keys set to `None` are treated as not given. Unknown `vegas_*` keys raise a `ValueError` naming them and
    listing the allowed keys.
    """
    check_keys(flat)
    if vegas_config is None:
        base = VegasConfig()
    elif isinstance(vegas_config, VegasConfig):
        base = vegas_config
    elif isinstance(vegas_config, dict):
        bad = sorted(set(vegas_config) - set(FIELDS))
        if bad:
            raise ValueError(
                f"Unknown `vegas_config` field(s) {_with_suggestions(bad, FIELDS)}. Allowed: {list(FIELDS)}."
            )
        base = VegasConfig(**vegas_config)
    else:
        raise TypeError(
            f"`vegas_config` must be a `hf_vegas.VegasConfig` or a dict, got {type(vegas_config).__name__}."
        )
    overrides = {k[len("vegas_"):]: v for k, v in flat.items() if v is not None}
    return dataclasses.replace(base, **overrides) if overrides else base
