"""Everything hf_vegas relies on in transformers that transformers does not promise to keep.

- `internals`: each private attribute or method hf_vegas reads or overrides while it generates, behind one small
  function (what the drafter, the loop and the checks call).
- `patches`: the two process-wide patches of `GenerationMixin` that `import hf_vegas` installs for the documented
  usage (the `custom_generate="vegas"` short name, and the message for a misspelt `vegas_*` key), and their removal.

Both were checked on transformers 5.17.0 and 5.23.0, the range pyproject.toml and README declare;
`tests/test_compat.py` fails naming the attribute when a release changes one. Imports point one way: `internals`
imports transformers only, and only `hf_vegas/__init__.py` imports `patches` (so the Hub folder, which copies what
the decoding loop imports, never carries it).
"""
