"""Every drafter family of train.families trains through the one loop (stages/train/families.py)
from the same hidden-state shards: its held-out loss falls, a run stopped at a checkpoint and
resumed ends with the weights of a run that was never stopped, and its export is read back by
its family's loader (load_drafter, load_p_eagle, load_dflash) to the weights it trained.

The shards are support/synthetic_run.py's, made learnable: each sample's tokens follow a fixed
map of the draft vocabulary (x_t+1 = g(x_t)) and the target predicts exactly that (its final
hidden state at t, and its aux states, hold the LM head row of g(x_t)), as the data's tokens are
a target's greedy answer. So every slot of every family has something to learn from the tokens it is given."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.synthetic_run import write_synthetic_run

from eaglenest.common.config import validate_config
from eaglenest.formats.target_head import TargetHead
from eaglenest.settings.families import FAMILIES
from eaglenest.settings.train import FamilySettings, TrainSettings

SIZE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_hidden_layers": 6,
    "vocab_size": 256,
    "draft_vocab_size": 64,
    "lengths": (24, 48),
}
TRAIN = {
    "max_steps": 24,
    "max_batch_tokens": 256,
    "ttt_steps": 3,
    "lr": 1e-2,
    "warmup_steps": 2,
    "eval_every": 4,
    "checkpoint_every": 4,
    "log_every": 1,
    "export_dtype": "float32",
    "device": "cpu",
    "p_eagle": {"depths": 3, "num_hidden_layers": 2},  # layers and the mask embedding resumed
    "dflash": {"block_size": 4, "max_anchors": 24},
    "mask_token_id": SIZE["vocab_size"] - 1,  # the synthetic target has no tokenizer
}


def make_learnable(run: Path) -> None:
    """Rewrite the run's shards: tokens x_t+1 = g(x_t) over the draft vocabulary, from a random
    start per sample, and the target's final hidden state at t the LM head row of g(x_t)."""
    vocab = load_file(run / "vocab.safetensors")
    draft = torch.nonzero(vocab["t2d"])[:, 0]
    following = draft[(5 * torch.arange(len(draft)) + 3) % len(draft)]  # g, a permutation
    g = torch.zeros(SIZE["vocab_size"], dtype=torch.long)
    g[draft] = following
    lm_head = load_file(run / "head.safetensors")["lm_head.weight"]
    generator = torch.Generator().manual_seed(0)
    for path in sorted(run.glob("0*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        offsets = tensors["offsets"].tolist()
        ids = tensors["input_ids"].clone()
        for begin, end in itertools.pairwise(offsets):
            ids[begin] = draft[torch.randint(len(draft), (1,), generator=generator)]
            for t in range(begin, end - 1):
                ids[t + 1] = g[ids[t]]
        tensors["input_ids"] = ids
        tensors["final_hidden"] = (60 * lm_head[g[ids]]).to(torch.bfloat16)
        # The target's layers at t carry its next token too (random features alone would be
        # memorised, not learnt from).
        aux = tensors["aux"].float() * 0.1 + 30 * lm_head[g[ids]].repeat(1, 3)
        tensors["aux"] = aux.to(torch.bfloat16)
        save_file(tensors, str(path), metadata=metadata)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("families")
    files = write_synthetic_run(root, SIZE, samples=64, shards=2)
    make_learnable(root)
    files["eval_shards"] = files["train_shards"][1:]
    files["train_shards"] = files["train_shards"][:1]
    return files


def settings_of(run: dict, family: str, **train) -> tuple[TrainSettings, FamilySettings]:
    config = validate_config(
        {"train": copy.deepcopy({**TRAIN, **train}), "target": {"path": run["target_path"]}}
    )
    return TrainSettings.from_config(config), FamilySettings.of(config, family)


def train(run: dict, family: str, out: Path, stop_after_step: int | None = None) -> dict:
    from eaglenest.stages.train.train import train_drafter

    settings, own = settings_of(run, family)
    arguments = {k: v for k, v in run.items() if k != "target_path"}
    return train_drafter(
        **arguments,
        out_dir=out / "drafter",
        journal_dir=out / "journal",
        settings=settings,
        family=own,
        stop_after_step=stop_after_step,
    )


def heldout_losses(out: Path) -> list[float]:
    lines = (out / "drafter" / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "heldout"]


def exported_record(out: Path) -> dict:
    return json.loads((out / "drafter" / "config.json").read_text())["eaglenest"]


def longest_sample(shard: Path) -> int:
    with safe_open(str(shard), framework="pt") as f:
        return int(f.get_tensor("offsets").diff().max())


def load_export(
    family: str, drafter_dir: Path, embed: torch.Tensor, lm_head: torch.Tensor
) -> torch.nn.Module:
    if family == "eagle3":
        from eaglenest.drafter.eagle3.export import load_drafter

        return load_drafter(drafter_dir, embed)
    if family == "p_eagle":
        from eaglenest.drafter.p_eagle.export import load_p_eagle

        model, depths = load_p_eagle(drafter_dir, embed)
        assert depths == TRAIN["p_eagle"]["depths"]
        return model
    from eaglenest.drafter.dflash.export import load_dflash

    return load_dflash(drafter_dir, embed, lm_head=lm_head)  # train.dflash.head target


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_trains_resumes_exactly_and_exports_what_it_trained(
    run: dict, tmp_path: Path, family: str
):
    whole = tmp_path / "whole"
    report = train(run, family, whole)
    assert report["family"] == family and report["steps"] == TRAIN["max_steps"]
    losses = heldout_losses(whole)
    # DFlash learns through the target's LM head, frozen over all 256 ids (train.dflash.head
    # target): in 24 steps its loss falls less than a trained head's (3.76 -> 3.47 measured).
    falls_to = 0.95 if family == "dflash" else 0.8
    assert len(losses) >= 3 and losses[-1] < falls_to * losses[0], losses
    assert report["heldout_acc"][0] > 0.3, report["heldout_acc"]

    stopped = tmp_path / "stopped"
    assert train(run, family, stopped, stop_after_step=10) == {"stopped_at_step": 10}
    train(run, family, stopped)  # resumes from the checkpoint of step 8
    first, again = (load_file(out / "drafter" / "model.safetensors") for out in (whole, stopped))
    assert first.keys() == again.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
    assert heldout_losses(stopped) == losses

    # What it was trained with, recorded in the export: every sample of the trained shard was
    # (24 steps are epochs of it), its longest the positions; the resumed run counts the same.
    record = exported_record(whole)
    assert record == exported_record(stopped)
    assert record["trained_positions"] == longest_sample(run["train_shards"][0])
    assert record["served_length"] == 32768  # the target's (Qwen3Config's default)

    # The journal's last state is the trained model; the export reads back to it, exactly.
    trained = torch.load(whole / "journal" / "state.pt", weights_only=True)["model"]
    head = TargetHead.load(run["target_head"])
    model = load_export(family, whole / "drafter", head.embed, head.lm_head)
    loaded = model.state_dict()
    # The target's, never trained nor exported: the embedding, and DFlash's LM head.
    from_target = {"embed_tokens.weight"} | ({"lm_head.weight"} if family == "dflash" else set())
    assert set(trained) == set(loaded) - from_target
    if "mask_embedding_delta" in trained:  # P-EAGLE's: in the exported table's mask row
        embed = head.embed
        row = embed[model.mask_token_id] + trained.pop("mask_embedding_delta")
        assert torch.equal(model.mask_embedding(), row) and row.ne(embed[model.mask_token_id]).any()
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name


def test_the_default_mask_token_is_past_the_tokenizer_else_its_pad_token(monkeypatch):
    import eaglenest.target_model.tokenizer as tokenizer_module
    from eaglenest.stages.train.families import mask_token_id

    class Tokenizer:
        def __init__(self, size: int, pad: int | None, eos: int):
            self.size, self.pad_token_id, self.eos_token_id = size, pad, eos

        def __len__(self) -> int:
            return self.size

    config = validate_config({"train": {"families": ["eagle3", "dflash"]}})
    family = FamilySettings.of(config, "dflash")
    for tokenizer, expected in [
        (Tokenizer(151669, 151643, 151645), 151669),  # Qwen3: an embedding row no text reaches
        (Tokenizer(151936, 151643, 151645), 151643),  # a full embedding: the pad token
    ]:
        monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda target, t=tokenizer: t)
        assert mask_token_id(family, 151936) == expected
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda target: Tokenizer(512, 509, 509))
    with pytest.raises(ValueError, match="train.mask_token_id"):
        mask_token_id(family, 512)
    given = FamilySettings.of(validate_config({"train": {"mask_token_id": 7}}), "p_eagle")
    assert mask_token_id(given, 512) == 7


