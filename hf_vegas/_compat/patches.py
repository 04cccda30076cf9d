"""The two patches of transformers' `GenerationMixin` that `import hf_vegas` installs, and their removal.

transformers has no registry of `custom_generate` names, and checks a callable's unused keywords before calling it,
so two parts of hf_vegas's documented usage need a process-wide patch:
- the short name: `load_custom_generate` answers `"vegas"` with `generate_from_name`, for `generate` only;
- the key check: when `_validate_model_kwargs` refuses a `vegas_*` key, the error names hf_vegas's keys.

Each wraps the method it finds and hands every other call to it unchanged; installing twice does not wrap twice,
and its `disable_*` function puts back what it wrapped. With HF_VEGAS_PATCH_TRANSFORMERS=0 in the environment,
`import hf_vegas` installs neither (the `enable_*` functions still do). Checked on transformers 5.17.0 and 5.23.0.
"""

from __future__ import annotations

import os
import sys

from transformers.generation.utils import GenerationMixin

from ..config import check_keys
from ..names import SHORT_NAME, generate_from_name
from .internals import changed

ENVIRONMENT_SWITCH = "HF_VEGAS_PATCH_TRANSFORMERS"
_MARK = "_hf_vegas_patch"  # set on our wrappers, so a second install and a removal can recognise them
_WRAPPED: dict[str, object] = {}  # GenerationMixin attribute -> the function our wrapper replaced


def _install(name: str, wrap) -> None:
    current = GenerationMixin.__dict__.get(name)
    if getattr(current, _MARK, False):
        return  # already installed
    if not callable(current):
        raise changed(f"GenerationMixin.{name}", "the method is gone")
    wrapper = wrap(current)
    setattr(wrapper, _MARK, True)
    _WRAPPED[name] = current
    setattr(GenerationMixin, name, wrapper)


def _remove(name: str) -> bool:
    """Put back what our wrapper of `name` replaced. False (and nothing changed) when our wrapper is not the method
    installed: never installed, already removed, or wrapped in turn by someone else since, whose patch stays."""
    if not getattr(GenerationMixin.__dict__.get(name), _MARK, False):
        return False
    setattr(GenerationMixin, name, _WRAPPED.pop(name))
    return True


# -- the short name --------------------------------------------------------------------------------------------------

def _short_name(original):
    # transformers (5.17.0, 5.23.0) calls `load_custom_generate(name, trust_remote_code=..., **kwargs)` from
    # `generate` for a string `custom_generate`, and from `from_pretrained` (`adjust_generation_fn`) with the model's
    # own repository. Only the first is the short name: a model loaded from a folder named "vegas" keeps its generate.
    def load_custom_generate(self, *args, **kwargs):
        name = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if name == SHORT_NAME and sys._getframe(1).f_code.co_name == "generate":
            return generate_from_name
        return original(self, *args, **kwargs)

    load_custom_generate.__doc__ = original.__doc__
    return load_custom_generate


def enable_short_name() -> None:
    """Make `model.generate(..., custom_generate="vegas")` run hf_vegas (done by `import hf_vegas`; idempotent).

    Every other `custom_generate` string, and every other caller of `GenerationMixin.load_custom_generate`, keeps
    transformers' behaviour. Installed code needs no `trust_remote_code`.
    """
    _install("load_custom_generate", _short_name)


def disable_short_name() -> bool:
    """Put back transformers' `GenerationMixin.load_custom_generate`; `"vegas"` is then a Hub repository name again.
    Returns whether anything changed."""
    return _remove("load_custom_generate")


# -- the key check ---------------------------------------------------------------------------------------------------

def _key_check(original):
    # transformers (5.17.0, 5.23.0) runs `self._validate_model_kwargs(model_kwargs)` before it calls a custom_generate
    # callable, and raises ValueError for keys no forward reads. A `vegas_*` key among them was not consumed by
    # hf_vegas (the callable's signature takes the known keys): misspelt, or given without hf_vegas.
    def _validate_model_kwargs(self, model_kwargs, *args, **kwargs):
        try:
            return original(self, model_kwargs, *args, **kwargs)
        except ValueError as error:
            vegas = sorted(k for k, v in model_kwargs.items() if k.startswith("vegas_") and v is not None)
            if not vegas:
                raise
            try:
                check_keys(vegas)  # a misspelt key, named with the closest known one
            except ValueError as unknown:
                raise unknown from error
            raise ValueError(
                f"The hf_vegas argument(s) {vegas} take effect only with `custom_generate=\"vegas\"` (after `import "
                "hf_vegas`) or `custom_generate=hf_vegas.generate`; this `generate` call uses neither."
            ) from error

    _validate_model_kwargs.__doc__ = original.__doc__
    return _validate_model_kwargs


def enable_key_check() -> None:
    """Make a `vegas_*` key that transformers refuses an error naming hf_vegas's keys (done by `import hf_vegas`;
    idempotent). It changes only the message of an error transformers raises anyway, and only for `vegas_*` keys."""
    _install("_validate_model_kwargs", _key_check)


def disable_key_check() -> bool:
    """Put back transformers' `GenerationMixin._validate_model_kwargs`. Returns whether anything changed."""
    return _remove("_validate_model_kwargs")


def install_at_import() -> None:
    """What `import hf_vegas` patches: both, unless the environment sets HF_VEGAS_PATCH_TRANSFORMERS=0."""
    if os.environ.get(ENVIRONMENT_SWITCH, "1").strip() != "0":
        enable_short_name()
        enable_key_check()
