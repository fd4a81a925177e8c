"""Configs: one field is one flag with its help, and a bad value names its flag."""
from __future__ import annotations

import dataclasses

import pytest

from rawserve.config import EngineConfig, ServerConfig, build_parser, configs_from_args, flag


def test_every_config_field_is_a_flag_with_help():
    help_text = build_parser().format_help()
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            assert flag(f.name) in help_text, f.name
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


def test_flags_round_trip_into_configs():
    args = build_parser().parse_args(["--model-dir", "m", "--dtype", "bfloat16", "--num-kv-blocks", "8",
                                      "--no-enable-prefix-caching", "--api-key", "a", "--api-key", "b",
                                      "--port", "0", "--engine-mode", "thread"])
    engine, server = configs_from_args(args)
    assert (engine.model_dir, engine.dtype, engine.num_kv_blocks, engine.enable_prefix_caching) == \
        ("m", "bfloat16", 8, False)
    assert (server.api_key, server.port, server.engine_mode) == (["a", "b"], 0, "thread")
    assert configs_from_args(build_parser().parse_args([]))[1].api_key == []


@pytest.mark.parametrize("cls, kwargs, message", [
    (EngineConfig, {"dtype": "int8"}, "--dtype: must be one of"),
    (EngineConfig, {"block_size": 12}, "--block-size: must be a power of two"),
    (EngineConfig, {"max_num_seqs": 0}, "--max-num-seqs: must be >= 1"),
    (EngineConfig, {"attention_backend": "flash"}, "--attention-backend: must be one of torch"),
    (EngineConfig, {"attention_backend": "triton", "block_size": 8}, "--block-size: --attention-backend triton"),
    (EngineConfig, {"cuda_graphs": "yes"}, "--cuda-graphs: must be one of auto"),
    (EngineConfig, {"cuda_graphs": "on", "device": "cpu", "attention_backend": "triton"},
     "--cuda-graphs: on needs a CUDA device"),
    (EngineConfig, {"cuda_graphs": "on", "device": "cuda"}, "--cuda-graphs: on needs --attention-backend triton"),
    (EngineConfig, {"kv_cache_memory_gb": 0}, "--kv-cache-memory-gb: must be > 0"),
    (ServerConfig, {"port": 70000}, "--port: must be in 0..65535"),
    (ServerConfig, {"keep_alive_s": 0}, "--keep-alive-s: must be > 0"),
    (ServerConfig, {"write_timeout_s": 0}, "--write-timeout-s: must be > 0"),
    (ServerConfig, {"max_body_bytes": 0}, "--max-body-bytes: must be >= 1"),
    (ServerConfig, {"engine_mode": "fork"}, "--engine-mode: must be thread|process"),
])
def test_bad_value_raises_value_error_naming_the_flag(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)
