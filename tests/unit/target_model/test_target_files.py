"""The target's files: hub names resolved in the local Hugging Face cache (never downloaded), and
the target head read by name from the checkpoint's safetensors files (never the whole model)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import eaglenest.stages.hidden_states.extract as hs
from eaglenest.common.config import settings_from_sections
from eaglenest.common.io import sha256_file
from eaglenest.formats.target_head import TargetHeadError, save_target_head
from eaglenest.settings.hidden_states import TargetHeadSettings
from eaglenest.settings.samples import TokenizeSettings
from eaglenest.settings.target import TargetSettings
from eaglenest.stages.evaluate.live import eos_token_ids
from eaglenest.target_model.files import TargetNotFoundError, resolve_target_dir
from eaglenest.target_model.loading import load_target, target_config_hash
from eaglenest.target_model.special_tokens import TargetTokens, resolve_target_tokens
from eaglenest.target_model.tokenizer import load_tokenizer, think_token_ids

torch.set_num_threads(1)

HUB_NAME = "eaglenest-tests/demo-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


# --- a local Hugging Face cache holding the demo target -------------------------------------


def place_in_hub_cache(source: Path, cache: Path, name: str) -> Path:
    """`source` laid out as `hf download name` leaves it: models--org--name/snapshots/<commit>/
    with refs/main naming the commit. Returns the snapshot directory."""
    repo = cache / ("models--" + name.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(demo_target_dir, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf-cache")
    place_in_hub_cache(demo_target_dir, cache, HUB_NAME)
    return cache


@pytest.fixture
def offline_cache(hub_cache, monkeypatch) -> Path:
    """hub_cache as this process's Hugging Face cache, and any HTTP request an error."""
    import huggingface_hub.constants

    # The hub reads HF_HUB_CACHE from the environment at import; the constant is what it uses.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))

    def no_network(*args, **kwargs):
        raise AssertionError("the network was used")

    monkeypatch.setattr(httpx.Client, "send", no_network)
    monkeypatch.setattr(httpx.AsyncClient, "send", no_network)
    return hub_cache


def test_a_local_directory_is_used_as_it_is(demo_target_dir):
    assert resolve_target_dir(demo_target_dir) == demo_target_dir
    assert resolve_target_dir(str(demo_target_dir)) == demo_target_dir


def test_a_hub_name_resolves_to_its_cached_snapshot(offline_cache):
    snapshot = offline_cache / "models--eaglenest-tests--demo-qwen3" / "snapshots" / COMMIT
    assert resolve_target_dir(HUB_NAME) == snapshot
    assert (resolve_target_dir(HUB_NAME) / "config.json").is_file()


def test_a_name_missing_from_the_cache_names_the_key_and_the_fetch_command(offline_cache):
    with pytest.raises(TargetNotFoundError) as caught:
        resolve_target_dir("someone/missing-model", "target.tokenizer")
    message = str(caught.value)
    assert "target.tokenizer 'someone/missing-model'" in message
    assert "`hf download someone/missing-model`" in message
    assert str(offline_cache) in message
    with pytest.raises(TargetNotFoundError, match=r"target\.path 'someone/missing-model'"):
        load_tokenizer(
            settings_from_sections(TargetSettings, target={"path": "someone/missing-model"})
        )


def test_a_missing_local_directory_is_named(tmp_path):
    missing = tmp_path / "not-there"
    with pytest.raises(TargetNotFoundError, match=rf"target\.path '{missing}': no such directory"):
        resolve_target_dir(missing)


def target_tokens(target: dict) -> TargetTokens:
    """resolve_target_tokens as tokenize runs it, with the think ids the probe resolved."""
    settings = settings_from_sections(TokenizeSettings, target=target)
    think_ids = think_token_ids(target.get("tokenizer") or target["path"])
    return resolve_target_tokens(load_tokenizer(settings.target), think_ids, settings)


def test_tokenizer_and_end_of_turn_from_a_hub_name(offline_cache, demo_target_dir):
    by_name = {"path": HUB_NAME, "trust_remote_code": False}
    by_dir = {"path": str(demo_target_dir), "trust_remote_code": False}
    tokens = target_tokens(by_name)
    assert tokens == target_tokens(by_dir)
    assert (tokens.end_of_turn, tokens.end_of_turn_source) == ("<|im_end|>", "generation_config")
    assert tokens.vocab_size == 512
    assert think_token_ids(HUB_NAME) == think_token_ids(str(demo_target_dir))
    # target.tokenizer alone: the hub name serves the tokenizer as well
    only_tokenizer = {"tokenizer": HUB_NAME, "path": None, "trust_remote_code": False}

    def tokenizer_of(target: dict):
        return load_tokenizer(settings_from_sections(TargetSettings, target=target))

    assert len(tokenizer_of(only_tokenizer)) == len(tokenizer_of(by_dir))


