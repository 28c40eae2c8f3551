"""The standard sets (`evaluate.sets`) decoded by the evaluate stage in vLLM, by the engines that
decode the held-out prompts (vllm_evaluate.py): each set's prompts rendered by the target's chat
template with target.chat_template_kwargs, as generation renders its prompts; the plain engine
(greedy, first) answers every conversation turn by turn, each later turn rendered after the
target's own earlier answers (vllm_engine/conversations.py), and records every turn's prompt
ids; each K's engine then decodes those recorded prompts, one group per category, so every
configuration, a compared drafter's included, sees the same contexts.

Figures per set and per category, per K (metrics.json `sets`): vLLM's acceptance length (1 +
accepted / drafts), emitted tokens per round, per-position acceptance, and whether the answers
equal the plain ones; each names its set, its category and its temperature (0.0: greedy).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglenest.formats.eval_sets import read_eval_set
from eaglenest.formats.metrics import emitted_per_round
from eaglenest.settings.eval_sets import SetDecodeSettings
from eaglenest.target_model.set_turns import rendered_turns
from eaglenest.target_model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

GREEDY = 0.0
# Why the sets have no figures from the project's own live loop (metrics.json says it).
NO_LIVE = (
    "the sets are decoded in the serving engine only: their later turns follow the target's own "
    "answers, which the plain engine writes; the live loop measures the held-out prompts"
)


@dataclass(frozen=True)
class EvalSetPrompts:
    """One set ready to decode: its rows (id, category, system, turns, first_prompt: the first
    turn's prompt ids as the template renders it) and the longest prompt any of its turns can
    reach (`longest_prompt`, for the engine's max_model_len)."""

    name: str
    rows: list[dict[str, Any]]
    longest_prompt: int

    def describe(self) -> dict[str, Any]:
        categories: dict[str, int] = defaultdict(int)
        for row in self.rows:
            categories[row["category"]] += 1
        return {
            "set": self.name,
            "prompts": len(self.rows),
            "turns": sum(len(row["turns"]) for row in self.rows),
            "multi_turn_prompts": sum(len(row["turns"]) > 1 for row in self.rows),
            "categories": dict(sorted(categories.items())),
            "live": NO_LIVE,
        }


def load_sets(
    paths: Iterable[str | Path], settings: SetDecodeSettings, max_new_tokens: int
) -> list[EvalSetPrompts]:
    """The prepared sets (eval_sets/{set}.parquet, in evaluate.sets' order), their first turns
    rendered by the target's chat template."""
    tokenizer = load_tokenizer(settings.target)
    kwargs = dict(settings.target.chat_template_kwargs)
    by_name = {}
    for path in paths:
        rows = read_eval_set(str(path)).to_dicts()
        longest = 0
        for row, (first, row_longest) in zip(
            rows, rendered_turns(tokenizer, rows, kwargs, max_new_tokens), strict=True
        ):
            row["first_prompt"] = first
            longest = max(longest, row_longest)
        name = rows[0]["set"]
        by_name[name] = EvalSetPrompts(name, rows, longest)
        log.info("set %s: %d prompts, prompts up to %d tokens", name, len(rows), longest)
    missing = [name for name in settings.names if name not in by_name]
    if missing:
        raise ValueError(f"evaluate.sets {missing}: no prepared file among {list(paths)}")
    return [by_name[name] for name in settings.names]


@dataclass(frozen=True)
class EngineSets:
    """The sets as the vLLM evaluation decodes them (evaluate_in_vllm's `sets`)."""

    sets: list[EvalSetPrompts]
    chat_template_kwargs: dict[str, Any]

    def sized(self, request: dict[str, Any], max_model_len: int | None) -> dict[str, Any]:
        """`request` with room for every set's longest turn, unless the user fixed
        vllm.max_model_len (`max_model_len`)."""
        longest = max(s.longest_prompt for s in self.sets) + request["max_new_tokens"]
        return {**request, "max_model_len": max_model_len or max(request["max_model_len"], longest)}

    def plain_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """The plain engine's request (`sized` already): it also answers every set turn by turn."""
        sets = {
            s.name: {
                "rows": [
                    {key: row[key] for key in ("id", "system", "turns", "first_prompt")}
                    for row in s.rows
                ],
                "chat_template_kwargs": self.chat_template_kwargs,
                "max_prompt_len": request["max_model_len"] - request["max_new_tokens"],
            }
            for s in self.sets
        }
        return {**request, "k": None, "sets": sets}

    def groups(self, plain: dict[str, Any]) -> dict[str, list[list[int]]]:
        """The recorded prompts of every set, one group per (set, category), for the K engines."""
        return {key: [p for p, _ in turns] for key, turns in self._turns(plain).items()}

    def _turns(self, plain: dict[str, Any]) -> dict[str, list[tuple[list[int], list[int]]]]:
        """Group name -> (prompt, plain answer) of each turn of the set's rows in the category."""
        decoded = plain.get("sets") or {}
        grouped: dict[str, list[tuple[list[int], list[int]]]] = {}
        for each in self.sets:
            if each.name not in decoded:
                raise ValueError(f"set {each.name}: the plain decoding holds no such set")
            record = decoded[each.name]
            for row, prompts, answers in zip(
                each.rows, record["prompts"], record["answers"], strict=True
            ):
                key = group_name(each.name, row["category"])
                grouped.setdefault(key, []).extend(zip(prompts, answers, strict=True))
        return grouped

    def figures(
        self, answers: dict[int, dict[str, Any]], plain: dict[str, Any], acceptance
    ) -> dict[str, Any]:
        """metrics.json `sets`: per set, its figures per K and per category per K, from each K's
        answer (`answers`: K -> the engine's answer, its groups by group_name) and
        `acceptance(answer, plain, k)` (vllm_evaluate.py's); greedy under `engine`, and where
        the engines also sampled (evaluate's sampled temperature), the sampled answers' under
        `sampled` (temperature -> the same tables), on the same recorded contexts."""
        turns = self._turns(plain)
        out = {}
        for each in self.sets:
            wall_s = plain["sets"][each.name]["wall_s"]
            keys = [group_name(each.name, c) for c in each.describe()["categories"]]
            references = {
                key: {"tokens": [a for _, a in turns[key]], "wall_s": wall_s} for key in keys
            }
            greedy = {k: {key: a["groups"][key] for key in keys} for k, a in answers.items()}
            sampled: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
            for k, groups in greedy.items():
                for key, group in groups.items():
                    for temperature, answer in (group.get("sampled") or {}).items():
                        sampled[temperature].setdefault(k, {})[key] = answer
            out[each.name] = {
                **each.describe(),
                "temperature": GREEDY,
                "plain_wall_s": wall_s,
                "engine": _set_tables(each.name, greedy, references, acceptance, GREEDY),
            }
            if sampled:
                out[each.name]["sampled"] = {
                    temperature: _set_tables(each.name, by_k, None, acceptance, float(temperature))
                    for temperature, by_k in sampled.items()
                }
        return out


def _set_tables(
    set_name: str,
    answers: dict[int, dict[str, dict[str, Any]]],
    references: dict[str, dict[str, Any]] | None,
    acceptance,
    temperature: float,
) -> dict[str, Any]:
    """One set's figures at one temperature: {"per_k": K -> the whole set's, "by_category":
    category -> K -> figures}. `answers`: K -> group name -> that K's answer; `references`: group
    name -> the plain turns' answers (greedy), or None for sampled answers, which equal no plain
    one (each is its own reference: identical_to_plain None)."""
    by_category: dict[str, dict[str, Any]] = {}
    per_k: dict[str, Any] = {}
    for k, groups in answers.items():
        merged, merged_plain = [], []
        for key, answer in groups.items():
            category = key.split("/", 2)[2]
            reference = references[key] if references else answer
            figures = acceptance(answer, reference, k)
            if references is None:
                figures["identical_to_plain"] = None
            by_category.setdefault(category, {})[str(k)] = tagged(
                figures, set_name, category, temperature
            )
            merged.append(answer)
            merged_plain.append(reference)
        wall_s = references and next(iter(references.values()))["wall_s"]
        whole = acceptance(merge(merged), merge(merged_plain, wall_s or None), k)
        if references is None:
            whole["identical_to_plain"] = None
        per_k[str(k)] = tagged(whole, set_name, None, temperature)
    return {"per_k": per_k, "by_category": by_category}


def group_name(set_name: str, category: str) -> str:
    """The engine group of a set's category (set names take no '/': config/schema.yaml)."""
    return f"set/{set_name}/{category}"


def merge(answers: list[dict[str, Any]], wall_s: float | None = None) -> dict[str, Any]:
    """Several groups' answers as one: tokens in order, counters and wall times summed."""
    spec: dict[str, Any] = {}
    for answer in answers:
        for name, value in (answer.get("spec") or {}).items():
            if isinstance(value, list):
                previous = spec.get(name, [0] * len(value))
                spec[name] = [a + b for a, b in zip(previous, value, strict=True)]
            else:
                spec[name] = spec.get(name, 0) + value
    rounds = [r for a in answers for r in (a.get("rounds_per_prompt") or [])]
    return {
        "tokens": [t for a in answers for t in a["tokens"]],
        "wall_s": wall_s if wall_s is not None else summed([a["wall_s"] for a in answers]),
        "spec": spec,
        "rounds_per_prompt": rounds or None,
    }


def summed(times: list[float | None]) -> float | None:
    """The sum of wall times, None when one is unknown (a plain decoding timed apart)."""
    known = [t for t in times if t is not None]
    return sum(known) if len(known) == len(times) else None


def tagged(
    figures: dict[str, Any], set_name: str, category: str | None, temperature: float = GREEDY
) -> dict[str, Any]:
    """A figure of a set as metrics.json keeps it: its set, category (None: the whole set) and
    temperature named, emitted tokens per round beside the acceptance length, and no speed-up
    (the plain engine decodes a set turn by turn, the K engines category by category)."""
    kept = {k: v for k, v in figures.items() if k not in ("speedup", "plain_wall_s")}
    emitted = emitted_per_round(kept["tokens"], kept["prompts"], kept["rounds"])
    return {
        "set": set_name,
        "category": category,
        "temperature": temperature,
        **kept,
        "emitted_per_round": emitted,
    }


def engine_sets(
    paths: Iterable[str | Path], settings: SetDecodeSettings | None, max_new_tokens: int
) -> EngineSets | None:
    """The prepared sets as the vLLM evaluation decodes them; None when the run has none."""
    if settings is None or not settings.names:
        return None
    sets = load_sets(list(paths), settings, max_new_tokens)
    return EngineSets(sets, dict(settings.target.chat_template_kwargs))
