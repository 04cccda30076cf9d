"""One-launch decode projections against cuBLAS: is `hf_vegas.fused_projections` worth it at this shape?

    python benchmarks/projections.py                  # SmolLM2-135M and Qwen3-8B layer shapes, 64 and 448 rows
    python benchmarks/projections.py --sweep --shapes smollm2-135m --rows 64   # launch settings per op
    python benchmarks/projections.py --shapes qwen3-8b-tp2 --rows 16   # one rank's shards under TP = 2 (only its
                                                                       # q/k/v and gate/up rows apply: under TP the
                                                                       # fused draft layers stay off)

Per (model shape, rows): one layer's q/k/v projections as three `F.linear` calls (cuBLAS) against one
`qkv_linear` launch, the gated MLP's gate/up/activation/product as three launches against one `gated_linear`, a fused
draft layer's q/k/v + rotary + cache write (`qkv_rope_write`, beside `qkv_linear`'s projection alone), and the
output and down projections with their residual as `torch.addmm` against `linear_residual`,
each timed as a replayed CUDA graph over enough weight copies to defeat L2 (median of 20 replays). Records go to
--out (JSONL, with GPU, versions, commit); a table is printed last.

`--sweep` times each kernel (q/k/v, gate/up, and one weight as the output and down projections would) under every
launch setting of a grid (`hf_vegas_kernels._launch.LINEAR_TUNING` overridden), beside cuBLAS, into
benchmarks/results/projections_sweep.jsonl, and prints the best setting per op.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import hf_vegas_kernels as kernels
import torch
import torch.nn.functional as F

from gpu_timing import graph_time
from provenance import gpu_run
from results_io import append_records

# (hidden, q out, kv out, intermediate): the projection shapes of one layer; "qwen3-8b-tp2": one rank's shards of
# Qwen3-8B's under tensor parallelism over 2 GPUs (column-parallel q/k/v, gate/up; row-parallel output, down)
SHAPES = {"smollm2-135m": (576, 576, 192, 1536), "qwen3-8b": (4096, 4096, 1024, 12288),
          "qwen3-8b-tp2": (4096, 2048, 512, 6144)}
L2_FLUSH_BYTES = 256 << 20


def _copies(nbytes: int) -> int:
    return max(1, -(-L2_FLUSH_BYTES // nbytes))


def measure(shape: str, rows: int) -> dict:
    hidden, q_out, kv_out, inter = SHAPES[shape]
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    attn_bytes = (q_out + 2 * kv_out) * hidden * 2
    n = _copies(attn_bytes)
    x = torch.randn(rows, hidden, **bf16)
    qkv = [[torch.randn(o, hidden, **bf16) / 32 for o in (q_out, kv_out, kv_out)] for _ in range(n)]
    mlp_n = _copies(2 * inter * hidden * 2)
    mlp = [[torch.randn(inter, hidden, **bf16) / 32 for _ in range(2)] for _ in range(mlp_n)]

    def separate_qkv(i):
        return [F.linear(x, w) for w in qkv[i % n]]

    def fused_qkv(i):
        return kernels.qkv_linear(x, *qkv[i % n], None, None, None)

    def separate_mlp(i):
        gate, up = mlp[i % mlp_n]
        return F.silu(F.linear(x, gate)) * F.linear(x, up)

    def fused_mlp(i):
        return kernels.gated_linear_op(x, *mlp[i % mlp_n], "silu")

    # A fused draft layer's q/k/v + rotary + cache write in one launch (two before, with
    # `qkv_linear`: 5.9 against 4.9 us at commit c911040).
    head_dim = 128 if shape.startswith("qwen3-8b") else 64
    q_heads, kv_heads = q_out // head_dim, kv_out // head_dim
    k_cache, v_cache = (torch.zeros(rows, 64, kv_heads, head_dim, **bf16) for _ in range(2))
    slots = torch.arange(rows, device="cuda")[:, None] % 64
    angles = torch.rand(rows, 1, head_dim, device="cuda")
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    layout = (q_heads, kv_heads, head_dim)

    def one_launch_rope(i):
        return kernels.qkv_rope_write(x.view(rows, 1, -1), *qkv[i % n], None, None, None, cos, sin, k_cache, v_cache,
                                      slots, *layout)

    # The residual sums: cuBLAS' addmm (a copy of the residual, then the GEMM) against `linear_residual`.
    o_n, down_n = _copies(q_out * hidden * 2), _copies(inter * hidden * 2)
    o_w = [torch.randn(hidden, q_out, **bf16) / 32 for _ in range(o_n)]
    down_w = [torch.randn(hidden, inter, **bf16) / 32 for _ in range(down_n)]
    attn, gated, residual = torch.randn(rows, q_out, **bf16), torch.randn(rows, inter, **bf16), torch.randn_like(x)

    want = torch.cat(separate_qkv(0), dim=-1).float()
    error = (fused_qkv(0).float() - want).norm() / want.norm()
    return dict(shape=shape, rows=rows, qkv_separate_us=graph_time(separate_qkv, n) * 1e6,
                qkv_fused_us=graph_time(fused_qkv, n) * 1e6, mlp_separate_us=graph_time(separate_mlp, mlp_n) * 1e6,
                mlp_fused_us=graph_time(fused_mlp, mlp_n) * 1e6, qkv_relative_error=float(error),
                qkv_rope_one_launch_us=graph_time(one_launch_rope, n) * 1e6,
                o_addmm_us=graph_time(lambda i: torch.addmm(residual, attn, o_w[i % o_n].t()), o_n) * 1e6,
                o_residual_us=graph_time(lambda i: kernels.linear_residual_op(attn, o_w[i % o_n], residual),
                                         o_n) * 1e6,
                down_addmm_us=graph_time(lambda i: torch.addmm(residual, gated, down_w[i % down_n].t()), down_n) * 1e6,
                down_residual_us=graph_time(lambda i: kernels.linear_residual_op(gated, down_w[i % down_n], residual),
                                            down_n) * 1e6)


SWEEP_GRID = dict(block_m=[16, 32, 64], block_n=[16, 32, 64, 128], block_k=[64, 128], num_warps=[2, 4],
                  num_stages=[2, 4])


def sweep(shape: str, rows: int, only: list[str] | None = None, grid: dict | None = None) -> list[dict]:
    """Each one-launch kernel at `rows` rows under every setting of `grid` (default SWEEP_GRID), with cuBLAS for
    reference."""
    grid = grid or SWEEP_GRID
    from itertools import product

    from hf_vegas_kernels import _launch

    hidden, q_out, kv_out, inter = SHAPES[shape]
    bf16 = dict(dtype=torch.bfloat16, device="cuda")

    def weights(*outs, k=hidden):
        n = _copies(sum(outs) * k * 2)
        return n, [[torch.randn(o, k, **bf16) / 32 for o in outs] for _ in range(n)]

    # the output projection's input is the attention's output: q_out wide (under TP = 2 half the hidden size)
    x, x_attn, x_inter = (torch.randn(rows, width, **bf16) for width in (hidden, q_out, inter))
    head_dim = 128 if shape.startswith("qwen3-8b") else 64
    angles = torch.rand(rows, 1, head_dim, device="cuda")
    rope = (angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16),
            *(torch.zeros(rows, 64, kv_out // head_dim, head_dim, **bf16) for _ in range(2)),
            torch.arange(rows, device="cuda")[:, None] % 64, (q_out // head_dim, kv_out // head_dim, head_dim))
    ops = {  # kind: (copies, weight sets, one-launch call, cuBLAS call)
        "qkv": (*weights(q_out, kv_out, kv_out), lambda w: kernels.qkv_linear(x, *w, None, None, None),
                lambda w: [F.linear(x, wi) for wi in w]),
        "gated": (*weights(inter, inter), lambda w: kernels.gated_linear_op(x, *w, "silu"),
                  lambda w: F.silu(F.linear(x, w[0])) * F.linear(x, w[1])),
        "qkv_rope": (*weights(q_out, kv_out, kv_out), lambda w: kernels.qkv_rope_write(
            x.view(rows, 1, -1), *w, None, None, None, rope[0], rope[1], rope[2], rope[3], rope[4], *rope[5]),
            lambda w: [F.linear(x, wi) for wi in w]),
        "linear(o)": (*weights(hidden, k=q_out), lambda w: kernels.grouped_linear(x_attn, w),
                      lambda w: F.linear(x_attn, w[0])),
        "linear(down)": (*weights(hidden, k=inter), lambda w: kernels.grouped_linear(x_inter, w),
                         lambda w: F.linear(x_inter, w[0])),
    }
    default = {kind: dict(values) for kind, values in _launch.LINEAR_TUNING.items()}
    records = []
    try:
        for op, (n, sets, fused, cublas) in ops.items():
            kind = op.split("(")[0]
            if only and op not in only:
                continue
            cublas_us = graph_time(lambda i: cublas(sets[i % n]), n) * 1e6
            current = _current_setting(op, rows, sets[0])  # before the sweep overrides the table
            for values in product(*grid.values()):
                setting = dict(zip(grid, values))
                if setting["block_m"] > max(16, rows):
                    continue  # the launcher clamps it to the rows: a duplicate of a smaller block
                if kind == "qkv_rope" and setting["block_n"] != grid["block_n"][0]:
                    continue  # a program owns one head: no column block to choose
                entry = _tuning_kind(op, sets[0])  # what the launcher takes for these weights
                _launch.LINEAR_TUNING[entry] = setting
                records.append(dict(shape=shape, rows=rows, op=op, setting=setting, cublas_us=cublas_us,
                                    tuning_kind=entry, current=all(setting[k] == v for k, v in current.items()),
                                    us=graph_time(lambda i: fused(sets[i % n]), n) * 1e6))
            _launch.LINEAR_TUNING.update(default)
    finally:
        _launch.LINEAR_TUNING.update(default)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 448])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/projections.jsonl"))
    parser.add_argument("--commit", default=None)
    parser.add_argument("--sweep", action="store_true", help="sweep the kernels' launch settings instead")
    parser.add_argument("--ops", nargs="+", choices=["qkv", "gated", "qkv_rope", "linear(o)", "linear(down)"],
                        help="with --sweep: only these kernels (default: all)")
    parser.add_argument("--grid", nargs="+", default=[], metavar="KEY=V1,V2",
                        help=f"with --sweep: the values of a setting to sweep instead of SWEEP_GRID's (keys: "
                             f"{', '.join(SWEEP_GRID)}), e.g. block_m=64 block_n=16,32")
    args = parser.parse_args()
    if args.grid and not args.sweep:
        parser.error("--grid narrows a --sweep; add --sweep")
    grid = _grid(args.grid)  # bad input fails before any GPU work
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/projections.py needs a CUDA GPU.")
    base = gpu_run(args.commit, dtype="bfloat16")
    if args.sweep:
        out = args.out if args.out != Path("benchmarks/results/projections.jsonl") else (
            Path("benchmarks/results/projections_sweep.jsonl"))
        records = [dict(base, **r) for shape in args.shapes for rows in args.rows
                   for r in sweep(shape, rows, args.ops, grid)]
        append_records(out, records)
        for key in sorted({(r["shape"], r["rows"], r["op"]) for r in records}):
            group = sorted((r for r in records if (r["shape"], r["rows"], r["op"]) == key), key=lambda r: r["us"])
            default = next((r for r in group if r["current"]), {"us": float("nan")})
            best, second = group[0], group[1]
            print(f"{key[0]:<14} {key[1]:>4} {key[2]:<13} {best['tuning_kind']:<13} cuBLAS {best['cublas_us']:6.1f} "
                  f"us | current {default['us']:6.1f} | best {best['us']:6.1f} {best['setting']} "
                  f"| 2nd {second['us']:6.1f}")
        return
    records = [dict(base, **measure(shape, rows)) for shape in args.shapes for rows in args.rows]
    append_records(args.out, records)
    print(f"{'shape':<14} {'rows':>5} {'qkv: 3 cuBLAS':>14} {'1 fused':>8} {'mlp: 3 launches':>16} {'1 fused':>8} "
          f"{'qkv+rope+write':>15} {'o: addmm':>9} {'fused':>6} {'down: addmm':>12} {'fused':>6}  us")
    for r in records:
        print(f"{r['shape']:<14} {r['rows']:>5} {r['qkv_separate_us']:>14.1f} {r['qkv_fused_us']:>8.1f} "
              f"{r['mlp_separate_us']:>16.1f} {r['mlp_fused_us']:>8.1f} "
              f"{r['qkv_rope_one_launch_us']:>15.1f} {r['o_addmm_us']:>9.1f} {r['o_residual_us']:>6.1f} "
              f"{r['down_addmm_us']:>12.1f} {r['down_residual_us']:>6.1f}   (qkv rel. error "
              f"{r['qkv_relative_error']:.1e})")


def _grid(overrides: list[str]) -> dict:
    """SWEEP_GRID with `KEY=V1,V2` overrides (integer values)."""
    grid = dict(SWEEP_GRID)
    for item in overrides:
        key, _, values = item.partition("=")
        try:
            parsed = [int(v) for v in values.split(",")]
        except ValueError:
            parsed = []
        if key not in SWEEP_GRID or not parsed:
            raise SystemExit(f"--grid {item!r}: expected KEY=V1,V2 with integers and KEY one of {list(SWEEP_GRID)}")
        powers_of_two = all(v >= 1 and not v & (v - 1) for v in parsed)
        if (min(parsed) < 1) if key == "num_stages" else not powers_of_two:
            raise SystemExit(f"--grid {item!r}: block sizes and num_warps take powers of two, num_stages 1 or more")
        grid[key] = parsed
    return grid


def _tuning_kind(op: str, weights: list[torch.Tensor]) -> str:
    """The `LINEAR_TUNING` entry the launcher takes for `op` with these weights, at any row count ("qkv_rope": its
    own)."""
    from hf_vegas_kernels import linear_settings

    kind = op.split("(")[0]
    if kind == "qkv_rope":
        return kind
    return linear_settings.tuning_kind(kind, sum(w.numel() * w.element_size() for w in weights))


def _current_setting(op: str, rows: int, weights: list[torch.Tensor]) -> dict:
    """The launch setting the kernels take now for `op` at `rows` rows with these weights, as the launcher derives
    it (q/k/v + rotary: a program per head, so no column block)."""
    from hf_vegas_kernels import _launch, linear_settings, qkv_rope

    kind = op.split("(")[0]
    if kind == "qkv_rope":
        tuned = _launch.LINEAR_TUNING[kind]
        return dict(block_m=qkv_rope._row_block(rows), block_k=tuned["block_k"], num_warps=tuned["num_warps"],
                    num_stages=qkv_rope._stages(rows))
    sizes = [w.shape[0] for w in weights]
    return linear_settings.launch_setting(kind, rows, sizes, weights[0].element_size(), weights[0].shape[1])


if __name__ == "__main__":
    main()
