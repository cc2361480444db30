"""Every setting of jaxserve in one tree of typed dataclasses, with its default and its help.

The command line defines one flag per field (cli.py), named as the field unless its metadata says otherwise.
`LLM` takes an `EngineConfig`, `Server` a `ServerConfig`, the simulator a `SimConfig`. The engine's and the
simulator's trees hold the same `SchedulerConfig`. Names follow vLLM's where the idea is vLLM's. Plain Python: every
layer may import it (sched/ and sim/ too).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal, NamedTuple

DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("int8", "int4", "fp8", "gguf")  # models/quantize.py
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8")  # engine/kv_cache.py
POLICIES = ("fcfs", "sjf", "ljf", "edf", "lrs", "lars")
CPU_BURST_STEPS = 8  # multi-step decode's default on a CPU (EngineConfig.burst_steps)


def setting(default: Any, help: str, *, flag: str | bool = True) -> Any:
    """A field with its help. flag: the flag's name if not the field's, or False for a field no flag sets."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag})


def section(cls: type, **defaults: Any) -> Any:
    """A nested config, built from its own defaults (or these, where its parent's differ)."""
    return dataclasses.field(default_factory=functools.partial(cls, **defaults) if defaults else cls)


def _positive(config: Any, *names: str) -> None:
    """Raise ValueError unless each named setting is a positive integer (or None, where None is its default)."""
    for name in names:
        value = getattr(config, name)
        if value is None and config.__dataclass_fields__[name].default is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model: str = setting(
        "smollm2-135m-instruct",
        "Registered model name, .gguf file, Hugging Face directory, or "
        "Hugging Face Hub id (org/name[@revision]; HF_TOKEN, HF_HUB_OFFLINE as huggingface_hub).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto",
        "Weights' dtype (the KV cache's too, but float32 on a CPU); auto: bfloat16 on an accelerator, "
        "float32 on a CPU.",
    )
    quantization: str | None = setting(
        None,
        "Weights kept quantized, weight-only: int8 (a scale per channel), int4 (blocks of 128 with a scale and "
        "offset: 4.25 bits a weight), fp8 (e4m3), or gguf (a .gguf file's Q8_0/Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/"
        "Q2_K/Q3_K blocks as stored). Default: the weights in --dtype.",
    )
    max_model_len: int | None = setting(None, "Context length (default: the model's, capped by the KV pool).")
    tokenizer: str | None = setting(
        None,
        "A Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json) "
        "used instead of the model's, e.g. real text for a random: model.",
    )

    def __post_init__(self):
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        _positive(self, "max_model_len")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = setting(16, "KV cache block, tokens.")
    kv_cache_tokens: int | None = setting(
        None, "KV pool size, tokens per instance (default: what --kv_cache_gib holds)."
    )
    kv_cache_gib: float | None = setting(
        None,
        "KV pool size, GiB per device (unless --kv_cache_tokens; default: "
        "what --gpu_memory_utilization leaves, or 2 GiB on a CPU).",
    )
    gpu_memory_utilization: float | None = setting(
        None,
        "Share of each device's memory the engine may use (vLLM's meaning): the KV pool takes what the weights "
        "and the largest step leave (default: 0.9 on an accelerator; on a CPU only when given, of the process's "
        "memory budget).",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "fp8"] = setting(
        "auto",
        "The KV cache's dtype: auto is the model's (float32 on a CPU, where XLA writes into 16-bit caches "
        "slowly); fp8 is e4m3 without scales (values beyond +-448 saturate), for GPUs.",
    )
    enable_prefix_caching: bool = setting(True, "Reuse cached KV of shared prompt prefixes.")
    key_block: int = setting(256, "Keys an attention tile reads at once, tokens (a multiple of --block_size).")

    def __post_init__(self):
        _positive(self, "block_size", "kv_cache_tokens", "key_block")
        if self.kv_cache_gib is not None and not (
            isinstance(self.kv_cache_gib, (int, float)) and self.kv_cache_gib > 0
        ):
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib!r}")
        u = self.gpu_memory_utilization
        if u is not None and not (isinstance(u, (int, float)) and not isinstance(u, bool) and 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


@dataclasses.dataclass(frozen=True)
class SLO:
    """Per-request service levels: a TTFT deadline that scales with the prompt's work, and a TPOT target."""

    ttft_slo: float = setting(
        1.0,
        "Seconds to the first token a prompt is due at least (a request may set its own: gRPC/HTTP field ttft_slo).",
    )
    ttft_factor: float = setting(3.0, "A prompt's TTFT deadline: max(--ttft_slo, this x its prefill time alone).")
    tpot_slo: float = setting(0.1, "Seconds per output token a request is due (the simulator's attainment).")

    def ttft(self, prefill_seconds: float) -> float:
        return max(self.ttft_slo, self.ttft_factor * prefill_seconds)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    policy: str = setting("lars", f"Prefill ordering policy: {', '.join(POLICIES)}.")
    max_num_seqs: int = setting(16, "Most requests in the running batch (holding KV).")
    max_num_batched_tokens: int = setting(512, "Most tokens in one step.")
    max_prefills_per_step: int = setting(
        8,
        "Most prompts' chunks in one step (the compiled step's attention has "
        "room for that many partial tiles, used or not).",
    )
    multi_prefill: bool = setting(
        True, "Several prompts' chunks per step (--nomulti_prefill with --policy=fcfs: one prompt's chunk per step)."
    )
    space_sharing: bool = setting(True, "Long prefills yield budget to urgent short ones by relative slack (Medha).")
    iteration_budget: float | None = setting(
        None,
        "Most seconds a step may take by the cost model (default: the "
        "measured time of a full step of --max_num_batched_tokens in "
        "--max_num_seqs rows, all decodes at --max_model_len but one fresh "
        "prompt's chunk; simulate: 0.05).",
    )
    num_scheduler_steps: int | None = setting(
        None,
        "Multi-step decode: when no prompt waits, up to this many decode steps "
        "run in one device loop (as many as fit the iteration budget; default: "
        f"{CPU_BURST_STEPS} on a CPU, 1 on a GPU, in a cluster and with pipeline stages).",
    )
    slo: SLO = section(SLO)

    def __post_init__(self):
        _positive(self, "max_num_seqs", "max_num_batched_tokens", "max_prefills_per_step", "num_scheduler_steps")


@dataclasses.dataclass(frozen=True)
class InstanceShape:
    """How an instance (the engine's, or a simulated replica) spans devices past tensor parallelism: Medha's
    pipeline stages and KV-parallel sets. One section in both trees: a flag means the same to serve and simulate."""

    stages: int = setting(
        1,
        "Pipeline stages of an instance: its layers split evenly over this many consecutive "
        "sets of --tp x --kvp devices, each holding its layers' weights and KV cache, hidden "
        "states passed stage to stage (serve: not with --prefill_instances or "
        "--num_scheduler_steps > 1).",
        flag="pipeline_stages",
    )
    kvp: int = setting(
        1,
        "KV-parallel sets of --tp devices in each pipeline stage (Medha's KVP): the KV cache's "
        "blocks spread over them and the batch runs on all, the attention's partials merged "
        "(serve: not with --prefill_instances, whose decode instances take --decode_kvp).",
    )
    kvp_tokens: int | None = setting(
        None,
        "With --kvp > 1: a sequence's tokens on one KV-parallel set before the "
        "next set joins (Medha's progressive KVP; a short request stays on one set). "
        "Default: serve spreads each request's blocks over every set; simulate fills "
        "what a set's memory holds.",
    )

    def __post_init__(self):
        _positive(self, "stages", "kvp", "kvp_tokens")

    def refuse_unread_kvp_tokens(self, sets: int, which: str) -> None:
        """kvp_tokens given where the instance it shapes has one KV-parallel set (`which` names that setting)."""
        if self.kvp_tokens is not None and sets == 1:
            raise ValueError(
                f"--kvp_tokens={self.kvp_tokens} does nothing with one KV-parallel set ({which}=1): "
                f"leave it out, or give {which}"
            )


# How a decode instance takes a prefilled request (ReplicaScheduler.reserve; TetriInfer 3.4)
DECODE_ADMISSION = ("greedy", "reserve_static", "reserve_dynamic")

# The cluster settings each --cluster_policy reads; every other one does nothing there (nor without a cluster)
CLUSTER_SETTINGS = {
    "cdsp": (
        "decode_instances",
        "decode_kvp",
        "decode_tp",
        "node_size",
        "receive_buffers",
        "decode_admission",
        "min_chunk",
        "improvement_rate",
        "improvement_rates",
        "sp_attention",
        "sparse_attention",
        "length_predictor",
    ),
    "tetriinfer": (
        "decode_instances",
        "decode_kvp",
        "decode_tp",
        "receive_buffers",
        "decode_admission",
        "prefill_chunk",
        "prefill_batch",
        "prefill_order",
        "flip_window",
        "length_predictor",
    ),
    # its pool's instances decode: a prompt's KV moves to one
    "esp": ("receive_buffers", "decode_admission", "length_predictor"),
    # its pool runs SP-NTP: --sp_attention is not a choice there
    "csps": (
        "decode_instances",
        "decode_kvp",
        "decode_tp",
        "node_size",
        "receive_buffers",
        "decode_admission",
        "partition_tokens",
        "sparse_attention",
        "length_predictor",
    ),
}
CLUSTER_POLICIES = tuple(CLUSTER_SETTINGS)
LENGTH_PREDICTORS = ("mean", "prompt")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Which devices do what: instances of `tp` devices; with prefill_instances > 0, a live cluster."""

    tp: int = setting(
        1,
        "Tensor-parallel degree: devices per instance, each holding a share of every layer's "
        "heads and MLP (simulate: per simulated replica, default 8).",
    )
    prefill_instances: int = setting(
        0,
        "Instances (from the first device) forming a CDSP prefill pool; more than 0 "
        "makes the engine a live cluster (simulate: a simulated one). 0: one engine "
        "on one instance.",
    )
    decode_instances: int = setting(1, "Decode instances after the prefill pool (with --prefill_instances).")
    instance: InstanceShape = section(InstanceShape)
    decode_kvp: int = setting(
        1, "Instances per decode instance; more than 1 splits its KV cache over them (KV-parallel decode)."
    )
    decode_tp: int | None = setting(
        None,
        "Tensor-parallel degree of the decode instances when it differs from the "
        "prefill pool's --tp (Tetris: TP 1 prefill instances, TP 8 decode). Default: "
        "--tp.",
    )
    node_size: int = setting(2, "Prefill instances per node (the planner keeps groups on whole nodes where it can).")
    receive_buffers: int = setting(4, "KV transfers a decode instance receives at once.")
    decode_admission: Literal["greedy", "reserve_static", "reserve_dynamic"] = setting(
        "greedy",
        "When a decode instance takes a prefilled request (TetriInfer 3.4), by its predicted decode "
        "length. greedy (vLLM): while its prompt's blocks are free; a request that outgrows the memory is "
        "preempted and recomputes. reserve_static: while every request's prompt and predicted decode fit. "
        "reserve_dynamic: while there is room when the request with the least predicted decode left ends.",
    )
    length_predictor: Literal["mean", "prompt"] = setting(
        "mean",
        "How a cluster predicts a request's decode length (its decode instance, admission and KV "
        "promises follow it). mean: the mean of the lengths served so far. prompt (TetriInfer 3.3.3): a classifier "
        "over 200-token buckets that reads the served model's embedding of the prompt and its length, learned from "
        "the lengths served (the running mean until 32 have finished), its state kept in the cache folder.",
    )
    min_chunk: int = setting(1024, "The smallest CDSP chunk, tokens.")
    improvement_rate: float = setting(
        0.1,
        "cdsp: a chunk takes a larger group only if it ends at least this share sooner there (Tetris 5.1); "
        "higher keeps a loaded pool from spending many instances on small gains.",
    )
    improvement_rates: str | None = setting(
        None,
        "cdsp: Tetris's load-aware improvement rate (5.1). A JSON table of the best improvement rate at each "
        "arrival rate (tools/profile/improvement_rates.py profiles one on the pool's Eq. (1) in simulation); the "
        "planner "
        "takes the rate recorded for the load nearest the arrivals of the last 30 s, refreshed every 30 s. "
        "Default: --improvement_rate, fixed.",
    )
    cluster_policy: Literal["cdsp", "tetriinfer", "esp", "csps"] = setting(
        "cdsp",
        "How a cluster prefills. cdsp (Tetris): each prompt planned chunk by chunk over SP groups of the "
        "pool, its KV streamed chunk by chunk to the decode instance chosen on arrival (by freeness). tetriinfer "
        "(TetriInfer): every pool instance prefills its own queue in fixed-size chunks, ordered by "
        "--prefill_order within scheduling batches; a done prompt's whole KV moves to a decode instance chosen "
        "by power of two on its predicted decode length. esp (LoongServe): the --prefill_instances instances "
        "both prefill and decode (no separate decode instances); a batch of prompts prefills over an elastic "
        "group of them (ring attention), and each prompt then decodes on the fewest instances of its group that "
        "hold its KV (over several: multi-master, growing onto another instance as its last one fills). csps "
        "(CSPS): each prompt goes whole to the fewest pool instances (a power of two) that hold it in partitions "
        "of --partition_tokens, on the aligned group that frees up first, with SP-NTP attention (all-to-alls; CSA "
        "with --sparse_attention); its KV moves to the decode instance chosen on arrival (by freeness).",
    )
    sp_attention: Literal["ring", "sp_ntp"] = setting(
        "ring",
        "cdsp: a chunk's attention over its SP group. ring (Tetris's CDSP): zigzag ring attention, K/V "
        "passed around the group; sp_ntp (CSPS's SP-NTP): heads spread over the group by all-to-all (heads that do "
        "not divide over it run as MHA, padded).",
    )
    sparse_attention: float | None = setting(
        None,
        "csps, or cdsp with --sp_attention=sp_ntp: CSPS's communication-efficient sparse attention (CSA) on each "
        "chunk, dropping this fraction of an earlier partition's K/V at level 2 and more at farther levels (the "
        "paper's geometric schedule; 0 drops nothing: dense results). The history stays dense. Needs node sizes "
        "and groups of powers of two. Default: dense attention.",
    )
    partition_tokens: int = setting(
        131072,
        "csps: the most tokens of a prompt one pool instance takes (CSPS's "
        "sequence partition, SPT; the paper's 64K-128K). Fewer spread prompts over more "
        "instances (each a power of two).",
    )
    prefill_chunk: int = setting(512, "tetriinfer: tokens in a prefill chunk (TetriInfer's ChunkSize).")
    prefill_batch: int = setting(16, "tetriinfer: prompts in a scheduling batch.")
    prefill_order: Literal["fcfs", "sjf", "ljf"] = setting(
        "sjf", "tetriinfer: the order within a scheduling batch (shortest or longest prompt first, or arrival)."
    )
    flip_window: float = setting(
        0.0,
        "tetriinfer: instance flip (TetriInfer 3.5). An instance whose load stayed "
        "under 10% for this many seconds turns to the other role when that role's mean "
        "load is over 80% (it drains first; one of each role stays). Every instance can "
        "then both prefill and decode. 0: no flips.",
    )

    def __post_init__(self):
        # the cluster checks its layout against the devices (cluster/build.py)
        _positive(self, "tp", "prefill_chunk", "prefill_batch", "min_chunk", "receive_buffers", "partition_tokens")
        if self.flip_window < 0:
            raise ValueError(f"flip_window must be 0 (no flips) or more, got {self.flip_window}")
        if self.cluster_policy not in CLUSTER_POLICIES:
            raise ValueError(
                f"cluster_policy must be one of {', '.join(CLUSTER_POLICIES)}, got {self.cluster_policy!r}"
            )
        if self.prefill_order not in ("fcfs", "sjf", "ljf"):
            raise ValueError(f"prefill_order must be fcfs, sjf or ljf, got {self.prefill_order!r}")
        if self.decode_admission not in DECODE_ADMISSION:
            raise ValueError(
                f"decode_admission must be {', '.join(DECODE_ADMISSION[:-1])} or "
                f"{DECODE_ADMISSION[-1]}, got {self.decode_admission!r}"
            )
        if self.decode_tp is not None and self.decode_tp < 1:
            raise ValueError(f"decode_tp must be a positive integer, got {self.decode_tp!r}")
        if not 0 <= self.improvement_rate < 1:
            raise ValueError(f"improvement_rate must be in [0, 1), got {self.improvement_rate}")
        if self.improvement_rates is not None and self.improvement_rate != 0.1:
            raise ValueError(
                f"--improvement_rate={self.improvement_rate}: not read with --improvement_rates (the "
                "table picks the rate); leave one out"
            )
        if self.length_predictor not in LENGTH_PREDICTORS:
            raise ValueError(f"length_predictor must be mean or prompt, got {self.length_predictor!r}")
        if self.sp_attention not in ("ring", "sp_ntp"):
            raise ValueError(f"sp_attention must be ring or sp_ntp, got {self.sp_attention!r}")
        if self.sparse_attention is not None and not (
            self.pool_sp_attention == "sp_ntp" and 0 <= self.sparse_attention <= 1
        ):
            raise ValueError(
                f"--sparse_attention (CSA's drop ratio, 0 to 1) needs SP-NTP (--cluster_policy=csps, or "
                f"cdsp with --sp_attention=sp_ntp); got {self.sparse_attention} with "
                f"{self.cluster_policy} and {self.sp_attention}"
            )
        self._refuse_unread()
        if self.prefill_instances:
            self._check_cluster()
        if not self.prefill_instances:
            self.instance.refuse_unread_kvp_tokens(self.instance.kvp, "--kvp")
        elif self.cluster_policy != "esp":  # the sets of its decode instances
            self.instance.refuse_unread_kvp_tokens(self.decode_kvp, "--decode_kvp")

    def _check_cluster(self) -> None:
        """What a cluster's layout must be, its devices aside (cluster/build.py counts those): the live cluster and
        the simulated one (sim/cluster.py) read it alike."""
        if self.instance.stages > 1 or self.instance.kvp > 1:
            raise ValueError(
                "pipeline stages and KV-parallel sets (--pipeline_stages, --kvp) shape one engine's "
                "instance; a cluster's instances (--prefill_instances) run without them (its decode "
                "instances take --decode_kvp)"
            )
        if min(self.prefill_instances, self.decode_instances, self.decode_kvp, self.node_size) < 1:
            raise ValueError(
                f"a cluster needs at least one prefill and one decode instance, of one device or more, "
                f"in nodes of one or more; got {self}"
            )
        chunk = self.prefill_chunk
        if self.cluster_policy == "tetriinfer" and (chunk & (chunk - 1) or chunk < 16):
            raise ValueError(f"--prefill_chunk must be a power of two of 16 or more, got {chunk}")
        if self.flip_window and (self.decode_kvp > 1 or self.decoder_tp != self.tp):  # (tetriinfer's flag)
            raise ValueError(
                "instance flips (--flip_window) need decode instances of one instance each, as the "
                "pool's (--decode_kvp=1, --decode_tp as --tp)"
            )
        if self.cluster_policy in ("cdsp", "csps") and self.prefill_instances % self.node_size:
            raise ValueError(f"{self.prefill_instances} prefill instances do not form nodes of {self.node_size}")
        powers = [n for n in (self.node_size, self.prefill_instances) if n & (n - 1)]
        if powers and (self.sparse_attention is not None or self.cluster_policy == "csps"):
            what = "CSA (--sparse_attention)" if self.sparse_attention is not None else "CSPS"
            raise ValueError(
                f"{what} needs groups of a power of two instances: --node_size and "
                f"--prefill_instances must be powers of two, got {powers}"
            )
        if self.cluster_policy == "csps" and self.tp > 1:
            raise ValueError(
                f"--cluster_policy=csps with --tp={self.tp}: CSPS's SP-TP (a group's instances "
                "splitting the weights) is not built; its pool runs SP-NTP on instances of one device "
                "each, a whole copy of the weights on every one (--tp=1)"
            )

    def _refuse_unread(self) -> None:
        """A cluster setting given (not its default) that the layout never reads is refused by name: it would
        otherwise be accepted and do nothing."""
        cluster = ("cluster_policy", *dict.fromkeys(n for names in CLUSTER_SETTINGS.values() for n in names))
        read = ("cluster_policy", *CLUSTER_SETTINGS[self.cluster_policy]) if self.prefill_instances else ()
        unread = [
            f"--{n}={getattr(self, n)}"
            for n in cluster
            if n not in read and getattr(self, n) != self.__dataclass_fields__[n].default
        ]
        if self.prefill_instances and self.cluster_policy == "esp" and self.instance.kvp_tokens is not None:
            unread.append(f"--kvp_tokens={self.instance.kvp_tokens}")  # its instances decode on one set each
        if unread:
            layout = (
                f"--cluster_policy={self.cluster_policy}"
                if self.prefill_instances
                else "one engine (a cluster needs --prefill_instances)"
            )
            raise ValueError(
                f"{', '.join(unread)}: not read with {layout}; leave {'it' if len(unread) == 1 else 'them'} out"
            )

    @property
    def decoder_tp(self) -> int:
        """Devices of each instance a decode instance is made of."""
        return self.decode_tp or self.tp

    @property
    def pool_sp_attention(self) -> str:
        """A chunk's attention over its group: CSPS's pool is SP-NTP's; the others' --sp_attention."""
        return "sp_ntp" if self.cluster_policy == "csps" else self.sp_attention

    @property
    def pool_attention(self) -> str:
        """The prefill pool's attention in a word: ring, sp_ntp or csa<drop>."""
        return self.pool_sp_attention if self.sparse_attention is None else f"csa{self.sparse_attention:g}"


@dataclasses.dataclass(frozen=True)
class StartupConfig:
    quick_start: bool = setting(
        True,
        "serve: listen once the first requests' programs compile; the rest compile "
        "in the background (a cluster's own: while idle), and an uncached cost profile is "
        "measured when first idle. A cluster (serve and generate) plans with a prior "
        "prefill model until it has measured its pool's while idle (--noquick_start: "
        "compile and measure everything before the first request).",
    )
    warmup: bool = setting(
        False,
        "Compile every step program (and measure an uncached cost profile) before the first request; serve sets it.",
        flag=False,
    )
    cost_profile: str | None = setting(
        None,
        "The step cost profile to load, or to measure and write (default: "
        "measured at first start, cached per device, model and dtype).",
    )
    prefill_profile: str | None = setting(
        None,
        "The prefill pool's Eq. (1) profile to load, or to measure and "
        "write (default: measured when first idle, or at start with "
        "--noquick_start, cached per device, model and pool).",
    )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What `LLM` serves with: the model, its KV cache, the scheduler, the device layout, start-up."""

    model: ModelConfig = section(ModelConfig)
    cache: CacheConfig = section(CacheConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    startup: StartupConfig = section(StartupConfig)

    def __post_init__(self):
        if (self.scheduler.num_scheduler_steps or 1) > 1 and self.parallel.prefill_instances:
            raise ValueError(
                "num_scheduler_steps > 1 (multi-step decode) serves one engine; a cluster's decode "
                "instances step one token at a time, so that its loop admits prompts between steps"
            )

    def burst_steps(self, platform: str) -> int:
        """The most decode steps of a burst: --num_scheduler_steps, or by default CPU_BURST_STEPS for one engine
        of one stage on a CPU, where a step's Python on the host takes the cores its kernels run on (a burst meets
        the host once; BENCHMARKS.md, "Multi-step decode on a CPU"), and 1 elsewhere (a GPU's host work overlaps
        its steps; a cluster's decode instances and pipeline stages step one token at a time)."""
        if self.scheduler.num_scheduler_steps is not None:
            return self.scheduler.num_scheduler_steps
        one = not self.parallel.prefill_instances and self.parallel.instance.stages == 1
        return CPU_BURST_STEPS if platform == "cpu" and one else 1


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "Address to bind (0.0.0.0 or :: to listen beyond this machine).")
    grpc_port: int = setting(50051, "gRPC port (0: any free port).")
    http_port: int = setting(8000, "HTTP port of the OpenAI-compatible API (0: any free port).")
    api_key: str | None = setting(
        None,
        "Key both interfaces require (`Authorization: Bearer <key>`); client: the "
        "key to send. Default: $JAXSERVE_API_KEY, if set.",
    )
    served_model_name: str | None = setting(None, "The model name clients use (default: --model).")
    max_queue: int = setting(
        256, "Most requests waiting beyond the batch; more are refused (RESOURCE_EXHAUSTED / HTTP 429)."
    )
    drain_timeout: float = setting(
        30.0, "On SIGTERM, seconds the whole shutdown may take (in-flight requests get most of it to finish)."
    )
    max_request_bytes: int = setting(
        32 << 20, "The largest HTTP request body read; larger ones get 413 before any parsing."
    )
    stall_timeout: float = setting(
        60.0,
        "Seconds without engine progress, with requests open, before health reports NOT_SERVING (HTTP /health 503).",
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        "An origin whose browser pages may call the HTTP API (CORS), "
        "e.g. https://app.example.com, or * for any; repeat the flag for "
        "more. Default: none (browsers keep other origins' pages out).",
    )
    request_read_timeout: float = setting(
        30.0,
        "Seconds an HTTP client may take to send its request headers (the "
        "connection is closed past it) and between two pieces of its body (408 "
        "past it).",
    )


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Serving across processes (jax.distributed): process 0 runs the servers and the scheduler."""

    coordinator_address: str | None = setting(None, "HOST:PORT of process 0; the others replay its device calls.")
    num_processes: int | None = setting(None, "How many processes (with --coordinator_address).")
    process_id: int | None = setting(None, "This process's rank, 0 to --num_processes - 1.")
    distributed: bool = setting(
        False,
        "Join the cluster (e.g. SLURM) that jax.distributed detects, instead of "
        "--coordinator_address/--num_processes/--process_id.",
    )
    heartbeat_timeout: int = setting(
        10,
        "Seconds without a heartbeat after which a process counts as dead: "
        "serve fails over to one engine on process 0's devices and resumes every "
        "request there (if that cannot be built, they end UNAVAILABLE and the job "
        "ends).",
    )


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """`generate` and `client`: what to ask and where."""

    prompt: str | None = setting(None, "Prompt text.")
    chat: bool = setting(True, "Wrap --prompt in the model's chat template as a user message.")
    target: str = setting("127.0.0.1:50051", "client: the server's gRPC address.")


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """simulate: the arrivals."""

    trace: str = setting(
        "azure_conv",
        "azure_conv, azure_code, arxiv, mix (short + long requests), or a trace "
        "file: CSV or JSON Lines of (arrival, prompt tokens, output tokens).",
    )
    rate: float | None = setting(None, "Arrival rate, requests/s (traces: rescaled to it; default: as recorded).")
    requests: int | None = setting(None, "Number of requests (default: the whole trace).")
    long_fraction: float = setting(0.05, "Share of long requests in --trace=mix.")
    arrival: Literal["poisson", "gamma"] = setting("poisson", "Arrival process of --trace=mix.")
    cv: float = setting(1.0, "Coefficient of variation of gamma inter-arrival times (1 = Poisson).")
    seed: int = setting(0, "The workload's random draws.", flag="workload_seed")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """A simulated cluster (simulate, jaxserve.sim): replicas of tp x stages x kvp GPUs, each driven by the replica
    scheduler over a built-in GPU profile. Its scheduler's defaults are an 8-GPU replica's, not this machine's."""

    profile: str = setting(
        "a100_llama3_8b", "simulate: GPU/model profile (a100_llama3_8b, h100_llama2_7b, h100_llama2_70b)."
    )
    tp: int = setting(8, "GPUs per pipeline stage of a replica (simulate: --tp).", flag=False)
    instance: InstanceShape = section(InstanceShape)  # a replica's pipeline stages and KV-parallel sets
    replicas: int = setting(1, "simulate: number of replicas.")
    scheduler: SchedulerConfig = section(
        SchedulerConfig, max_num_seqs=256, max_num_batched_tokens=1 << 16, iteration_budget=0.05
    )
    chunk_align: int = setting(32, "Prefill chunks are multiples of this many tokens.", flag=False)
    long_threshold: int = setting(32768, "Prompts this long count as long: at most one per batch.", flag=False)
    max_prefills: int | None = setting(None, "Most prefill chunks in a batch (None: any).", flag=False)
    sjf_batch: int = setting(16, "TetriInfer's scheduling batch for sjf / ljf.", flag=False)
    kv_capacity: int | None = setting(
        None, "KV tokens per replica (None: what the GPUs' memory holds beside the weights).", flag=False
    )
    memory_utilization: float = setting(0.9, "The share of GPU memory for weights and KV.", flag=False)
    block_size: int = setting(16, "KV block, tokens.", flag=False)
    dispatch: Literal["least_work", "round_robin"] = setting(
        "least_work", "Which replica an arrival goes to.", flag=False
    )
    time_scale: float = setting(
        1.0,
        "What a step takes over what the cost model says: the scheduler plans with "
        "the model, the clock charges model x time_scale (a replay of a live run sets the "
        "live steps' measured / predicted ratio).",
        flag=False,
    )
    out: str | None = setting(None, "simulate: directory for summary.json, requests.csv and ttft_cdf.png.")

    def __post_init__(self):
        for name in ("replicas", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.instance.refuse_unread_kvp_tokens(self.instance.kvp, "--kvp")
        if self.scheduler.iteration_budget is None:
            raise ValueError("a simulated replica needs an iteration_budget (seconds)")
        if (self.scheduler.num_scheduler_steps or 1) > 1 and self.instance.stages > 1:
            raise ValueError(
                "multi-step decode (num_scheduler_steps > 1) runs on one pipeline stage: each of a "
                "burst's steps would cross every stage before the next could start"
            )
        if self.dispatch not in ("least_work", "round_robin"):
            raise ValueError(f"dispatch must be least_work or round_robin, got {self.dispatch!r}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.instance.stages * self.instance.kvp


# the sections the command line sets, each once
FLAG_SECTIONS = (EngineConfig, ServerConfig, DistributedConfig, ClientConfig, WorkloadConfig, SimConfig)


class Leaf(NamedTuple):
    path: tuple[str, ...]  # field names from the root config
    field: dataclasses.Field
    kind: Any  # the field's type


def leaves(cls: type) -> dict[str, Leaf]:
    """Every setting under cls by its field name (unique in a tree)."""
    found, kinds = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(kinds[f.name]):  # a section
            found.update(
                {name: leaf._replace(path=(f.name, *leaf.path)) for name, leaf in leaves(kinds[f.name]).items()}
            )
        else:
            found[f.name] = Leaf((f.name,), f, kinds[f.name])
    return found


def flag_name(f: dataclasses.Field) -> str | None:
    """The flag that sets field f, or None."""
    flag = f.metadata.get("flag", True)
    return f.name if flag is True else flag or None


def flags() -> dict[str, Leaf]:
    """Every command-line flag and the setting it sets (a section in two trees, e.g. SchedulerConfig in
    EngineConfig and SimConfig, gives its flags once). ValueError if two settings claim one flag."""
    found: dict[str, Leaf] = {}
    for root in FLAG_SECTIONS:
        for leaf in leaves(root).values():
            flag = flag_name(leaf.field)
            if flag and found.setdefault(flag, leaf).field is not leaf.field:
                raise ValueError(f"--{flag} would set two settings")
    return found


def replace(config: Any, **values: Any) -> Any:
    """config with the named settings (field names, nested sections included) replaced; others kept. Each
    section is made once with all its new values, so its checks see them together (in any order given)."""
    fields = leaves(type(config))
    for name in values:
        if name not in fields:
            raise TypeError(f"{type(config).__name__} has no setting {name!r}")
    return _replace(config, {fields[name].path: value for name, value in values.items()})


def _replace(config: Any, values: dict[tuple[str, ...], Any]) -> Any:
    here = {path[0]: value for path, value in values.items() if len(path) == 1}
    for section in dict.fromkeys(path[0] for path in values if len(path) > 1):
        here[section] = _replace(
            getattr(config, section), {path[1:]: value for path, value in values.items() if path[0] == section}
        )
    return dataclasses.replace(config, **here)
