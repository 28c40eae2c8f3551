"""The evaluation of the drafter families that draft in one forward (P-EAGLE, DFlash) on small
random sizes: the live proposers draft what vLLM's one forward drafts (a hand-built forward over
the same context), the simulation drafts what the proposer would at every position, each family
is served at its own K with its own speculative_config, an export vLLM would read as another
drafter is refused, and a configuration the CPU build cannot serve is a reason, not a crash.
The real engine: tests/engine/test_drafter_families_in_vllm.py."""

from __future__ import annotations

import json
import stat
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.drafter_sizes import CONFIG

from eaglenest.common.config import settings_from_sections
from eaglenest.drafter.dflash.export import export_dflash
from eaglenest.drafter.dflash.model import DFlashConfig, DFlashDrafter
from eaglenest.drafter.export_files import ExportError
from eaglenest.drafter.layers import DecodeCache
from eaglenest.drafter.p_eagle.export import export_p_eagle
from eaglenest.drafter.p_eagle.model import PEagleDrafter
from eaglenest.settings.vllm import VllmEngine, VllmRuntime
from eaglenest.stages.evaluate import simulated
from eaglenest.stages.evaluate.families import load_family
from eaglenest.stages.evaluate.parallel_proposers import DFlashProposer, PEagleProposer
from eaglenest.stages.evaluate.simulated import block_predictions, untrained_like
from eaglenest.stages.evaluate.vllm_evaluate import evaluate_in_vllm
from eaglenest.vllm_engine import decode
from eaglenest.vllm_engine.cpu import CpuEngineError
from eaglenest.vllm_engine.process import EngineError

MASK = 49
DCONFIG = DFlashConfig.from_drafter(CONFIG, num_hidden_layers=2, block_size=4, mask_token_id=MASK)
# Even target ids are the draft ids (as tests/unit/drafter/p_eagle/test_p_eagle.py maps them).
D2T = torch.arange(0, 2 * CONFIG.draft_vocab_size, 2) - torch.arange(CONFIG.draft_vocab_size)
T2D = torch.zeros(CONFIG.vocab_size, dtype=torch.bool)
T2D[torch.arange(0, 2 * CONFIG.draft_vocab_size, 2)] = True


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Norms away from 1 and a random embedding, so a norm or a key in the wrong place shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        for p in model.parameters():
            if p.ndim == 1 and p is not getattr(model, "mask_hidden", None):
                p.uniform_(0.5, 1.5)
    model.set_vocab(D2T, T2D)
    return model.double().eval()


def p_eagle_model(layers: int = 1, train_mask_embedding: bool = False) -> PEagleDrafter:
    torch.manual_seed(0)
    return randomised(PEagleDrafter(CONFIG, MASK, layers, train_mask_embedding))


def dflash_model() -> DFlashDrafter:
    torch.manual_seed(0)
    return randomised(DFlashDrafter(DCONFIG))


