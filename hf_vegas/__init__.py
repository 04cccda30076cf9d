"""hf_vegas: lossless Vegas self-speculative decoding for HuggingFace Transformers.

`import hf_vegas` registers the "vegas" attention implementation and the `custom_generate="vegas"` short name, and
makes transformers' error for a `vegas_*` key it refuses name hf_vegas's keys.
"""

from .attention import register as register_attention
from .cache import VegasCache
from .candidate import VegasCandidateGenerator
from .config import VegasConfig
from .decoding import generate
from .graphs import release_graphs
from .names import enable_key_check, enable_short_name, generate_from_name
from .output import VegasGenerateOutput

__version__ = "0.1.0"

register_attention()
enable_short_name()
enable_key_check()

__all__ = [
    "VegasCache",
    "VegasCandidateGenerator",
    "VegasConfig",
    "VegasGenerateOutput",
    "enable_key_check",
    "enable_short_name",
    "generate",
    "generate_from_name",
    "register_attention",
    "release_graphs",
]
