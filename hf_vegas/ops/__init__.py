"""Where hf_vegas runs its ops: `backend` picks the Triton kernels (`hf_vegas_kernels`) or the plain-PyTorch ones;
`eager` is the CPU path, `prefill` the per-row causal attention of a padded prompt. The ops' contract and its
plain-PyTorch definition live beside the kernels, in `hf_vegas_kernels.naive`."""
