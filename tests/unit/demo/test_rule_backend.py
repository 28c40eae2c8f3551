"""`eaglenest serve --rule` (`server.backend: rule`): the cite target's answers written by its
rule, held to what the same target's model server decodes greedily, on real servers on
127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from eaglenest.common.config import settings_from_sections
from eaglenest.common.io import read_json
from eaglenest.demo.cite_tasks import CITE_RULE_FILE, CiteShape, answer_text, cite_examples
from eaglenest.demo.server_process import embedded_server, running_server
from eaglenest.demo.target import build_demo_target
from eaglenest.settings.demo_target import DemoTargetSettings

SHAPE = CiteShape(states=160, words=64, walk=(64, 150), book=(16, 32))
MODEL_NAME = "cite-target"
EXAMPLES = cite_examples(SHAPE, target_seed=0, seed=0, n=2)
DEFAULT_MAX_TOKENS = 1024  # the target's generation_config: above every answer of the shape


@pytest.fixture(scope="module")
def cite_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    settings = settings_from_sections(
        DemoTargetSettings,
        demo_target={
            "tasks": "cite",
            "cite": {"states": 160, "words": 64, "walk": [64, 150], "book": [16, 32]},
            "seed": 3,
            "vocab_size": 300,
            "max_position_embeddings": 2048,
            "heldout_prompts": 2,
            "heldout_max_new_tokens": DEFAULT_MAX_TOKENS,
        },
    )
    out = tmp_path_factory.mktemp("cite") / "target"
    build_demo_target(out, settings, threads=1)
    return out


@pytest.fixture(scope="module")
def servers(cite_target_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The rule server (through embedded_server, as pipeline jobs start it) and the model server
    of the same target, started in parallel."""
    logs = tmp_path_factory.mktemp("rule-logs")
    config = {
        "target": {"path": str(cite_target_dir), "model": MODEL_NAME},
        "server": {"dialect": "vllm", "backend": "rule"},
    }
    managers = {
        "rule": embedded_server(config, log_path=logs / "rule.log"),
        "model": running_server(
            cite_target_dir, model_name=MODEL_NAME, log_path=logs / "model.log", threads=1
        ),
    }
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(managers)) as pool:
        started = {name: pool.submit(m.__enter__) for name, m in managers.items()}
        urls = {}
        for name, future in started.items():
            urls[name] = future.result()
            stack.push(managers[name].__exit__)
        yield urls


