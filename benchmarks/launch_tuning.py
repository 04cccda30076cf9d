"""`--tuning KIND:KEY=VALUE` for the benchmarks: override the kernels' launch settings (`hf_vegas_kernels._launch`)
for one run, recorded with its results. Nothing but the benchmarks should change them."""

from __future__ import annotations


def apply_tuning(overrides: list[str]) -> dict:
    """Set `KIND:KEY=VALUE` overrides into `_launch.TUNING` (KIND an attention kind), `_launch.SELECT_TUNING`
    (KIND `select`) or `_launch.PDL` (`pdl:enabled=0`); values are ints, or floats. Returns them as a dict, for the
    records."""
    from hf_vegas_kernels import _launch

    tables = {**_launch.TUNING, "select": _launch.SELECT_TUNING, "pdl": _launch.PDL}
    applied = {}
    for item in overrides:
        kind, _, setting = item.partition(":")
        key, _, value = setting.partition("=")
        if kind not in tables or not key or not value:
            raise SystemExit(f"--tuning {item!r}: expected KIND:KEY=VALUE with KIND one of {sorted(tables)}")
        try:
            number = float(value)
        except ValueError:
            raise SystemExit(f"--tuning {item!r}: VALUE must be a number (1/0 for switches)") from None
        tables[kind][key] = int(number) if number.is_integer() else number
        applied[f"{kind}:{key}"] = tables[kind][key]
    return applied