def sample(length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    aux = torch.randn(length, 3 * CONFIG.target_hidden_size, dtype=torch.float64)
    return aux, torch.randint(0, CONFIG.vocab_size, (length,))


def vllm_parallel_draft(model: PEagleDrafter, aux, ids, t: int, k: int) -> list[int]:
    """What vLLM drafts once position t is verified (v1/spec_decode/utils.py, copy_and_expand_
    eagle_inputs_kernel): ONE causal forward over positions 0..t (token x_p+1, fc(aux_p)) and
    t+1..t+K-1 (the mask token, fc(mask_hidden)); drafts at t..t+K-1."""
    tokens = torch.cat([ids[1 : t + 2], torch.full((k - 1,), MASK)])[None]
    mask_state = model.project(model.mask_hidden)[None].expand(k - 1, -1)
    hidden = torch.cat([model.project(aux[: t + 1]), mask_state])[None]
    logits, _ = model.step(tokens, hidden, torch.arange(t + k)[None], DecodeCache())
    return model.draft_to_target(logits[0, t:].argmax(-1)).tolist()


@pytest.mark.parametrize(
    "layers, trained", [(1, False), (4, True)], ids=["one layer", "4 layers, mask embedding"]
)
def test_the_p_eagle_proposer_drafts_vllms_one_forward_each_round(layers, trained):
    model, (aux, ids) = p_eagle_model(layers, trained), sample()
    proposer = PEagleProposer(model)
    with torch.no_grad():
        proposer.start(ids[:4].tolist(), aux[:4], int(ids[4]))  # verified up to position 3
        assert proposer.propose(3) == vllm_parallel_draft(model, aux, ids, 3, 3)
        # A round that accepted one draft: positions 4 and 5 verified, the bonus is x_7.
        proposer.accept(ids[5:7].tolist(), aux[4:6])
        assert proposer.propose(3) == vllm_parallel_draft(model, aux, ids, 5, 3)
        proposer.accept(ids[7:8].tolist(), aux[6:7])  # nothing accepted: one position verified
        assert proposer.propose(2) == vllm_parallel_draft(model, aux, ids, 6, 2)
        # The simulation's chain at t is the same forward over the data.
        states = list(model.teacher_forced_states(aux[None], ids[None], 3))
        chain = [int(model.draft_to_target(model.lm_head(s[0, 5]).argmax())) for s in states]
    assert chain == vllm_parallel_draft(model, aux, ids, 5, 3)


def test_the_dflash_proposer_drafts_the_block_of_the_models_forward_at_its_anchor():
    model, (aux, ids) = dflash_model(), sample()
    proposer = DFlashProposer(model)

    def block_at(anchor: int) -> list[int]:
        logits = model(aux[None], ids[None], torch.tensor([[anchor]]))[0, 0]
        return model.draft_to_target(logits[1:].argmax(-1)).tolist()

    with torch.no_grad():
        proposer.start(ids[:5].tolist(), aux[:5], int(ids[5]))  # context 0..4, bonus x_5
        assert proposer.propose(3) == block_at(5)
        proposer.accept(ids[6:8].tolist(), aux[5:7])  # one accepted: context 0..6, bonus x_7
        assert proposer.propose(3) == block_at(7)
        proposer.accept(ids[8:9].tolist(), aux[7:8])
        assert proposer.propose(3) == block_at(8)
        # K below block_size - 1: vLLM's block [bonus, mask x K], the forward of a drafter of
        # block K + 1 with the same weights.
        shorter = DFlashDrafter(replace(DCONFIG, block_size=3)).double()
        shorter.load_state_dict(model.state_dict())
        logits = shorter(aux[None], ids[None], torch.tensor([[8]]))[0, 0]
        assert proposer.propose(2) == model.draft_to_target(logits[1:].argmax(-1)).tolist()
    with pytest.raises(ValueError, match="block_size 4 drafts 1..3 tokens a round, not 7"):
        proposer.propose(7)


def test_the_dflash_simulation_drafts_at_every_position_what_the_proposer_drafts_there(
    monkeypatch,
):
    """block_predictions at t (the block at anchor t + 1, its context <= t) equals the live
    proposer verified up to t with bonus x_t+1, also when the anchors go in several chunks."""
    model, (aux, ids) = dflash_model(), sample()
    monkeypatch.setattr(simulated, "BLOCK_ATTENTION_CELLS", 64)  # one anchor a forward
    start = torch.zeros(1, len(ids), dtype=torch.bool)
    start[0, 2:11] = True
    batch = SimpleNamespace(aux=aux[None], input_ids=ids[None])
    with torch.no_grad():
        for k in (3, 2):  # K = block_size - 1, and below it
            predicted = block_predictions(model, batch, start, k)
            for t in range(len(ids)):
                if not start[0, t]:
                    assert (predicted[0, t] == -3).all()
                    continue
                proposer = DFlashProposer(model)
                proposer.start(ids[: t + 1].tolist(), aux[: t + 1], int(ids[t + 1]))
                assert predicted[0, t].tolist() == proposer.propose(k), (k, t)
    with pytest.raises(ValueError, match=r"drafts K = 1..3, not 4"):
        block_predictions(model, batch, start, 4)


def test_the_untrained_baseline_is_a_fresh_drafter_of_the_same_family():
    for model in (p_eagle_model(), dflash_model()):
        fresh = untrained_like(model.float(), seed=3)
        assert type(fresh) is type(model) and fresh.config == model.config
        assert torch.equal(fresh.d2t, model.d2t)
        assert not torch.equal(fresh.fc.weight, model.fc.weight)
    assert untrained_like(p_eagle_model().float(), 3).mask_token_id == MASK


def exports(tmp_path: Path) -> dict[str, Path]:
    export_p_eagle(p_eagle_model().float(), tmp_path / "p_eagle", depths=3, dtype="float32")
    export_dflash(dflash_model().float(), tmp_path / "dflash", dtype="float32")
    return {"p_eagle": tmp_path / "p_eagle", "dflash": tmp_path / "dflash"}


def test_each_family_is_served_at_its_own_k_with_its_own_speculative_config(tmp_path):
    dirs, embed = exports(tmp_path), p_eagle_model().embed_tokens.weight.float()
    dflash = load_family("dflash", dirs["dflash"], embed, [2, 4, 5], (2, 7))
    assert (dflash.ks, dflash.configured_ks) == ((2,), (2, 7))  # up to block_size - 1
    assert load_family("dflash", dirs["dflash"], embed, None, (7,)).ks == (3,)
    assert isinstance(dflash.proposer(), DFlashProposer)
    assert dflash.speculative_config("d", 2) == {
        "method": "dflash",
        "model": "d",
        "num_speculative_tokens": 2,
    }
    with pytest.raises(ValueError, match="drafts 1..3"):
        dflash.speculative_config("d", 7)
    p_eagle = load_family("p_eagle", dirs["p_eagle"], embed, [2, 4, 5], (2, 3, 7))
    assert p_eagle.ks == (2, 3) and isinstance(p_eagle.proposer(), PEagleProposer)
    assert load_family("p_eagle", dirs["p_eagle"], embed, None, (7,)).ks == (3,)
    assert p_eagle.speculative_config("d", 2) == {
        "method": "eagle3",
        "model": "d",
        "num_speculative_tokens": 2,
        "parallel_drafting": True,
    }
    assert p_eagle.describe()["family"] == "p_eagle"
    with pytest.raises(ValueError, match="one of eagle3, p_eagle, dflash"):
        load_family("medusa", dirs["dflash"], embed, None, (3,))


def edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_an_export_vllm_would_read_as_another_drafter_is_refused_by_the_evaluation(tmp_path):
    dirs, embed = exports(tmp_path), p_eagle_model().embed_tokens.weight.float()
    # A DFlash config whose block vLLM would run causally; a P-EAGLE config where vLLM would
    # take another mask token (dflash_config's comes first).
    edit_config(dirs["dflash"], lambda c: c["dflash_config"].update(causal=True))
    with pytest.raises(ExportError, match="causal: vLLM reads"):
        load_family("dflash", dirs["dflash"], embed, None, (3,))
    edit_config(dirs["p_eagle"], lambda c: c.update(dflash_config={"mask_token_id": 3}))
    with pytest.raises(ExportError, match="vLLM would draft with mask token 3"):
        load_family("p_eagle", dirs["p_eagle"], embed, None, (3,))
    # Another family's export under the wrong family name.
    with pytest.raises(ExportError):
        load_family("p_eagle", dirs["dflash"], embed, None, (3,))
    with pytest.raises(ExportError):
        load_family("dflash", dirs["p_eagle"], embed, None, (3,))


# Stands for vLLM's interpreter running vllm_engine/decode.py: plain decoding answered, every
# speculative configuration refused as the CPU build refuses one beside an MLA target; it
# writes what it was asked beside the requests.
REFUSING_ENGINE = """#!/bin/sh
exec {python} -c '
import json, sys
requests = json.load(open(sys.argv[-1]))
json.dump(requests, open("{asked}", "w"))
for request in requests:
    if request["k"] is None:
        print("EAGLENEST " + json.dumps({{"done": True, "k": None, "tokens": [[1, 2]],
            "wall_s": 0.1, "spec": {{}}, "groups": {{}}}}))
    else:
        print("EAGLENEST " + json.dumps({{"done": True, "k": request["k"],
            "refused": "an MLA target ... is served only beside an MLA drafter"}}))
' "$@"
"""


def test_a_configuration_the_cpu_build_cannot_serve_is_a_reason_in_the_metrics(tmp_path):
    script = tmp_path / "python"
    asked = tmp_path / "asked.json"
    script.write_text(REFUSING_ENGINE.format(python=sys.executable, asked=asked))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    arguments = {
        "prompts": [[1] * 10],
        "drafter_dir": tmp_path / "drafter",
        "target_path": "target",
        "ks": (3,),
        "max_new_tokens": 8,
        "model_dtype": "float32",
        "engine": settings_from_sections(VllmEngine),
        "runtime": settings_from_sections(VllmRuntime, vllm={"python": str(script)}),
    }

    def config_of(path: str, k: int) -> dict:
        return {"method": "dflash", "model": path, "num_speculative_tokens": k}

    engine = evaluate_in_vllm(**arguments, speculative_config=config_of, refusal_is_a_reason=True)
    assert engine["per_k"] == {} and "MLA drafter" in engine["not_served"]["3"]
    plain, k3 = json.loads(asked.read_text())
    assert "speculative_config" not in plain
    drafter = str((tmp_path / "drafter").resolve())
    assert k3["speculative_config"] == config_of(drafter, 3)
    with pytest.raises(EngineError, match=r"vLLM \(K=3\): an MLA target"):
        evaluate_in_vllm(**arguments, speculative_config=config_of)


def test_the_engine_process_answers_a_refused_configuration_and_goes_on(monkeypatch):
    def refuse(request):
        raise CpuEngineError("served only beside an MLA drafter")

    monkeypatch.setattr(decode, "decode_engine", refuse)
    answer = decode.decode_request({"k": 3})
    assert answer == {"done": True, "k": 3, "refused": "served only beside an MLA drafter"}
