"""Worker flags: every flag (engine flags in argument groups included) reads PDSERVE_<FLAG>."""
from __future__ import annotations

import pytest

from common.engine.engine_args import engine_config_from_args
from common.service.flags import advertised_zmq_endpoint
from decode_service.main import build_parser as decode_parser
from prefill_service.main import build_parser as prefill_parser


def test_env_defaults_reach_grouped_flags(monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_CACHE_MEMORY", "64MiB")
    monkeypatch.setenv("PDSERVE_LOCAL_PREFILL_THRESHOLD", "5")
    monkeypatch.setenv("PDSERVE_NO_LOCAL_FALLBACK", "true")
    args = decode_parser().parse_args(["--max-num-seqs", "3"])
    assert (args.kv_cache_memory, args.local_prefill_threshold, args.no_local_fallback) == ("64MiB", 5, True)
    config = engine_config_from_args(args)
    assert (config.cache.kv_cache_memory, config.scheduler.max_num_seqs) == ("64MiB", 3)
    assert "[env PDSERVE_EVENTS_PORT]" in prefill_parser().format_help()


def test_bad_env_value_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_PORT", "not-a-port")
    with pytest.raises(SystemExit):
        prefill_parser().parse_args([])


def test_defaults_are_loopback_and_free_ports():
    args = prefill_parser().parse_args([])
    assert (args.host, args.port, args.events_port, args.grace_period) == ("127.0.0.1", 0, 0, 30.0)
    assert advertised_zmq_endpoint(args, "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    args = decode_parser().parse_args(["--host", "0.0.0.0", "--advertise-address", "10.0.0.5:7000"])
    assert advertised_zmq_endpoint(args, "tcp://0.0.0.0:5601") == "tcp://10.0.0.5:5601"


def test_a_decode_instance_can_keep_one_weight_copy(monkeypatch):
    assert not engine_config_from_args(decode_parser().parse_args([])).single_weight_copy
    assert engine_config_from_args(decode_parser().parse_args(["--single-weight-copy"])).single_weight_copy
    monkeypatch.setenv("PDSERVE_SINGLE_WEIGHT_COPY", "true")  # as compose and Kubernetes set it
    assert engine_config_from_args(decode_parser().parse_args([])).single_weight_copy
    assert not engine_config_from_args(decode_parser().parse_args(["--no-single-weight-copy"])).single_weight_copy
    monkeypatch.setenv("PDSERVE_SINGLE_WEIGHT_COPY", "false")
    assert not engine_config_from_args(decode_parser().parse_args([])).single_weight_copy


def test_the_pooler_config_flag_reaches_both_roles_engines():
    flag = ["--pooler-config", '{"pooling_type": "mean", "use_activation": false}']
    for parser in (prefill_parser(), decode_parser()):
        assert engine_config_from_args(parser.parse_args(flag)).pooler_config == {"pooling_type": "MEAN",
                                                                                   "normalize": False}
        assert engine_config_from_args(parser.parse_args([])).pooler_config is None


def test_several_served_model_names_register_the_first_and_come_from_the_environment_too(monkeypatch):
    from common.service.flags import served_model_name
    from gateway.main import build_parser as gateway_parser
    args = decode_parser().parse_args(["--served-model-name", "gpt-4o", "smol"])
    assert (args.served_model_name, served_model_name(args)) == (["gpt-4o", "smol"], "gpt-4o")
    assert served_model_name(decode_parser().parse_args(["--model", "m"])) == "m"
    monkeypatch.setenv("PDSERVE_SERVED_MODEL_NAME", "gpt-4o smol")  # space-separated, as on a command line
    assert gateway_parser().parse_args([]).served_model_name == ["gpt-4o", "smol"]
    assert served_model_name(prefill_parser().parse_args([])) == "gpt-4o"


def test_vllms_spellings_of_the_engine_switches_run_as_they_are():
    def config(*flags):
        return engine_config_from_args(decode_parser().parse_args(list(flags)))
    assert config().cache.enable_prefix_caching and config().scheduler.enable_chunked_prefill
    assert not config("--no-enable-prefix-caching").cache.enable_prefix_caching
    assert not config("--no-enable-chunked-prefill").scheduler.enable_chunked_prefill
    assert config("--enable-prefix-caching", "--trust-remote-code").cache.enable_prefix_caching
    assert not config("--no-prefix-caching").cache.enable_prefix_caching
    with pytest.raises(ValueError, match="--no-prefix-caching contradicts --enable-prefix-caching"):
        config("--no-prefix-caching", "--enable-prefix-caching")


def test_blocks_ahead_come_from_the_flag_and_a_bad_count_is_refused():
    assert engine_config_from_args(decode_parser().parse_args([])).cache.num_blocks_ahead == 7
    args = decode_parser().parse_args(["--num-kv-blocks-ahead", "0"])
    assert engine_config_from_args(args).cache.num_blocks_ahead == 0
    with pytest.raises(ValueError, match="num_blocks_ahead must be an integer >= 0"):
        engine_config_from_args(decode_parser().parse_args(["--num-kv-blocks-ahead", "-1"]))


def test_the_grammar_warm_up_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("PDSERVE_GRAMMAR_WARM_UP", raising=False)  # the suite turns it off
    assert decode_parser().parse_args([]).grammar_warm_up
    assert not prefill_parser().parse_args(["--no-grammar-warm-up"]).grammar_warm_up
    monkeypatch.setenv("PDSERVE_GRAMMAR_WARM_UP", "0")
    assert not decode_parser().parse_args([]).grammar_warm_up
    assert decode_parser().parse_args(["--grammar-warm-up"]).grammar_warm_up
