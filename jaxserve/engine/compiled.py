"""What a compiled step program holds, read from its optimized HLO text (e.g. one compiled for a GPU on a machine
without one, tools/checks/gpu_compile.py).

A `conditional` makes the host wait for the device (XLA copies its predicate back) and keeps the program out of
command buffers (CUDA graphs). A weight copy is an instruction outside any fusion whose result has a weight's
shape: its own buffer, written and read again, as a layer scan's dynamic slice of the stacked weights is on a
GPU, or a quantized weight dequantized before its GEMM. A slice fused into a GEMM reads the weights in place and
is not counted. A scatter reading a weight is a projection fused into the KV write: at one row XLA may turn a
small matmul into multiply + reduce and fuse the reduce into the scatter, which then runs it one thread per
output, far slower than the GEMM.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Any, Sequence

FLOATS = ("f32", "bf16", "f16", "f8e4m3fn", "f8e5m2")  # HLO's float element types


def read_step(hlo: str, weights: Sequence[tuple[int, ...]]) -> dict[str, Any]:
    """Conditionals, while loops, the instructions outside fusions (each its own buffer in memory) whose result
    has one of the `weights`' shapes, unit dimensions aside, or a float result with as many elements as one (a
    weight dequantized in blocks, [blocks, 32, n]), and the fused scatters with an operand of a weight's shape."""
    fused = set(re.findall(r"calls=%([\w.\-]+)", hlo))  # fusion bodies and kernels: their values stay in registers
    squeeze = lambda dims: tuple(d for d in dims if d != 1)  # noqa: E731
    shapes = {squeeze(s) for s in weights}
    sizes = {math.prod(s) for s in weights}
    ops: collections.Counter[str] = collections.Counter()
    copies, scatters = [], []
    blocks = {
        m.group(1): block
        for block in re.split(r"\n(?=%|ENTRY)", hlo)
        if (m := re.match(r"(?:ENTRY )?%([\w.\-]+)", block))
    }
    for name, block in blocks.items():
        if name in fused:
            if " scatter(" in block and any(
                squeeze(int(d) for d in dims.split(",") if d) in shapes
                for dims in re.findall(r"\w+\[([\d,]*)\]\S* parameter\(", block)
            ):
                scatters.append(name)
            continue
        for line in block.splitlines()[1:]:
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\w+\[[\d,]*\]\S*) ([\w\-]+)\(", line)
            if m is None:
                continue
            ops[m.group(3)] += 1
            array = re.fullmatch(r"(\w+)\[([\d,]*)\]\S*", m.group(2))
            dims = squeeze(int(d) for d in array.group(2).split(",") if d) if array else ()
            written = dims in shapes or (array and array.group(1) in FLOATS and math.prod(dims) in sizes)
            if written and m.group(3) not in ("parameter", "bitcast", "get-tuple-element"):
                copies.append(f"{m.group(1)}: {m.group(3)} {m.group(2)}")
    return {
        "conditionals": ops["conditional"],
        "whiles": ops["while"],
        "weight_copies": copies,
        "scatters_reading_weights": scatters,
        "instructions": sum(ops.values()),
    }
