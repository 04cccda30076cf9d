"""Launch parameters that depend on the device, not on the op."""

from __future__ import annotations

import functools

import torch

# Launch parameters of the attention kernels, per kind of call, chosen on an H100 with
# `benchmarks/kernel_bandwidth.py --sweep` (results in benchmarks/results/kernels_sweep.jsonl). `waves`: programs
# per SM the splits aim for. Verification (several query tokens) with head_dim 128 and at least 32 (row, KV head)
# pairs wanted many more splits (Qwen3-8B, batch 4 x 32K: 212 us at 8 waves, 258 us at 2, i.e. 9 splits rounded
# up, whose 288 programs fill a second wave of two per SM only in part: see the "_wide_head" rule below), but not at
# batch 1 (1 x 128K: 196 us at 2 waves, 217 us at 8), and head_dim 64 fewer (SmolLM2, batch 64 x 8K: 161 us at 2 waves,
# 189 us at 8). Sparse drafts (`--draft-only`, SmolLM2 at 7.5K, a 525-slot selection) want about 1.5-2 programs
# per SM, rounded to the nearest split count ("nearest"): batch 64 takes one split, whose program writes the output
# itself (15.6 us against 20.5 us with 64-slot blocks and 4 waves), batch 16 five (8.6 against 9.0), batch 4 five
# (6.5 against 6.3). A kernel with every KV head of a row in one program (contiguous slot reads, a block-diagonal
# query tile) was slower at every batch (19.7 / 9.7 / 6.8 us at 64 / 16 / 4 rows, commit ece2ebb) and was dropped.
# An H200 agrees (9587590, `--sweep --draft-only --boost 1.13` and `--sweep --verify-only` at SmolLM2 64 x 7.5K): the
# best drafts took 15.1-16.6 us, all in one split of 128-slot blocks as here, and the verification kept its setting
# (114.6 us; 131.9 with the softmax-weight scores). That draft is within 1.4 us of a bare gather of the same keys and
# values (`benchmarks/gather_floor.py`, ec40556: 13.9 against 12.5 us): no launch setting is left to find there.
# The benchmark overrides these to sweep; nothing else should.
#
# `fused_combine`: the last split of each (row, KV head) merges the splits' states in the kernel instead of a combine
# launch (`kernel_bandwidth.py --tuning`, SmolLM2 batch 64 x 7.5K, H100, commit 82ade28): dense 145.0 -> 139.9 us,
# verify 149.8 -> 144.2, verify with softmax-weight scores 170.6 -> 163.6. Sparse drafts of one unboosted list gained
# nothing from it (the sweep's best at batch 64 is 17.9 us either way, at batch 16 9.3 without, 9.7 with, five
# splits). With the budget boost, batch 64 splits each list in two (`draft_split_len`) and launches the combine after
# every draft layer; merging those two in the kernel (`fused_combine_max_splits` 2: a kind's own limit) took a SmolLM2
# 64 x 7.5K greedy iteration's six draft steps from 8.18 to 8.02 ms and the whole iteration from 16.18 to 15.76 ms
# (`throughput.py --tuning sparse:fused_combine=1`, real model, compiled, H100, same call, commit 9eb3d03).
#
# The verification with the softmax-weight scores a generation emits keeps the "verify" setting: it was the best of 36
# (`--sweep --verify-only`, SmolLM2 64 x 7.5K, H100, commit 4979630: 155.4 us against 157.9 for the next; 141.8 us
# without scores).
#
# `sparse_wide_head`: sparse drafts with head_dim 128 (Qwen3-8B shape at 32K, a 2.3K-slot selection; `--sweep
# --draft-only --shapes qwen3-8b`, H100, commit a95ad78, kernels_sweep.jsonl) want two pipeline stages, whose tiles
# leave room for more programs per SM: 20.0 us at batch 4 and 64.3 at batch 16, against 24.1 and 68.9 with the head_dim
# 64 setting (the best single settings were 19.1 and 61.2 us). Merging their splits in the kernel (`fused_combine`)
# instead of the combine launch was slower at 16 x 32K on an H200 (f4a80ab, the command under SELECT_TUNING, in a
# second process beside the defaults' on the same machine): draft steps of 8.60 and 8.76 ms against 8.17.
#
# The "_wide_head" dense and verify kinds (head_dim >= 128 over at least 32 (row, KV head) pairs) take the fewest
# splits whose programs fill their last wave of two programs per SM at least 90 % (`fill`; `waves` is then the programs
# an SM holds at once), and the wide-head drafts round theirs to the nearest count: these kernels' programs take about
# as long each, so their time goes by whole waves. Forcing each split count (`benchmarks/attention_splits.py`, whose
# first version ran out of the tree; records in benchmarks/results/attention_splits.jsonl; H200 at 8aca627, H100 at
# 9c23e1d, the same kernels), verification with softmax-weight scores on the H200 at 16 x 32K (128 pairs) took 575 us
# at 2 splits (256 programs, 97 % of one wave of 264), 590-601 at 4, 6 or 8 (97 %), but 642 at 9 (87 %: 9c23e1d's
# setting, 8 waves rounded up), 745 at 3 (73 %), 681 at 5 (81 %) and 781 at 1 (48 %); at 4 x 32K (32 pairs) 161 us at 8
# splits (97 %) against 174 at 33 (9c23e1d's) and 210 at 4 (48 %) (the slower of two rounds). On the H100 the same
# counts gave 853 -> 827 us at 16 x 32K and 221 -> 220 at 4 x 32K (one program per SM, the best there at 811 and 213,
# left bandwidth unused on the H200), and dense decode 201 -> 184 us at 4 x 32K (9 -> 8 splits, through the combine
# launch: merging in the kernel took 191) and 709 at 16 x 32K (2 splits; 706 at 3). On the H200 dense decode stayed
# within its round-to-round noise (about 4 %) at every count. Only 32 and 128 pairs were measured: other batches get
# the rule, not a measured count. A 2.3K-slot draft at 16 rows took 46.0 us at 2 splits against 50.0 at 3 on the H200
# (4.6K slots: 81.2 against 85.0). Merging a verification's splits in the kernel (`fused_combine`, at most
# FUSED_COMBINE_MAX_SPLITS of them) was slower at every count up to 8 on the H200.
#
# `balance` (sparse drafts): each row's list is divided over the launch's splits by its own length, not by the host's
# hint. With a budget boost the hint is the most boosted list (`SelectionState.draft_list_len`), so a row near the
# plain budget filled the first split and left the others empty. At the Qwen3-8B shape 16 x 32K the 256 programs
# fit one wave and a 2,294-slot list took 60.5 us in one split and 46.0 in two (H200, 8aca627,
# `attention_splits.py`): on for the wide-head kind, not yet measured in a generation (stop 42 had no device time
# left; `throughput.py --tuning-sets "sparse_wide_head:balance=0" ""` is the A/B). Off for head_dim 64 (SmolLM2 at
# 64 rows: 384 programs on 132 SMs), where the one measured point goes the other way: uniform 525-slot lists took
# 15.6-15.9 us in one split and 17.0 in two (H100, 81ec4de, kernels_sweep.jsonl); `kernel_bandwidth.py --shapes
# smollm2-135m --batches 64 --boost 2 --tuning sparse:balance=1` is its A/B.
TUNING = {
    "sparse": {"block_n": 128, "num_warps": 4, "num_stages": 3, "waves": 2, "nearest": True, "fused_combine": True,
               "fused_combine_max_splits": 2, "balance": False},
    "sparse_wide_head": {"block_n": 128, "num_warps": 4, "num_stages": 2, "waves": 2, "nearest": True,
                         "balance": True},
    "dense": {"block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 2, "fused_combine": True},
    "dense_wide_head": {"block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 2, "fill": 0.9},
    "verify": {"block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 2, "fused_combine": True},
    "verify_wide_head": {"block_n": 64, "num_warps": 4, "num_stages": 3, "waves": 2, "fill": 0.9},
}
# The in-kernel merge reads the splits one after the other: past this many (or a kind's `fused_combine_max_splits`),
# the combine launch (parallel over query rows, vectorised over splits) is used instead.
FUSED_COMBINE_MAX_SPLITS = 8

# Launch parameters of the projection kernels (`linear.py`) per op, at every row count (tuned at 64 rows: a draft or
# dense step of 64 sequences). One order of every sum whatever the rows (only the `tall_*` keys below differ): a
# fused verification of 64 x 7 rows then rounds as the dense step of its 64 rows
# (`hf_vegas.fused_layers`; at de8f2e2, with a "generic" setting of 64-column blocks above 64 rows, only 20 of 64
# greedy rows matched). The row block is clamped to the rows (16 for a draft of 4). `block_n` is the widest column
# block tried: a segment that it does not divide gets the next smaller one. Chosen on an H100 with
# `benchmarks/projections.py --sweep` (records in benchmarks/results/projections_sweep.jsonl): narrow column blocks
# give SmolLM2's small weights enough programs (q/k/v 3.5 us and gate/up 5.5 us at 64 rows, from 5.4 and 9.3 with
# 64-column blocks). The benchmark overrides them to sweep. Splitting K over more programs (the last of a tile's
# programs summing the fp32 partials) was slower at every split tried (commit 18d867f, whose `projections.py --sweep
# --grid` took `split_k_len=0,192,384,768`; H100, 64 rows: down 3.84 us unsplit against 4.2-5.9 split, output 2.52
# against 3.5-4.8, gate/up 3.39 against 5.4-8.5): the merge's serial tail costs more than the narrower slices save. It
# was dropped.
#
# `tall_*` (0: as above): what a tall launch, of more than LINEAR_TALL_ROWS rows (a verification's 64 x 7), takes
# instead, for more programs per SM. Only settings that keep every sum in its order may differ: the pipeline's stages
# (the K block never: a tall tile that does not fit takes fewer stages or stays short), and a column block that the GPU
# test (`test_tall_launches_round_exactly_as_one_row_block_does`) shows to give the same bits, of kinds whose outputs
# are independent per column (never "linear", whose column blocks are the next RMSNorm's partial sums of squares). That
# test is the judge, not the reasoning: 64-column gate/up blocks rounded two of 448 x 1536 row-scaled products
# otherwise on an H200 (plain products and 32-column blocks matched), although the row scale's reduction has the same
# layout and the epilogue the same per-element PTX at 16, 32 and 64 columns (compiled for sm_90 with Triton 3.6, the
# H200's, and 3.9; `triton.compile(..., target=GPUTarget("cuda", 90, 32))`). A gate/up launch at 448 rows has 672
# programs of 64 x 16 with four stages (160 KiB: one per SM); with 32-column blocks and two stages (96 KiB) it took 8.2
# against 13.6 us alone (`projections.py --sweep --shapes smollm2-135m --rows 448`, H200, 287af3c; 64-column blocks
# 9.0), and the verification 5.94 -> 5.71 ms per SmolLM2 64 x 7.5K iteration, 64 of 64 greedy rows still equal to the
# dense path's (`throughput.py ... --tuning-sets "" "gated:tall_block_n=32 gated:tall_num_stages=2"`, 0f4529589, one
# call; 64 of 64 also in the two other generations run with it). Two stages for q/k/v + rotary (8.0 against 9.4 us
# alone at 448 rows) changed nothing in that run (5.70 ms).
LINEAR_TUNING = {
    "qkv": {"block_m": 64, "block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 4, "tall_num_stages": 0,
            "tall_block_n": 0},
    "gated": {"block_m": 64, "block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 4, "tall_num_stages": 2,
              "tall_block_n": 32},
    "linear": {"block_m": 64, "block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 4, "tall_num_stages": 0},
    # Weights of more than LINEAR_LARGE_WEIGHT_BYTES (a launch's, gate and up together) are read for their bytes, not
    # their launch: wider column blocks and longer K steps stream them faster. Qwen3-8B's at 16 rows (H200, commit
    # b89507d, `projections.py --sweep --shapes qwen3-8b --rows 16 --grid block_m=16 block_n=16,32 block_k=128,256
    # num_warps=4,8 num_stages=4,6`, projections_sweep.jsonl): q/k/v 17.9 -> 16.2 us, gate/up 63.6 -> 52.9, the
    # output projection 14.0 -> 11.4 and the down projection 37.8 -> 28.2 (cuBLAS: 28.1, 61.7, 14.1, 31.2). At 4 rows
    # and at one rank's shards under TP = 2 (2f97021, a grid with block_n 64 and 3 stages too) they were within 4 % of
    # the best; in one TP = 2 process at 16 x 32K the draft step took 5.25 ms against 5.52 with the settings above.
    # (The rank's output projection, exactly 16 MiB, took the "linear" setting: 7.8 us against 6.4 for the best;
    # under TP that projection is row-parallel and runs cuBLAS, 7.4 us.)
    "qkv_large": {"block_m": 64, "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 4,
                  "tall_num_stages": 0, "tall_block_n": 0},
    "gated_large": {"block_m": 64, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 4,
                    "tall_num_stages": 0, "tall_block_n": 0},
    "linear_large": {"block_m": 64, "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 6,
                     "tall_num_stages": 0},
    # q/k/v + rotary + cache write (`qkv_rope.py`): a program per (head, row block), so narrower row blocks make
    # the programs (SmolLM2 at 64 rows: 15 heads x 4 row blocks).
    "qkv_rope": {"block_m": 16, "block_k": 128, "num_warps": 4, "num_stages": 4, "tall_num_stages": 0},
}
# The `tall_*` keys a projection setting may carry, without their prefix, and the rows above which they apply: a
# draft or dense step of up to 64 sequences keeps the settings tuned for it (at 64 rows q/k/v + rotary's 16-row
# blocks are already four, and its two stages slowed the dense step).
LINEAR_TALL_KEYS = ("num_stages", "block_n")
LINEAR_TALL_ROWS = 64
# Shared memory a projection kernel's pipelined tiles may take (an H100 block has 227 KiB): fp32 inputs, or the two
# tiles of the gated kernel, take fewer stages instead of failing to launch.
LINEAR_SHARED_BYTES = 160 << 10
# Above this many weight bytes a launch takes its kind's "_large" setting (the same line as
# hf_vegas.fused_projections.MAX_WEIGHT_BYTES, above which a draft's output and down projections take the kernel: in
# those it runs the "linear_large" setting).
LINEAR_LARGE_WEIGHT_BYTES = 16 << 20

# Warps per program of the in-register top-k selection (`select.py`, one program per (layer, row)); 0: 4 for rows of
# at most 8K slots, 16 up to 16K, 32 beyond. At SmolLM2 batch 64 x 7.5K on an H100 (`kernel_bandwidth.py --tuning`,
# 82ade28) the 30 layers' top-k took 256 us with 4 warps, 371 with 8 and 373 with 2. The benchmark overrides it to
# sweep. `row_in_registers`: the longest row (in slots, before rounding up to a power of two) held in registers;
# longer rows take the chunked passes below (until 58550eb the threshold passes of one program per row, which at the
# Qwen3-8B shape 16 x 32K cost 1.14 ms per verification on an H200, 1d6f650; the 16K line was drawn against those,
# not re-measured against the chunked passes). One register-held row was slower there: `throughput.py --workloads
# qwen3-8b-shape:16x32768 --methods vegas --compile --prefill-chunk 8192 --tuning-sets
# "select:row_in_registers=65536 sparse_wide_head:fused_combine=1" "sparse_wide_head:fused_combine=1"` (H200,
# f4a80ab, one process) gave a verification of 30.94 ms against 30.33 with the tiled passes.
# `chunk`: rows longer than `row_in_registers` run the search over chunks of at least this many slots (more where a
# row would have more than 64 chunks), one program per (row, chunk) and one launch per pass (`select_chunked.py`),
# `chunk_warps` warps each; 0 keeps one program per row for all its passes (`_select_topk`). `bits`: the key bits one
# pass resolves (4: 8 passes of 16 buckets; 8: 4 of 256). On an H200 (0e81daf's kernels, a one-off timing script
# carried to the device and not kept: 36 layers of softmax-like scores, 7 % budget, the launches captured in a
# graph) 36 x 16 rows of 33K slots took 810 us in one program per row, 500 at 2K-slot chunks, 8 bits and 4 warps,
# 550 at 4K chunks, 645 at 4K chunks and 4 bits, 789 at 8K chunks and 8 warps; 36 x 1 rows of 131K slots 1,206 us,
# 156, 143, 169 and 184 (at most 64 chunks a row takes 4K there, since 1c00617's timing). `benchmarks/top_k_chunks.py`
# repeats such a sweep (written after it; not yet run on a GPU).
# `finalize_tile` and `finalize_warps`: the score finalisation's (`scores.py`) values per program (emitted heads x
# slots, a power of two) and warps. At the Qwen3-8B shape 16 x 32K (32 emitted heads, 256 slots a program) it took
# 1.0 ms per verification on an H200 (`kernel_bandwidth.py`, `finalize_us`, 1c00617), about twice a read of the
# emitted logits; not swept yet.
SELECT_TUNING = {"num_warps": 0, "row_in_registers": 16384, "chunk": 2048, "bits": 8, "chunk_warps": 4,
                 "finalize_tile": 8192, "finalize_warps": 4}

# Programmatic dependent launch (Hopper and later): a kernel of a step's chain (projections, attention, norm) is
# launched while the one before it still runs, waits for it (`griddepcontrol.wait`) before loading anything, and lets
# the next one launch (`_pdl.py`), so the launch latency between the five small kernels of a draft layer overlaps the
# previous kernel. Every such kernel waits, unconditionally, before its first load, and releases the next only after
# it has waited: completion is transitive, so a kernel may read what one several launches back wrote. The benchmarks
# switch it off (`--tuning pdl:enabled=0`) to measure it.
# `early_trigger`: the projections, the q/k/v + rotary kernel and the attention release the next kernel right after
# their wait instead of after their main loop (the norm, the combine, the sampling kernels, the verification's score
# finalisation and the top-k selection always release right after it, or after their loop, as before), and
# `prefetch_weights`: before waiting, the projections ask L2 for their weight rows (`_pdl.py` says why that is safe),
# where a launch's weights take at most `prefetch_l2_fraction` of the L2 cache (more would evict each other before
# use). Measured together (`throughput.py --tuning-sets`, real SmolLM2 at 64 x 7.5K, greedy, compiled, H100, one
# process, two passes, commit f333b92): a draft step took 1.254 / 1.254 ms with neither, 1.277 / 1.279 with the early
# release alone, 1.235 / 1.237 with both (Vegas 25,346 / 25,360 -> 25,555 / 25,551 tokens/s). Prefetching a sparse
# draft's gathered keys and values too took it to 1.313 / 1.314 ms, and was dropped. At the Qwen3-8B shape (4 x 32K,
# H100, b41339e), prefetching every weight (up to 201 MB a launch) took the draft step from 7.67 to 8.92 ms.
PDL = {"enabled": 1, "early_trigger": 1, "prefetch_weights": 1, "prefetch_l2_fraction": 0.25}


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _triton_has_pdl() -> bool:
    """`tl.extra.cuda.gdc_wait` and the `launch_pdl` option arrived in Triton 3.4; older releases launch plainly."""
    import triton.language as tl

    return hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents: NVIDIA (not ROCm, whose devices are also
    "cuda"), compute capability 9.0 or later, Triton 3.4 or later."""
    if device.type != "cuda" or not PDL["enabled"] or torch.version.hip is not None or not _triton_has_pdl():
        return False
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def pdl_option(device: torch.device, option: str) -> bool:
    """Whether `PDL[option]` ("early_trigger", "prefetch_weights") applies to kernels on `device`:
    only where they launch as programmatic dependents at all."""
    return bool(PDL[option]) and pdl(device)


def prefetch_weights(device: torch.device, weights) -> bool:
    """Whether a projection launch on `device` prefetches its `weights` (tensors) before its wait."""
    if not pdl_option(device, "prefetch_weights"):
        return False
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return weight_bytes <= PDL["prefetch_l2_fraction"] * _l2_bytes(index)


@functools.cache
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def pdl_launch(device: torch.device) -> dict:
    """The launch option of a kernel whose `USE_GDC` is `pdl(device)` (none at all elsewhere: the CPU interpreter
    takes no such option)."""
    return {"launch_pdl": True} if pdl(device) else {}


# Under TRITON_INTERPRET=1 on the CPU there are no SMs; split as if a small GPU, so split-K paths are exercised.
_CPU_PROGRAMS = 4


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return _CPU_PROGRAMS


_TICKETS: dict[torch.device, torch.Tensor] = {}
# Buffers that a larger one replaced: a CUDA graph captured while one was current still points at it, so none is ever
# freed (they are small, and each replacement at least doubles the size).
_RETIRED: list[torch.Tensor] = []


def tickets(count: int, device: torch.device) -> torch.Tensor:
    """At least `count` zeroed int32 counters for a kernel whose last program to finish a unit of work merges the
    others' results; the kernel leaves them zero again, so one buffer per device serves every launch.

    That holds while the launches that use it run one at a time: on one stream, as `generate` runs its steps and
    replays its graphs, or on streams the caller orders. Two launches running at once on two streams of one device
    would mix their counts (a wrong merge, and a counter left nonzero for the next launch).

    A buffer first needed inside a CUDA graph capture is not kept: it belongs to that graph's memory pool, and only
    the graph's replay zeroes it (captured kernels do not run)."""
    have = _TICKETS.get(device)
    if have is not None and have.numel() >= count:
        return have
    fresh = torch.zeros(max(count, 4096, 2 * (have.numel() if have is not None else 0)), dtype=torch.int32,
                        device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        if have is not None:
            _RETIRED.append(have)
        _TICKETS[device] = fresh
    return fresh


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel writes comes from here, so tests can poison them all (NaN) through one name."""
    return torch.empty(*shape, dtype=dtype, device=device)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (the CPU reference's precision); half types use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"