def chat(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def ask(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "return_token_ids": True, **fields}


def answered(url: str, body: dict) -> dict:
    response = chat(url, body)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_build_saves_the_rule_beside_the_weights(cite_target_dir: Path):
    rule = read_json(cite_target_dir / CITE_RULE_FILE)
    assert rule["shape"] == {"states": 160, "words": 64, "walk": [64, 150], "book": [16, 32]}
    assert rule["seed"] == 3


def test_the_rule_serves_the_model_servers_greedy_answers_token_for_token(servers, cite_target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cite_target_dir)
    bodies = [ask(e.prompt, temperature=0) for e in EXAMPLES]
    with ThreadPoolExecutor(len(bodies)) as pool:  # the model server decodes both in one batch
        from_model = list(pool.map(lambda body: answered(servers["model"], body), bodies))
    from_rule = [answered(servers["rule"], body) for body in bodies]
    for example, model, rule in zip(EXAMPLES, from_model, from_rule, strict=True):
        assert rule["prompt_token_ids"] == model["prompt_token_ids"]
        assert rule["choices"][0]["token_ids"] == model["choices"][0]["token_ids"]
        assert rule["choices"][0]["message"] == model["choices"][0]["message"]
        assert rule["choices"][0]["finish_reason"] == model["choices"][0]["finish_reason"] == "stop"
        assert rule["usage"] == model["usage"]
        message = rule["choices"][0]["message"]
        # The vLLM dialect's fields: the reasoning between the think tags, the key after them.
        assert message["reasoning"] == example.reasoning
        assert message["content"] == "\n\n" + example.answer
        ids = rule["prompt_token_ids"] + rule["choices"][0]["token_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=False).endswith(answer_text(example))
    assert len(from_rule[0]["choices"][0]["token_ids"]) > SHAPE.answer_tokens(SHAPE.walk[0]) - 8
    stats = httpx.get(f"{servers['rule']}/stats").json()["backend"]
    assert stats["backend"] == "rule" and stats["completions"] >= 2


def test_max_tokens_cuts_the_answer_where_the_model_cuts_it(servers):
    body = ask(EXAMPLES[0].prompt, temperature=0, max_tokens=25)
    model, rule = (answered(servers[name], body) for name in ("model", "rule"))
    assert rule["choices"][0]["finish_reason"] == "length"
    assert len(rule["choices"][0]["token_ids"]) == 25
    assert rule["choices"][0] == model["choices"][0] and rule["usage"] == model["usage"]
    # Room for the whole answer, its stop token last: a stop, as the model server ends it.
    greedy = ask(EXAMPLES[0].prompt, temperature=0)
    whole = answered(servers["rule"], greedy)["usage"]["completion_tokens"]
    exact = answered(servers["rule"], {**greedy, "max_tokens": whole})
    assert exact["choices"][0]["finish_reason"] == "stop"
    short = answered(servers["rule"], {**greedy, "max_tokens": whole - 1})
    assert short["choices"][0]["finish_reason"] == "length"


def test_a_streamed_answer_assembles_to_the_whole_one(servers):
    url = servers["rule"]
    whole = answered(url, ask(EXAMPLES[1].prompt, temperature=0))
    reasoning, content, ids = "", "", []
    body = ask(EXAMPLES[1].prompt, temperature=0, stream=True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            reasoning += choice["delta"].get("reasoning") or ""
            content += choice["delta"].get("content") or ""
            ids += choice.get("token_ids") or []
    message = whole["choices"][0]["message"]
    assert (reasoning, content) == (message["reasoning"], message["content"])
    assert ids == whole["choices"][0]["token_ids"]


def test_what_the_rule_cannot_answer_is_refused_naming_why(servers):
    url = servers["rule"]
    prompt = EXAMPLES[0].prompt
    cases = [
        (ask("What is 2 + 2?"), "messages", "the chain's key"),
        (ask(prompt.replace("from s", "from t")), "messages", "the start state"),
        (ask(prompt.replace("<book>w", "<book>x")), "messages", "the book"),
        (ask(prompt.replace("K0", "K9")), "messages", "none of the 8 keys"),
        # Another prompt around the cite prompt: the answer the build proves is not for it.
        (
            {"messages": [{"role": "system", "content": "Be brief."}, *ask(prompt)["messages"]]},
            "messages",
            "renders another prompt",
        ),
        (ask(prompt, chat_template_kwargs={"enable_thinking": False}), "messages", "thinking on"),
        (ask(prompt, temperature=1.5, top_p=0.5), "temperature", "temperature 1.5"),
        # Margins of 10 logits leave sampling at top_p 1 off the rule in long answers.
        (ask(prompt, temperature=0.6, top_p=1.0), "top_p", "top_p <= 0.99"),
        (ask(prompt), "top_p", "top_p 1 "),  # the target's defaults: temperature and top_p 1
    ]
    for body, param, says in cases:
        response = chat(url, body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"], error
    # The nucleus of top_p 0.95 holds the rule's token alone: sampling is greedy decoding.
    sampled = answered(url, ask(prompt, temperature=1.0, top_p=0.95, seed=7))
    assert sampled["choices"][0] == answered(url, ask(prompt, temperature=0))["choices"][0]


def test_a_target_without_its_rule_fails_at_the_start_naming_the_key(cite_target_dir, tmp_path):
    plain = tmp_path / "target"
    shutil.copytree(cite_target_dir, plain, ignore=shutil.ignore_patterns(CITE_RULE_FILE))
    config = {"target": {"path": str(plain), "model": MODEL_NAME}, "server": {"backend": "rule"}}
    with (
        pytest.raises(RuntimeError, match="exited with code") as failure,
        embedded_server(config, log_path=tmp_path / "server.log"),
    ):
        pass
    assert "server.backend" in str(failure.value) and CITE_RULE_FILE in str(failure.value)


def test_the_rule_file_holds_how_sure_the_target_is_and_answers_bear_it_out(cite_target_dir):
    """What the backend's top_p bound rests on: at temperature 1 the right token's probability,
    over answers that are not the build's check answers, stays above the bound it serves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglenest.demo.cite_build import answer_ids

    recorded = read_json(cite_target_dir / CITE_RULE_FILE)["min_right_probability"]
    model = AutoModelForCausalLM.from_pretrained(cite_target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(cite_target_dir)
    for example in EXAMPLES:
        ids, prompt_len = answer_ids(tokenizer, example)
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, prompt_len - 1 : -1].double()
        right = torch.tensor(ids[prompt_len:])[:, None]
        sure = float(logits.log_softmax(-1).gather(1, right).exp().min())
        assert 0.99 < sure < 1 and abs(sure - recorded) < 1e-4
