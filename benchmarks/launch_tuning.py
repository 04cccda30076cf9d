"""`--tuning KIND:KEY=VALUE` for the benchmarks: override the kernels' launch settings (`hf_vegas_kernels._launch`)
for one run, recorded with its results. Nothing but the benchmarks should change them."""

from __future__ import annotations

import copy


# Keys an attention kind may take beside those its default setting has (`attention.attend` reads them with defaults).
ATTENTION_KEYS = {"block_n", "num_warps", "num_stages", "waves", "nearest", "fill", "fused_combine",
                  "fused_combine_max_splits", "balance"}


def apply_tuning(overrides: list[str]) -> dict:
    """Set `KIND:KEY=VALUE` overrides into `_launch.TUNING` (KIND an attention kind), `_launch.LINEAR_TUNING` (a
    projection kind: `gated:block_n=32`), `_launch.SELECT_TUNING` (KIND `select`) or `_launch.PDL`
    (`pdl:enabled=0`, `pdl:prefetch_weights=0`); values are ints, or floats. Returns them as a dict, for the
    records."""
    from hf_vegas_kernels import _launch

    every = _tables()
    tables = {**every["tuning"], **every["linear"], "select": every["select"], "pdl": every["pdl"]}
    applied = {}
    for item in overrides:
        kind, _, setting = item.partition(":")
        key, _, value = setting.partition("=")
        if kind not in tables or not key or not value:
            raise SystemExit(f"--tuning {item!r}: expected KIND:KEY=VALUE with KIND one of {sorted(tables)}")
        keys = set(tables[kind]) | (ATTENTION_KEYS if kind in _launch.TUNING else set())
        if key not in keys:  # a misspelt key would be recorded as applied while it changes nothing
            raise SystemExit(f"--tuning {item!r}: {kind} takes KEY one of {sorted(keys)}")
        try:
            number = float(value)
        except ValueError:
            raise SystemExit(f"--tuning {item!r}: VALUE must be a number (1/0 for switches)") from None
        tables[kind][key] = int(number) if number.is_integer() else number
        applied[f"{kind}:{key}"] = tables[kind][key]
    for kind, setting in _launch.TUNING.items():
        if setting.get("nearest") and setting.get("fill"):  # `fill` decides alone: `nearest` would be recorded, unused
            raise SystemExit(f"--tuning: {kind} rounds its split count by `fill` ({setting['fill']}) or to the "
                             f"nearest, not both: add {kind}:fill=0 or {kind}:nearest=0")
    return applied


def _tables() -> dict:
    from hf_vegas_kernels import _launch

    return {"tuning": _launch.TUNING, "linear": _launch.LINEAR_TUNING, "select": _launch.SELECT_TUNING,
            "pdl": _launch.PDL}


def snapshot() -> dict:
    """The launch settings now, for `restore` (a copy: `apply_tuning` changes the tables in place)."""
    return copy.deepcopy(_tables())


def restore(saved: dict) -> None:
    """Put back the settings of a `snapshot`."""
    for name, table in _tables().items():
        table.clear()
        table.update(copy.deepcopy(saved[name]))


def parse_sets(sets: list[str]) -> list[str]:
    """`--tuning-sets` arguments (each a quoted, space-separated list of KIND:KEY=VALUE; '' for no override), each
    checked by applying it once (a bad one exits before any GPU work); the settings are restored afterwards."""
    saved = snapshot()
    try:
        for item in sets:
            apply_tuning(item.split())
    finally:
        restore(saved)
    return sets
