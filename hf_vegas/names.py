"""The string entry points: `custom_generate="vegas"` and the Hub-style `custom_generate/generate.py` shim.

transformers resolves a string `custom_generate` to a `generate(model, **all_generate_arguments)` function that
replaces `generate` entirely. `generate_from_name` is that function: it moves what a callable would lose (the
tokenizer for stop strings) into explicit stopping criteria, then runs `model.generate` with the Vegas loop.
transformers has no registry for bare names, so `enable_short_name` wraps `load_custom_generate` for "vegas" alone.
"""

from __future__ import annotations

import copy

from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerationMixin

from .decoding import generate

SHORT_NAME = "vegas"


def generate_from_name(model, **generate_arguments):
    """Full-replacement `generate` for `custom_generate="vegas"` and the Hub shim. Same arguments as `generate`."""
    # Every argument goes on as the user gave it: an explicit `None` (`eos_token_id=None`, `top_k=None`) overrides the
    # model's generation config in vanilla `generate`, so dropping it would change the output. The named parameters
    # of `generate` arrive as None when unset, which is their default anyway.
    args = dict(generate_arguments)
    if args.get("assistant_model") is not None:
        raise ValueError("hf_vegas drafts with the model itself: `assistant_model` cannot be combined with it.")
    tokenizer = args.pop("tokenizer", None)
    generation_config = args.get("generation_config")
    if "stop_strings" in args:
        stop_strings = args["stop_strings"]
    else:
        stop_strings = (generation_config or model.generation_config).stop_strings
    if stop_strings:
        args.pop("stop_strings", None)
        if tokenizer is None:
            raise ValueError("`stop_strings` needs the model's tokenizer: pass `tokenizer=` to `generate`.")
        # A custom_generate callable never receives `tokenizer`, so the stop-string criterion is built here.
        criteria = StoppingCriteriaList(args.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        args["stopping_criteria"] = criteria
        generation_config = copy.deepcopy(generation_config or model.generation_config)
        generation_config.stop_strings = None
        args["generation_config"] = generation_config
    elif tokenizer is not None:
        args["tokenizer"] = tokenizer
    return model.generate(custom_generate=generate, **args)


_original_load_custom_generate = GenerationMixin.load_custom_generate


def _load_custom_generate(self, pretrained_model_name_or_path=None, trust_remote_code=None, **kwargs):
    if pretrained_model_name_or_path == SHORT_NAME:
        return generate_from_name
    return _original_load_custom_generate(
        self, pretrained_model_name_or_path, trust_remote_code=trust_remote_code, **kwargs
    )


def enable_short_name() -> None:
    """Make `model.generate(..., custom_generate="vegas")` run hf_vegas (idempotent; done by `import hf_vegas`).

    Every other `custom_generate` string keeps transformers' behaviour. Installed code needs no
    `trust_remote_code`.
    """
    GenerationMixin.load_custom_generate = _load_custom_generate
