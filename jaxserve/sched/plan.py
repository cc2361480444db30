"""The Plan -> Outcome contract between a scheduler and its executors (engine, simulator), and a cluster policy's
ClusterPlan (sched/cluster.py: the live cluster and the cluster simulators execute it); see docs/ARCHITECTURE.md."""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping, NamedTuple

from jaxserve.sched.flip import Flip


class Phase(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class MoveKind(enum.Enum):
    """What a KVMove is."""

    REBALANCE = "rebalance"  # a prompt's history to its next chunk's group (CDSP)
    MIGRATE = "migrate"  # a decoding request's KV (or a share of it) to another instance (ESP)


class WorkItem(NamedTuple):
    """One request's tokens in a Plan. Built by keyword; a named tuple, not a frozen dataclass, which takes four
    times as long to build (a Plan holds hundreds, one every iteration: BENCHMARKS "Scheduler speed")."""

    request_id: str
    start: int  # first token position this item computes
    end: int  # one past the last
    phase: Phase
    group: tuple[int, ...]  # device ids, ordered: the SP ring order
    chunk_index: int = 0  # which of its prompt's chunks (a cluster's)
    history: int = 0  # tokens already cached before `start` (attention reads them)

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVMove:
    request_id: str
    src: tuple[int, ...]  # devices (or pool slots) it leaves; () for the host
    dst: tuple[int, ...]  # and those it goes to
    tokens: int
    kind: MoveKind


@dataclasses.dataclass(frozen=True)
class Plan:
    """One iteration's work. The scheduler owns the KV blocks: `blocks` are the ids appended to each request's
    block table this iteration (a newly admitted request's start with its prefix-cache hits), `preempted` the
    requests whose blocks were taken back (their tables are dropped; they recompute later). `steps` > 1: a
    multi-step decode, every item a decode of `item.tokens` <= steps tokens run in one device loop (a row past its
    share, or past a stop token, idles)."""

    items: tuple[WorkItem, ...]
    moves: tuple[KVMove, ...] = ()
    predicted_time: float = 0.0  # the scheduler's cost-model estimate, seconds
    blocks: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    preempted: tuple[str, ...] = ()
    steps: int = 1

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset(item.request_id for item in self.items)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What an executor reports for one Plan: when it ended, how long each item took, the tokens it produced."""

    end_time: float
    durations: tuple[float, ...]  # one per plan item
    tokens: Mapping[str, tuple[int, ...]]  # request id -> new token ids (the simulator produces placeholder ids)
    stopped: frozenset[str] = frozenset()  # requests that hit a stop condition before output_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dispatch:
    """A prompt's decode instance (its index in the cluster), its predicted decode length and, under ESP, where its
    KV stays after the prefill."""

    decoder: int
    predicted: int  # decode tokens: the upper end of the predicted range
    heavy: bool
    # pool instance -> KV tokens kept there, the last taking new tokens (ESP's scale-down); empty: all on `decoder`
    shards: Mapping[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleChange:
    """An instance flip (TetriInfer 3.5): started (the unit drains: no new work of its old role) or done (the unit
    has its new role)."""

    flip: Flip
    unit: int
    done: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterPlan:
    """What a cluster policy decided now: prefill chunks (items sharing a group run as one chunk, in order), KV
    moves, the decode instance of each prompt whose prefill ends in one of these chunks, and role changes."""

    items: tuple[WorkItem, ...] = ()
    moves: tuple[KVMove, ...] = ()
    dispatch: Mapping[str, Dispatch] = dataclasses.field(default_factory=dict)
    roles: tuple[RoleChange, ...] = ()

    def chunks(self) -> dict[tuple[int, ...], tuple[WorkItem, ...]]:
        """The items by group, each group's in plan order."""
        out: dict[tuple[int, ...], list[WorkItem]] = {}
        for item in self.items:
            out.setdefault(item.group, []).append(item)
        return {g: tuple(items) for g, items in out.items()}
