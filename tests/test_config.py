"""The config tree: one field per setting, one flag per field, defaults in one place."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from absl import flags

from jaxserve import cli, config
from jaxserve.sampling_params import SamplingParams


def _cli_flags() -> dict[str, flags.Flag]:
    return {f.name: f for f in flags.FLAGS.flags_by_module_dict()[cli.__name__]}


def _fields(cls: type) -> int:
    kinds = typing.get_type_hints(cls)
    return sum(
        _fields(kinds[f.name]) if dataclasses.is_dataclass(kinds[f.name]) else 1 for f in dataclasses.fields(cls)
    )


def test_every_flag_is_one_setting_and_every_setting_a_flag():
    for section in config.FLAG_SECTIONS:  # names are unique in each tree
        assert len(config.leaves(section)) == _fields(section), f"two settings of {section.__name__} share a name"
    settings = {flag: leaf.field.default for flag, leaf in config.flags().items()}  # refuses a flag set twice
    assert not set(settings) & set(cli.SAMPLING_FLAGS)
    settings |= {name: SamplingParams.__dataclass_fields__[name].default for name in cli.SAMPLING_FLAGS}
    defined = _cli_flags()
    assert set(defined) == set(settings)
    for name, default in settings.items():  # the flag's default is the setting's
        assert defined[name].default == (list(default) if isinstance(default, tuple) else default), name
    unflagged = {
        name
        for section in config.FLAG_SECTIONS
        for name, leaf in config.leaves(section).items()
        if not config.flag_name(leaf.field)
    }
    assert unflagged == {
        "warmup",
        "tp",
        "chunk_align",
        "long_threshold",
        "max_prefills",
        "sjf_batch",
        "kv_capacity",
        "memory_utilization",
        "block_size",
        "dispatch",
        "time_scale",
    }  # SimConfig's (and warmup)


def test_no_setting_has_a_second_name():
    names = {name for section in config.FLAG_SECTIONS for name in config.leaves(section)}
    for old, new in (
        ("t_target", "iteration_budget"),
        ("max_running", "max_num_seqs"),
        ("max_batch_tokens", "max_num_batched_tokens"),
        ("ttft_min", "ttft_slo"),
        ("prefix_caching", "enable_prefix_caching"),
    ):
        assert new in names and old not in names and old not in _cli_flags()


def test_replace_reaches_nested_settings_and_refuses_unknown_ones():
    cfg = config.replace(config.EngineConfig(), max_num_seqs=4, ttft_slo=2.5, tp=2, model="random:tiny")
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.slo.ttft_slo, cfg.parallel.tp) == (4, 2.5, 2)
    assert cfg.model.model == "random:tiny" and cfg.cache == config.CacheConfig()
    with pytest.raises(TypeError, match="no setting 'max_running'"):
        config.replace(cfg, max_running=4)


@pytest.mark.parametrize(
    "settings, platform, steps",
    [
        ({}, "cpu", config.CPU_BURST_STEPS),
        ({}, "gpu", 1),
        (dict(num_scheduler_steps=1), "cpu", 1),
        (dict(num_scheduler_steps=4), "gpu", 4),
        (dict(prefill_instances=2), "cpu", 1),
        (dict(stages=2), "cpu", 1),
    ],
)
def test_bursts_are_on_by_default_for_one_engine_on_a_cpu(settings, platform, steps):
    assert config.replace(config.EngineConfig(), **settings).burst_steps(platform) == steps


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(block_size=0), "block_size must be a positive integer"),
        (dict(max_num_seqs=True), "max_num_seqs must be a positive integer"),
        (dict(max_model_len=-3), "max_model_len must be a positive integer"),
        (dict(dtype="float16"), "dtype must be auto or one of"),
        (dict(tp=0), "tp must be a positive integer"),
        (dict(num_scheduler_steps=4, prefill_instances=2), "multi-step decode"),
        (dict(sp_attention="ulysses"), "sp_attention must be ring or sp_ntp"),
        (dict(sparse_attention=0.5), "needs SP-NTP"),
        (dict(sp_attention="sp_ntp", sparse_attention=1.5), "drop ratio, 0 to 1"),
        (
            dict(prefill_instances=4, sp_attention="sp_ntp", sparse_attention=0.5, cluster_policy="esp"),
            "not read with --cluster_policy=esp",
        ),
        (dict(prefill_instances=4, cluster_policy="csps", sp_attention="sp_ntp"), "--sp_attention=sp_ntp: not read"),
        (
            dict(prefill_instances=4, partition_tokens=4096),
            "--partition_tokens=4096: not read with --cluster_policy=cdsp",
        ),
        (dict(partition_tokens=0), "partition_tokens must be a positive integer"),
        (dict(cluster_policy="sarathi"), "cluster_policy must be one of cdsp, tetriinfer, esp, csps"),
        (dict(min_chunk=0), "min_chunk must be a positive integer"),
        (dict(receive_buffers=0), "receive_buffers must be a positive integer"),
        (dict(decode_admission="lazy"), "decode_admission must be greedy, reserve_static or reserve_dynamic"),
        (dict(kvp_tokens=256), r"--kvp_tokens=256 does nothing with one KV-parallel set \(--kvp=1\)"),
        (dict(improvement_rate=1.0), r"improvement_rate must be in \[0, 1\)"),
        (dict(decode_tp=0), "decode_tp must be a positive integer"),
        (
            dict(prefill_instances=4, improvement_rate=0.2, improvement_rates="t.json"),
            "--improvement_rate=0.2: not read with --improvement_rates",
        ),
        (dict(length_predictor="oracle"), "length_predictor must be mean or prompt"),
    ],
)
def test_bad_settings_are_refused_with_their_name(settings, message):
    with pytest.raises(ValueError, match=message):
        config.replace(config.EngineConfig(), **settings)


ONE_ENGINE = "not read with one engine \\(a cluster needs --prefill_instances\\)"


@pytest.mark.parametrize(
    "settings, message",
    [
        # cluster settings without a cluster
        (
            dict(decode_instances=2, min_chunk=256),
            f"--decode_instances=2, --min_chunk=256: {ONE_ENGINE}; leave them out",
        ),
        (dict(cluster_policy="esp"), f"--cluster_policy=esp: {ONE_ENGINE}; leave it out"),
        (dict(node_size=4), f"--node_size=4: {ONE_ENGINE}"),
        (dict(flip_window=2.0), f"--flip_window=2.0: {ONE_ENGINE}"),
        # TetriInfer's under cdsp; CDSP's under tetriinfer; neither's under esp
        (
            dict(prefill_instances=4, prefill_chunk=256, prefill_order="fcfs", prefill_batch=8),
            "--prefill_chunk=256, --prefill_batch=8, --prefill_order=fcfs: not read with --cluster_policy=cdsp",
        ),
        (dict(prefill_instances=4, flip_window=1.0), "--flip_window=1.0: not read with --cluster_policy=cdsp"),
        (
            dict(prefill_instances=4, cluster_policy="tetriinfer", min_chunk=256, node_size=4),
            "--node_size=4, --min_chunk=256: not read with --cluster_policy=tetriinfer",
        ),
        (
            dict(prefill_instances=4, cluster_policy="tetriinfer", sp_attention="sp_ntp"),
            "--sp_attention=sp_ntp: not read with --cluster_policy=tetriinfer",
        ),
        (
            dict(
                prefill_instances=4, cluster_policy="esp", decode_instances=2, decode_kvp=2, node_size=4, min_chunk=512
            ),
            "--decode_instances=2, --decode_kvp=2, --node_size=4, --min_chunk=512: not read with --cluster_policy=esp",
        ),
        (dict(prefill_instances=4, cluster_policy="esp", kvp_tokens=256), "--kvp_tokens=256: not read with "),
        (dict(prefill_instances=4, kvp_tokens=256), r"one KV-parallel set \(--decode_kvp=1\)"),
        (dict(decode_admission="reserve_static"), "--decode_admission=reserve_static: not read with one engine"),
        (dict(length_predictor="prompt"), "--length_predictor=prompt: not read with one engine"),
        (
            dict(prefill_instances=4, cluster_policy="esp", decode_tp=2),
            "--decode_tp=2: not read with --cluster_policy=esp",
        ),
        (
            dict(prefill_instances=4, cluster_policy="esp", improvement_rates="t.json"),
            "--improvement_rates=t.json: not read with --cluster_policy=esp",
        ),
        (
            dict(prefill_instances=4, cluster_policy="tetriinfer", improvement_rate=0.3),
            "--improvement_rate=0.3: not read with --cluster_policy=tetriinfer",
        ),
    ],
)
def test_a_setting_the_layout_does_not_read_is_refused_by_name(settings, message):
    """Given in any order (config.replace makes a section once), each is refused at start instead of doing
    nothing."""
    with pytest.raises(ValueError, match=message):
        config.replace(config.EngineConfig(), **settings)
    with pytest.raises(ValueError, match=message):
        config.replace(config.EngineConfig(), **dict(reversed(settings.items())))


def test_what_each_policy_reads_is_accepted():
    for settings in (
        dict(
            prefill_instances=4,
            decode_instances=2,
            decode_kvp=2,
            node_size=4,
            min_chunk=256,
            receive_buffers=2,
            sp_attention="sp_ntp",
            sparse_attention=0.5,
            decode_admission="reserve_static",
        ),
        dict(
            prefill_instances=4,
            cluster_policy="tetriinfer",
            decode_instances=2,
            prefill_chunk=256,
            prefill_batch=8,
            prefill_order="ljf",
            flip_window=1.0,
            receive_buffers=2,
            decode_admission="reserve_dynamic",
        ),
        dict(prefill_instances=4, cluster_policy="esp", receive_buffers=2, decode_admission="reserve_static"),
        dict(
            prefill_instances=8,
            cluster_policy="csps",
            node_size=4,
            decode_instances=2,
            decode_kvp=2,
            partition_tokens=4096,
            sparse_attention=0.5,
            decode_admission="reserve_static",
        ),
        dict(kvp=2, kvp_tokens=256),
        dict(prefill_instances=4, decode_kvp=2, kvp_tokens=256),
    ):
        config.replace(config.EngineConfig(), **settings)


@pytest.mark.parametrize(
    "layout, message",
    [
        (dict(prefill_instances=6, node_size=3, sp_attention="sp_ntp", sparse_attention=0.5), "powers of two"),
        (dict(prefill_instances=6, node_size=3, cluster_policy="csps"), "CSPS needs groups of a power of two"),
        (dict(prefill_instances=4, cluster_policy="csps", tp=2), "CSPS's SP-TP .* is not built"),
        (dict(prefill_instances=4, instance=config.InstanceShape(stages=2)), "pipeline stages"),
        (dict(prefill_instances=2, cluster_policy="tetriinfer", flip_window=1.0, decode_tp=2), "--decode_tp as --tp"),
        (dict(prefill_instances=2, cluster_policy="tetriinfer", prefill_chunk=24), "power of two of 16"),
        (dict(prefill_instances=6, node_size=4), "6 prefill instances do not form nodes of 4"),
        (dict(prefill_instances=2, decode_instances=0), "at least one prefill and one decode instance"),
    ],
)
def test_cluster_layouts_are_refused_with_the_flags_to_change(layout, message):
    """Devices aside, as the layout is made: `serve` and `simulate` refuse it alike."""
    with pytest.raises(ValueError, match=message):
        config.ParallelConfig(**layout)


def test_a_layout_needing_more_devices_than_there_are_is_refused_with_its_count():
    from jaxserve.cluster.build import check_layout

    layout = config.ParallelConfig(prefill_instances=4, tp=2, decode_instances=2, decode_tp=4)
    with pytest.raises(
        ValueError,
        match=r"needs 16 devices \(4 prefill, 2 devices each \+ 2 decode x 1, 4 devices "
        r"each\); there are 12",
    ):
        check_layout(layout, available=12)
