"""The parts of the capture server (`eaglenest serve-capture`, `vllm.capture_url`) that need no
engine: the config it starts from, its address, the name it serves under and its flags. The
server itself, against the real vLLM, is tests/engine/test_vllm_capture_server.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from eaglenest.capture.request import served_name
from eaglenest.capture.server import merged_config, server_address
from eaglenest.vllm_engine.cpu import server_flags

REPO = Path(__file__).resolve().parents[3]


def capture_request(path: str, **change) -> dict:
    request = {
        "target": path, "dtype": "float32", "quantization": None, "engine_args": {},
        "cpu_workarounds": True, "layer_ids": [2, 4, 5, 8], "trust_remote_code": False,
        "max_model_len": 1024, "tensor_parallel_size": 1, "gpu_memory_utilization": None,
        "requests_per_batch": 64, "out_dir": "/tmp/x",
    }  # fmt: skip
    return {**request, **change}


def test_the_served_name_changes_with_what_shapes_the_states_only(tmp_path, monkeypatch):
    """A job refuses a server started for another capture: the name it checks changes with the
    layers, dtype, engine arguments, quantization and CPU fixes, and not with how big or where
    the engine runs, nor with how the target's directory is written."""
    target = tmp_path / "target"
    target.mkdir()
    monkeypatch.chdir(tmp_path)
    name = served_name(capture_request(str(target)))
    assert name.startswith("eaglenest-capture-")
    assert served_name(capture_request("target")) == name  # relative, from the same place
    same = {"max_model_len": 4096, "tensor_parallel_size": 8, "requests_per_batch": 1,
            "out_dir": "/elsewhere", "gpu_memory_utilization": 0.9}  # fmt: skip
    for key, value in same.items():
        assert served_name(capture_request(str(target), **{key: value})) == name, key
    other = {"layer_ids": [1, 4, 5, 8], "dtype": "bfloat16", "engine_args": {"kv_cache_dtype": "fp8"},
             "quantization": "fp8", "cpu_workarounds": False, "target": str(tmp_path)}  # fmt: skip
    for key, value in other.items():
        assert served_name(capture_request(str(target), **{key: value})) != name, key


def test_the_config_is_the_one_snakemake_runs_with(tmp_path):
    """`--configfile a b`: b updates a section by section (keys of a section it leaves alone
    stay), the schema fills the rest, the demo's target is the one the pipeline builds."""
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({
        "run": "capture", "hidden": {"backend": "vllm"},
        "vllm": {"capture_url": "http://10.0.0.5:8123", "python": "/opt/vllm/bin/python"},
    }))  # fmt: skip
    config = merged_config([str(REPO / "config" / "config.yaml"), str(override)])
    demo = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert config["hidden"]["backend"] == "vllm"
    assert config["demo_target"] == {**config["demo_target"], **demo["demo_target"]}
    assert config["target"]["path"] == "results/capture/target"
    assert config["vllm"]["requests_per_batch"] == 64  # a schema default
    assert server_address(config, None, None) == ("10.0.0.5", 8123)
    assert server_address(config, "0.0.0.0", 9000) == ("0.0.0.0", 9000)
    config["vllm"]["capture_url"] = None
    assert server_address(config, None, None) == ("127.0.0.1", 8765)


def test_false_engine_arguments_become_no_flags():
    """vLLM's boolean options take `--no-...`: the capture server turns chunked prefill and
    prefix caching off with them (left out, vLLM would keep its default, on)."""
    flags = server_flags({"enable_chunked_prefill": False, "enforce_eager": True, "seed": None})
    assert flags == ["--no-enable-chunked-prefill", "--enforce-eager"]


def test_serve_capture_refuses_a_config_without_the_vllm_backend(tmp_path):
    from eaglenest.capture.server import server_request
    from eaglenest.vllm_engine.process import EngineError

    config = merged_config([str(REPO / "config" / "config.yaml")])
    with pytest.raises(EngineError, match="hidden.backend"):
        server_request(config, tmp_path, "127.0.0.1", 8765)
    assert not os.listdir(tmp_path)


def test_serve_capture_says_how_to_build_a_missing_demo_target(tmp_path, monkeypatch):
    from eaglenest.capture.server import server_request
    from eaglenest.vllm_engine.process import EngineError

    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"run": "unbuilt", "hidden": {"backend": "vllm"}}))
    config = merged_config([str(REPO / "config" / "config.yaml"), str(override)])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EngineError, match=r"built by `snakemake results/unbuilt/target`"):
        server_request(config, tmp_path, "127.0.0.1", 8765)