def test_end_of_turn_without_a_generation_config_says_where_it_came_from(
    demo_target_dir, tmp_path, caplog
):
    target_dir = tmp_path / "target"
    shutil.copytree(demo_target_dir, target_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    (target_dir / "generation_config.json").unlink()
    target = {"path": str(target_dir), "trust_remote_code": False}
    with caplog.at_level(logging.WARNING, logger="eaglenest.stages.samples"):
        tokens = target_tokens(target)
    assert tokens.end_of_turn_source == "tokenizer"
    warning = caplog.text
    assert f"{target_dir / 'generation_config.json'} does not exist" in warning
    assert "the tokenizer's eos" in warning and "tokenize.end_of_turn_token" in warning


def test_every_reader_of_the_target_takes_a_hub_name(offline_cache, demo_target_dir):
    on_cpu = {"device": "cpu", "model_dtype": "float32"}
    by_name, by_dir = load_target(HUB_NAME, **on_cpu), load_target(demo_target_dir, **on_cpu)
    for (name, a), (_, b) in zip(by_name.state_dict().items(), by_dir.state_dict().items()):
        assert torch.equal(a, b), name
    assert target_config_hash(HUB_NAME) == sha256_file(demo_target_dir / "config.json")
    assert eos_token_ids(HUB_NAME, by_name) == eos_token_ids(demo_target_dir, by_dir)


# --- the target head, read from the checkpoint --------------------------------------------------


def model_head(target_dir: Path) -> dict:
    """The oracle: what the loaded model holds (in the checkpoint's dtype)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype="auto")
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return {
        "embed_tokens.weight": embed.detach().clone(),
        "lm_head.weight": head.detach().clone(),
        "norm.weight": model.model.norm.weight.detach().clone(),
        "tied": head.data_ptr() == embed.data_ptr(),
    }


@pytest.fixture(scope="module")
def demo_oracle(demo_target_dir) -> dict:
    return model_head(demo_target_dir)


@pytest.fixture
def no_model(monkeypatch):
    """Building the target in any way is an error (the head must come from the files)."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("save_target_head built the target model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", refuse)
    monkeypatch.setattr(hs, "load_target", refuse)


def saved_head(target_path: str | Path, out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    save_target_head(
        out, settings_from_sections(TargetHeadSettings, target={"path": str(target_path)})
    )
    with safe_open(str(out), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()  # noqa: SIM118


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    as_bytes = [t.contiguous().view(torch.uint8).flatten() for t in (actual, expected)]
    assert torch.equal(*as_bytes)


def assert_head_is(tensors: dict, meta: dict, oracle: dict) -> None:
    assert_same_bytes(tensors["embed_tokens.weight"], oracle["embed_tokens.weight"])
    assert_same_bytes(tensors["norm.weight"], oracle["norm.weight"])
    lm_head = tensors.get("lm_head.weight", tensors["embed_tokens.weight"])
    assert_same_bytes(lm_head, oracle["lm_head.weight"])
    assert json.loads(meta["tied_word_embeddings"]) == oracle["tied"]
    assert ("lm_head.weight" in tensors) == (not oracle["tied"])
    assert meta["source"] == "checkpoint"


def checkpoint_variant(
    demo_target_dir: Path,
    out_dir: Path,
    *,
    edit=None,
    config: dict | None = None,
    shards: int = 1,
) -> Path:
    """A copy of the demo target whose tensors `edit` changes (a dict in, a dict out), whose
    config.json gets `config`, saved as one model.safetensors or `shards` files with an index."""
    shutil.copytree(demo_target_dir, out_dir, ignore=shutil.ignore_patterns("model.safetensors*"))
    tensors = load_file(str(demo_target_dir / "model.safetensors"))
    with safe_open(str(demo_target_dir / "model.safetensors"), framework="pt") as f:
        metadata = f.metadata()
    tensors = edit(tensors) if edit else tensors
    if config:
        path = out_dir / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}, indent=2))
    if shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
        return out_dir
    names = sorted(tensors)
    size = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        file_name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[k * size : (k + 1) * size]}
        save_file(part, str(out_dir / file_name), metadata=metadata)
        weight_map |= dict.fromkeys(part, file_name)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}}
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps(index | {"weight_map": weight_map}, indent=2)
    )
    return out_dir


def test_target_head_from_a_hub_name_is_the_models(
    offline_cache, demo_target_dir, demo_oracle, no_model, tmp_path
):
    tensors, meta = saved_head(HUB_NAME, tmp_path / "head.safetensors")
    assert_head_is(tensors, meta, demo_oracle)
    assert demo_oracle["tied"] and set(tensors) == {"embed_tokens.weight", "norm.weight"}
    assert meta["target_path"] == HUB_NAME
    assert meta["target_config_sha256"] == sha256_file(demo_target_dir / "config.json")
    local, local_meta = saved_head(demo_target_dir, tmp_path / "local.safetensors")
    assert local.keys() == tensors.keys()
    for name in local:
        assert_same_bytes(tensors[name], local[name])
    assert {**meta, "target_path": ""} == {**local_meta, "target_path": ""}