def test_train_families_is_checked_with_the_key_named():
    from eaglenest.common.config import ConfigError

    for families, words in [
        (["eagle3", "eagle3"], "non-unique"),
        (["medusa"], "is not one of"),
        ([], "should be non-empty"),
    ]:
        with pytest.raises(ConfigError, match="train.families") as error:
            validate_config({"train": {"families": families}})
        assert words in str(error.value)
    # What vLLM 0.32 could not serve as trained: refused before any job runs.
    for train, keys in [
        ({"families": ["dflash"], "drafter": {"sliding_window": 64}}, "sliding_window"),
        ({"families": ["p_eagle"], "ttt_inputs": "drafter"}, "train.ttt_inputs"),
    ]:
        with pytest.raises(ConfigError, match=keys):
            validate_config({"train": train})
    # train.drafter.attention is EAGLE-3's: DFlash and P-EAGLE beside an MLA EAGLE-3 train.
    validate_config({"train": {"families": list(FAMILIES), "drafter": {"attention": "mla"}}})


def test_job_settings_of_eagle3_are_the_train_settings_alone():
    from eaglenest.settings.train import train_job_settings, train_job_settings_json

    config = validate_config({"train": {"families": ["eagle3", "p_eagle", "dflash"]}})
    train = TrainSettings.from_config(config).to_json()
    assert train_job_settings_json(train, config, "eagle3") == train
    for family in FAMILIES:
        settings, own = train_job_settings(train_job_settings_json(train, config, family))
        whole = TrainSettings.from_config(config)
        assert settings == whole.of_family(family, own.own_settings())
        assert own.name == family
    _, p_eagle = train_job_settings(train_job_settings_json(train, config, "p_eagle"))
    assert p_eagle.p_eagle.depths == 4  # speculators' P-EAGLE, not ttt_steps
    nulled = validate_config({"train": {"families": ["p_eagle"], "p_eagle": {"depths": None}}})
    assert FamilySettings.of(nulled, "p_eagle").p_eagle.depths == nulled["train"]["ttt_steps"]
