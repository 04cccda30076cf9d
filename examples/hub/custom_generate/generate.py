"""Hub entry point for hf_vegas: `model.generate(..., custom_generate="<org>/vegas", trust_remote_code=True)`.

transformers imports this file and calls `generate(model, **generate_arguments)`; the work is done by the
installed `hf_vegas` package (see requirements.txt).
"""

from hf_vegas import generate_from_name


def generate(model, **kwargs):
    return generate_from_name(model, **kwargs)
