"""The standard sets' conversations decoded turn by turn by the plain engine (decode.py, under
vLLM's interpreter): each prompt's first turn as the parent rendered it, each later turn rendered
here by the target's chat template (the engine's tokenizer is the target's) over the target's own
earlier answers, as a user's client would send them back. Every turn's prompt ids are recorded,
so the speculative engines decode exactly these contexts (stages/evaluate/sets.py).

A request's `sets`: name -> {"rows": [{"system", "turns", "first_prompt"}], "chat_template_kwargs",
"max_prompt_len"}. The answer: name -> {"prompts": [[ids of each turn] per row], "answers": [[ids]
per row], "wall_s"}.

Imports vLLM (through the engine's tokenizer) and the standard library only.
"""

from __future__ import annotations

import time

THINK_END = "</think>"


def answer_message(tokenizer, ids: list[int]) -> dict:
    """The assistant message of an earlier answer as a client sends it back: the text less its
    end-of-turn token(s), its reasoning (before `</think>`) apart from its content, as a server's
    reasoning parser returns them; templates drop or keep the reasoning of earlier turns."""
    special = set(tokenizer.all_special_ids)
    end = len(ids)
    while end and ids[end - 1] in special:
        end -= 1
    text = tokenizer.decode(ids[:end], skip_special_tokens=False)
    if THINK_END not in text:
        return {"role": "assistant", "content": text}
    reasoning, content = text.rsplit(THINK_END, 1)
    reasoning = reasoning.split("<think>", 1)[-1].strip("\n")
    return {"role": "assistant", "content": content.lstrip("\n"), "reasoning_content": reasoning}


def later_turn_prompt(tokenizer, row: dict, answers: list[list[int]], kwargs: dict) -> list[int]:
    """The prompt of turn len(answers) of `row`: its system prompt, every earlier user turn and
    the target's answer to it, then the user's next turn, rendered with the generation prompt."""
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for turn, answer in zip(row["turns"], answers, strict=False):
        messages += [{"role": "user", "content": turn}, answer_message(tokenizer, answer)]
    messages.append({"role": "user", "content": row["turns"][len(answers)]})
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_set(llm, spec: dict, sampling) -> dict:
    """One set, turn by turn: every row's turn t in one `generate`, then turn t + 1 of the rows
    that have one. A prompt longer than the engine was sized for is an error naming the row."""
    tokenizer = llm.get_tokenizer()
    rows = spec["rows"]
    prompts: list[list[list[int]]] = [[] for _ in rows]
    answers: list[list[list[int]]] = [[] for _ in rows]
    wall_s = 0.0
    turn = 0
    while active := [i for i, row in enumerate(rows) if turn < len(row["turns"])]:
        batch = []
        for i in active:
            ids = rows[i]["first_prompt"] if turn == 0 else None
            if ids is None:
                ids = later_turn_prompt(
                    tokenizer, rows[i], answers[i], spec["chat_template_kwargs"]
                )
            if len(ids) > spec["max_prompt_len"]:
                raise ValueError(
                    f"set row {rows[i]['id']!r}, turn {turn + 1}: its prompt of {len(ids)} tokens "
                    f"exceeds the {spec['max_prompt_len']} the engine was sized for"
                )
            prompts[i].append(ids)
            batch.append({"prompt_token_ids": ids})
        tick = time.perf_counter()
        outputs = llm.generate(batch, sampling, use_tqdm=False)
        wall_s += time.perf_counter() - tick
        for i, output in zip(active, outputs, strict=True):
            answers[i].append(list(output.outputs[0].token_ids))
        turn += 1
    return {"prompts": prompts, "answers": answers, "wall_s": round(wall_s, 4)}


def decode_sets(llm, sets: dict, sampling) -> dict:
    """Every set of a plain request, in turn."""
    return {name: decode_set(llm, spec, sampling) for name, spec in sets.items()}
