"""hf_vegas: lossless Vegas self-speculative decoding for HuggingFace Transformers.

`import hf_vegas` registers the "vegas" attention implementation, and patches transformers' `GenerationMixin` twice
(`hf_vegas._compat.patches`): for the `custom_generate="vegas"` short name, and so that transformers' error for a
`vegas_*` key it refuses names hf_vegas's keys. Both patches change nothing for calls that use neither; set
HF_VEGAS_PATCH_TRANSFORMERS=0 to import without them, and `disable_short_name()` / `disable_key_check()` remove them.
"""

from ._compat import patches as _patches
from ._compat.patches import disable_key_check, disable_short_name, enable_key_check, enable_short_name
from .attention import register as register_attention
from .cache import VegasCache
from .candidate import VegasCandidateGenerator
from .config import VegasConfig
from .decoding import generate
from .graphs import release_graphs
from .names import generate_from_name
from .output import VegasGenerateOutput
from .tune import TuneReport, tune

__version__ = "0.1.0"

register_attention()
_patches.install_at_import()

__all__ = [
    "TuneReport",
    "VegasCache",
    "VegasCandidateGenerator",
    "VegasConfig",
    "VegasGenerateOutput",
    "disable_key_check",
    "disable_short_name",
    "enable_key_check",
    "enable_short_name",
    "generate",
    "generate_from_name",
    "register_attention",
    "release_graphs",
    "tune",
]