def test_target_head_from_a_sharded_checkpoint(demo_target_dir, demo_oracle, no_model, tmp_path):
    target_dir = checkpoint_variant(demo_target_dir, tmp_path / "sharded", shards=2)
    weight_map = json.loads((target_dir / "model.safetensors.index.json").read_text())["weight_map"]
    # the head's tensors lie in different files
    assert weight_map["model.embed_tokens.weight"] != weight_map["model.norm.weight"]
    assert not (target_dir / "model.safetensors").exists()
    tensors, meta = saved_head(target_dir, tmp_path / "head.safetensors")
    assert_head_is(tensors, meta, demo_oracle)


def _with_lm_head(scale: float):
    def edit(tensors):
        return tensors | {"lm_head.weight": tensors["model.embed_tokens.weight"] * scale}

    return edit


def _multimodal(tensors):
    """Kimi-K2.5's layout: the language model under `language_model.`, beside a vision tower
    whose tensors end like the language model's."""
    renamed = {f"language_model.{name}": t for name, t in tensors.items()}
    return renamed | {"vision_tower.encoder.model.norm.weight": torch.ones(8)}


# (checkpoint edit, config.json changes, whether transformers loads the variant as it is)
HEAD_VARIANTS = {
    "untied": (_with_lm_head(2.0), {"tie_word_embeddings": False}, True),
    "tied, both saved and equal": (_with_lm_head(1.0), None, True),
    "tied, both saved and different": (_with_lm_head(2.0), None, True),
    "bf16": (
        lambda t: {n: v.to(torch.bfloat16) for n, v in t.items()},
        {"dtype": "bfloat16"},
        True,
    ),
    "multimodal prefix": (_multimodal, None, False),
}


@pytest.mark.parametrize("variant", list(HEAD_VARIANTS))
def test_target_head_follows_the_model_on_tying_and_names(
    variant, demo_target_dir, demo_oracle, tmp_path, request
):
    edit, config, loadable = HEAD_VARIANTS[variant]
    target_dir = checkpoint_variant(demo_target_dir, tmp_path / "target", edit=edit, config=config)
    # transformers cannot load the renamed tensors into its Qwen3 class: they are the demo's
    oracle = model_head(target_dir) if loadable else demo_oracle
    request.getfixturevalue("no_model")
    tensors, meta = saved_head(target_dir, tmp_path / "head.safetensors")
    assert_head_is(tensors, meta, oracle)
    if variant in ("untied", "tied, both saved and different"):
        assert not oracle[
            "tied"
        ]  # transformers keeps different tensors apart, whatever config says


def _without(name):
    return lambda tensors: {n: t for n, t in tensors.items() if n != name}


def _with_mtp_norm(tensors):
    return tensors | {"mtp.model.norm.weight": tensors["model.norm.weight"].clone()}


def _fp8_embedding(tensors):
    return tensors | {
        "model.embed_tokens.weight": tensors["model.embed_tokens.weight"].to(torch.float8_e4m3fn)
    }


# (checkpoint edit, config.json changes, what the error says)
HEAD_ERRORS = {
    "missing norm": (
        _without("model.norm.weight"),
        None,
        (
            "no tensor for the target's norm.weight; looked for "
            "norm.weight: model.norm.weight or language_model.norm.weight"
        ),
    ),
    "untied without lm_head": (
        None,
        {"tie_word_embeddings": False},
        (
            "no tensor for the target's lm_head.weight (config.json: tie_word_embeddings is false); "
            "looked for lm_head.weight: lm_head.weight"
        ),
    ),
    "ambiguous": (
        _with_mtp_norm,
        None,
        (
            "several tensors could be the target's norm.weight: "
            "['model.norm.weight', 'mtp.model.norm.weight']"
        ),
    ),
    "quantized": (_fp8_embedding, None, "model.embed_tokens.weight is torch.float8_e4m3fn"),
}


@pytest.mark.parametrize("case", list(HEAD_ERRORS))
def test_head_errors_name_the_file_and_the_tensors(case, demo_target_dir, no_model, tmp_path):
    edit, config, expected = HEAD_ERRORS[case]
    target_dir = checkpoint_variant(demo_target_dir, tmp_path / "target", edit=edit, config=config)
    with pytest.raises(TargetHeadError, match=re.escape(expected)) as caught:
        saved_head(target_dir, tmp_path / "head.safetensors")
    assert str(target_dir / "model.safetensors") in str(caught.value)
    assert not (tmp_path / "head.safetensors").exists()


def test_head_errors_for_missing_files(demo_target_dir, no_model, tmp_path):
    target_dir = checkpoint_variant(demo_target_dir, tmp_path / "sharded", shards=2)
    (target_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(TargetHeadError, match=r"model-00002-of-00002\.safetensors: no such file"):
        saved_head(target_dir, tmp_path / "head.safetensors")
    for path in target_dir.glob("model*.safetensors*"):
        path.unlink()
    with pytest.raises(TargetHeadError, match="neither model.safetensors.index.json nor model"):
        saved_head(target_dir, tmp_path / "head.safetensors")
