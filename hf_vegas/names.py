"""The string entry points: `custom_generate="vegas"` and the Hub folder's `generate.py` (see `hf_vegas.hub`).

transformers resolves a string `custom_generate` to a `generate(model, **all_generate_arguments)` function that
replaces `generate` entirely. `generate_from_name` is that function: it hands on what a callable would lose (the
tokenizer, for stop strings and token healing), then runs `model.generate` with the Vegas loop.
transformers has no registry for bare names: `import hf_vegas` makes "vegas" one with a patch that lives, with the
other private transformers names hf_vegas uses, in `hf_vegas._compat` (`patches.enable_short_name`).
"""

from __future__ import annotations

import copy

from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

from .config import check_keys
from .decoding import checks_only, generate

SHORT_NAME = "vegas"


def generate_from_name(model, **generate_arguments):
    """Full-replacement `generate` for `custom_generate="vegas"` and the Hub folder. Same arguments as `generate`."""
    # Every argument goes on as the user gave it: an explicit `None` (`eos_token_id=None`, `top_k=None`) overrides the
    # model's generation config in vanilla `generate`, so dropping it would change the output. The named parameters
    # of `generate` arrive as None when unset, which is their default anyway.
    args = dict(generate_arguments)
    # The inner call would reach transformers' check of unused model inputs, which names a misspelt key as one.
    check_keys(k for k in args if k.startswith("vegas_"))
    if args.get("assistant_model") is not None:
        raise ValueError("hf_vegas drafts with the model itself: `assistant_model` cannot be combined with it.")
    if args.get("cache_implementation") == "paged":  # vanilla would hand the call to its continuous batching
        raise ValueError("`cache_implementation='paged'` (continuous batching) is not supported by hf_vegas.")
    # A custom_generate callable never receives `tokenizer`, so what needs it happens here: token healing (before the
    # loop, as vanilla heals before it decodes) and the stop-string criterion.
    tokenizer = args.pop("tokenizer", None)
    if _setting(model, args, "token_healing"):
        if tokenizer is None:
            raise ValueError("`token_healing=True` needs the model's tokenizer: pass `tokenizer=` to `generate`.")
        key = "input_ids" if args.get("input_ids") is not None else "inputs"
        if args.get(key) is None:
            raise ValueError("`token_healing=True` heals token ids: pass `input_ids`, not `inputs_embeds`.")
        args = _turned_off(model, args, "token_healing", False)
        # Healing runs a vanilla generate: every check of this call comes first, so bad input fails before it.
        with checks_only():
            unstreamed = {k: v for k, v in args.items() if k != "streamer"}
            model.generate(custom_generate=generate, **_without_stop_strings(model, unstreamed))
        args[key] = model.heal_tokens(args[key], tokenizer)
    stop_strings = _setting(model, args, "stop_strings")
    if stop_strings:
        if tokenizer is None:
            raise ValueError("`stop_strings` needs the model's tokenizer: pass `tokenizer=` to `generate`.")
        criteria = StoppingCriteriaList(args.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        args["stopping_criteria"] = criteria
        args = _turned_off(model, args, "stop_strings", None)
    return model.generate(custom_generate=generate, **args)


def _without_stop_strings(model, args: dict) -> dict:
    """`args` with stop strings off: the checks need no tokenizer."""
    return _turned_off(model, args, "stop_strings", None) if _setting(model, args, "stop_strings") else args


def _turned_off(model, args: dict, field: str, off) -> dict:
    """`args` with the generation field `field` set to `off` for the inner `generate` call.

    A keyword overrides every config, but beside a passed `generation_config` transformers warns that mixing the two
    is deprecated; so where the user passed a config (and not the field as a keyword), a copy of it carries `off`
    instead. The one case only a keyword can do: `off` is None and the model's config sets the field, as transformers
    fills a passed config's None from the model's.
    """
    config = args.get("generation_config")
    if config is None or field in args or (off is None and getattr(model.generation_config, field, None) is not None):
        return dict(args, **{field: off})
    config = copy.deepcopy(config)  # the user's config is left as it was
    setattr(config, field, off)
    return dict(args, generation_config=config)


def _setting(model, args: dict, field: str):
    """A generation field as `generate` will see it: the keyword argument, else the passed config's value, else (where
    that is None, as transformers fills it) the model's."""
    if field in args:
        return args[field]
    value = getattr(args.get("generation_config"), field, None)
    return value if value is not None else getattr(model.generation_config, field, None)
