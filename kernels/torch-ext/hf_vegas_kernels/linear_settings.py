"""The launch setting of a projection kernel (`linear.py`) for a launch's rows, weights and dtype, from
`_launch.LINEAR_TUNING`: the tuned setting of its kind, a row block clamped to the rows, a column block that divides
the weights' segments, pipeline stages (then a K block) that fit in shared memory; and above
`_launch.LINEAR_TALL_ROWS` rows the kind's `tall_*` settings, which keep every sum in its order."""

from __future__ import annotations

import triton

from . import _launch


def block_n_for(*sizes: int, widest: int = 64) -> int | None:
    """The widest column block (at most `widest`) that divides every segment, or None (the projections then stay
    separate)."""
    for block in (128, 64, 32, 16):
        if block <= widest and all(size % block == 0 for size in sizes):
            return block
    return None


def tuning_kind(kind: str, weight_bytes: int) -> str:
    """The `_launch.LINEAR_TUNING` entry a launch of `kind` ("qkv", "gated", "linear") over `weight_bytes` of weights
    (all of the launch's) takes, at any row count."""
    return f"{kind}_large" if weight_bytes > _launch.LINEAR_LARGE_WEIGHT_BYTES else kind


def launch_setting(kind: str, rows: int, sizes: list[int], element_bytes: int, k: int) -> dict:
    """Launch parameters of `kind` ("qkv", "gated", "linear") for `rows` rows, the weights' output segments `sizes`
    (gated: gate's and up's) and inputs of `k` columns, from `_launch.LINEAR_TUNING`."""
    weight_bytes = sum(sizes) * k * element_bytes
    setting = dict(_launch.LINEAR_TUNING[tuning_kind(kind, weight_bytes)])
    tall = {key: setting.pop(f"tall_{key}", 0) for key in _launch.LINEAR_TALL_KEYS}
    # No wider row block than the rows need (a draft of 4 sequences computes a 16-row tile, not 64).
    setting["block_m"] = min(setting["block_m"], max(16, triton.next_power_of_2(rows)))
    setting["block_n"] = block_n_for(*sizes, widest=setting["block_n"])
    _fit_shared_memory(kind, setting, element_bytes, shrink_k=True)
    if kind == "linear" and tall["block_n"]:  # its column blocks are the next RMSNorm's partial sums of squares
        raise ValueError(f"LINEAR_TUNING[{tuning_kind(kind, weight_bytes)!r}] takes no tall_block_n: a linear "
                         "launch's column blocks are the next norm's partial sums, the same at every row count")
    if rows > _launch.LINEAR_TALL_ROWS and any(tall.values()):  # a tall launch (a verification's 64 x 7 rows)
        taller = {**setting, "num_stages": tall["num_stages"] or setting["num_stages"],
                  "block_n": block_n_for(*sizes, widest=tall["block_n"] or setting["block_n"])}
        if taller["block_n"] is None:
            raise ValueError(f"LINEAR_TUNING[{tuning_kind(kind, weight_bytes)!r}]['tall_block_n'] = "
                             f"{tall['block_n']}: a column block is 16 or more")
        # More programs, the same sums: the K block stays the short launches' (a tall tile that does not fit takes
        # fewer stages, never a shorter K step, which would split the products' sums otherwise), and one stage was
        # the slowest at every column block at 448 rows (`projections.py --sweep`): then the launch stays short.
        if _fit_shared_memory(kind, taller, element_bytes, shrink_k=False, min_stages=2):
            setting = taller
    return setting


def _fit_shared_memory(kind: str, setting: dict, element_bytes: int, shrink_k: bool, min_stages: int = 1) -> bool:
    """Take pipeline stages down to `min_stages` (then, with `shrink_k`, halve the K block) from `setting` until its
    tiles fit in `_launch.LINEAR_SHARED_BYTES`; whether they fit."""
    def shared_bytes():  # x and weight tiles per pipeline stage, twice for gate and up
        tile = (setting["block_m"] + setting["block_n"]) * setting["block_k"] * element_bytes
        return setting["num_stages"] * tile * (2 if kind == "gated" else 1)

    while shared_bytes() > _launch.LINEAR_SHARED_BYTES and setting["num_stages"] > min_stages:
        setting["num_stages"] -= 1
    while shrink_k and shared_bytes() > _launch.LINEAR_SHARED_BYTES and setting["block_k"] > 16:
        setting["block_k"] //= 2
    return shared_bytes() <= _launch.LINEAR_SHARED_BYTES
