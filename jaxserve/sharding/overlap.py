"""What runs while each collective-permute is in flight, read from a compiled (scheduled) XLA module's text.

XLA's GPU compiler splits a collective-permute into an asynchronous start and done, and the order of a
computation's instructions in `Compiled.as_text()` is the order they are issued: what sits between a start and
its done runs while the transfer is in flight. tools/checks/gpu_compile.py uses this to check that the ring's K/V
transfers overlap the attention kernels (Pallas calls lowered through Triton).
"""

from __future__ import annotations

import dataclasses
import re

TRITON = '"__gpu$xla.gpu.triton"'  # the custom-call target of a Pallas kernel compiled through Triton

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


@dataclasses.dataclass
class HloTransfer:
    name: str
    computation: str
    bytes: int
    asynchronous: bool
    kernels_in_flight: int  # Pallas (Triton) calls scheduled between start and done, nested ones included

    @property
    def overlapped(self) -> bool:
        return self.asynchronous and self.kernels_in_flight > 0


def array_bytes(shape: str) -> int:
    """Bytes of the first array type in an HLO type string, e.g. 'bf16[2,1024,8,128]{3,2,1,0}'."""
    m = re.search(r"(\w+)\[([\d,]*)\]", shape)
    n = 1
    for dim in filter(None, m.group(2).split(",")):
        n *= int(dim)
    return n * _DTYPE_BYTES[m.group(1)]


def computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """Each computation's instructions in schedule order: (name, type, opcode, rest of the line)."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            current = comps.setdefault(head.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append(m.groups())
    return comps


def transfers(hlo: str) -> list[HloTransfer]:
    """Every collective-permute of a compiled (scheduled) module with what runs while it is in flight."""
    comps = computations(hlo)
    kernels: dict[str, int] = {}

    def kernel_count(comp: str) -> int:  # Triton calls in a computation and those it calls (loops, conditionals)
        if comp not in kernels:
            kernels[comp] = 0
            kernels[comp] = sum(count(rest) for _, _, _, rest in comps.get(comp, []))
        return kernels[comp]

    def count(rest: str) -> int:
        return (TRITON in rest) + sum(kernel_count(c) for c in _CALLED.findall(rest))

    found = []
    for comp, instructions in comps.items():
        for i, (name, shape, op, rest) in enumerate(instructions):
            if op == "collective-permute":  # synchronous: nothing overlaps it
                found.append(HloTransfer(name, comp, array_bytes(shape), False, 0))
            if op != "collective-permute-start":
                continue
            done = next(
                j
                for j in range(i + 1, len(instructions))
                if instructions[j][2] == "collective-permute-done" and f"%{name}" in instructions[j][3]
            )
            found.append(
                HloTransfer(
                    name,
                    comp,
                    array_bytes(shape),
                    '"is_sync":true' not in rest,
                    sum(count(r) for _, _, _, r in instructions[i + 1 : done]),
                )
            )
    return found


def collective_bytes(hlo: str, devices: int) -> dict[str, int]:
    """Bytes a group of `devices` sends in all, by collective kind, over every synchronous collective of a
    compiled module (a CPU's), each counted once (a loop body's once, whatever its trip count): an all-to-all or
    all-gather moves (devices - 1) / devices of its result from each device (a CPU's all-to-all returns a tuple
    of pieces: all of them); a collective-permute its buffer once per source-target pair."""
    sent: dict[str, int] = {}
    for instructions in computations(hlo).values():
        for _, shape, op, rest in instructions:
            if op in ("all-to-all", "all-gather"):
                n = sum(array_bytes(a.group(0)) for a in re.finditer(r"\w+\[[\d,]*\]", shape)) * (devices - 1)
            elif op == "collective-permute":
                pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
                n = array_bytes(shape) * (pairs.group(1).count("},{") + 1 if pairs else 0)
            else:
                continue
            sent[op] = sent.get(op, 0) + n
    return sent
