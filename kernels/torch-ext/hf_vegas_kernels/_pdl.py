"""Programmatic dependent launch (`_launch.pdl`) inside a kernel: the wait, the release of the next kernel, and the
L2 prefetches a kernel issues before it waits.

A kernel of a step's chain (projections, attention, norm) is launched while the one before it still runs. It reads
nothing that kernel wrote before `wait_for_inputs`, which returns once that kernel has finished and its writes are
visible. `release_dependents` lets the next kernel launch; a kernel calls it only after it has waited, so completion is
transitive (a kernel may read what one several launches back wrote).

Where to release (`_launch.PDL["early_trigger"]`): right after the wait, the next kernel's programs become resident
while this one computes, on whatever room the SMs have left (all of this kernel's programs have started by then, so
none of them waits for that room). Their prefetches then overlap this kernel's work. Late, after the main loop, only
its epilogue is overlapped.

What a kernel may prefetch before its wait: whatever no kernel of the chain writes (the projections' weights). A
prefetch is a hint: it returns nothing and changes no memory, and L2 is where every SM's writes meet, so even a line
that another kernel later writes would be read fresh after the wait. Prefetch addresses are kept inside the buffer
they belong to.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Bytes of one L2 request; a prefetch asks for the line holding its address.
LINE_BYTES = 128


def lines(elements: int, element_bytes: int) -> int:
    """The constexpr `LINES` of `prefetch_rows` for rows of `elements` elements: the power of two that covers them."""
    return triton.next_power_of_2(max(1, triton.cdiv(elements * element_bytes, LINE_BYTES)))


@triton.jit
def wait_for_inputs(USE_GDC: tl.constexpr, EARLY_TRIGGER: tl.constexpr):
    """Wait for the kernel before this one; with `EARLY_TRIGGER`, release the next kernel right away."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        if EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def release_dependents(USE_GDC: tl.constexpr, EARLY_TRIGGER: tl.constexpr):
    """After the main loop: release the next kernel, unless `wait_for_inputs` already did."""
    if USE_GDC:
        if not EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the line of each address in `ptrs` where `mask` holds (NVIDIA only: inline PTX)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def prefetch_rows(Base, rows, row_ok, stride, length, LINES: tl.constexpr, share, shares):
    """Prefetch the first `length` elements of each row `rows` (where `row_ok`) of a matrix at `Base` with row
    stride `stride`: one request per 128-byte line, `LINES` (`lines(length, element bytes)`) lines per row.

    `shares` programs that read the same rows (a projection's row blocks) split them: this one, `share`, asks for
    every `shares`-th row only, so no line is requested twice."""
    per_line: tl.constexpr = 1024 // Base.dtype.element_ty.primitive_bitwidth  # elements per LINE_BYTES
    offsets = tl.arange(0, LINES) * per_line
    mine = row_ok & (rows % shares == share)
    prefetch_l2(Base + rows[:, None] * stride + offsets[None, :], mine[:, None] & (offsets < length)[None, :])
