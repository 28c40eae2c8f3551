"""Small files of each standard evaluation set's format, written by the tests: the demo's own
questions as MT-Bench JSONL (two of them with a second turn), a GSM8K-style parquet, a
SPEED-Bench-style parquet (optionally with a placeholder row), HumanEval JSONL and plain JSONL
with each of prompt, messages and turns."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eaglenest.demo.tasks import heldout_examples

# SPEED-Bench's text in rows whose prompts it does not redistribute.
SPEED_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_demo_mt_bench(path: Path, n: int = 6) -> Path:
    """The demo's held-out questions as MT-Bench's question.jsonl: its task family the category,
    every third one with a follow-up turn."""
    rows = []
    for number, example in enumerate(heldout_examples(0, n), start=81):
        turns = [example.prompt] + (["Check your answer once more."] if number % 3 == 0 else [])
        rows.append({"question_id": number, "category": example.family, "turns": turns})
    return write_jsonl(path, rows)


def write_gsm8k_parquet(path: Path) -> Path:
    table = pa.table(
        {
            "question": ["Tom has 3 apples and buys 4 more. How many?", "What is 12 * 11?"],
            "answer": ["3 + 4 = 7\n#### 7", "12 * 11 = 132\n#### 132"],
        }
    )
    pq.write_table(table, path)
    return path


def write_speed_bench_parquet(path: Path, placeholder_row: int | None = None) -> Path:
    """SPEED-Bench's qualitative layout; `placeholder_row` holds its placeholder in turns."""
    turns = [["Write a haiku about rain."], ["Summarise: the cat sat.", "Now in French."], ["2+2?"]]
    if placeholder_row is not None:
        turns[placeholder_row] = [SPEED_PLACEHOLDER]
    table = pa.table(
        {
            "question_id": ["q-a", "q-b", "q-c"],
            "category": ["writing", "summarization", "math"],
            "sub_category": ["poetry", "news", "arithmetic"],
            "turns": turns,
            "source": ["x", "y", "z"],
            "src_id": ["1", "2", "3"],
            "difficulty": ["easy", "medium", "easy"],
            "multiturn": [False, True, False],
        }
    )
    pq.write_table(table, path)
    return path


def write_humaneval_jsonl(path: Path) -> Path:
    return write_jsonl(
        path,
        [
            {
                "task_id": "HumanEval/0",
                "prompt": 'def add(a, b):\n    """Return a + b."""\n',
                "canonical_solution": "    return a + b\n",
                "test": "assert add(1, 2) == 3",
                "entry_point": "add",
            },
            {
                "task_id": "HumanEval/1",
                "prompt": 'def neg(a):\n    """Return -a."""\n',
                "canonical_solution": "    return -a\n",
                "test": "assert neg(1) == -1",
                "entry_point": "neg",
            },
        ],
    )


def write_plain_jsonl(path: Path) -> Path:
    """One row of each plain shape: prompt, messages (system, user, assistant, user), turns."""
    return write_jsonl(
        path,
        [
            {"prompt": "Name a prime number."},
            {
                "id": "chat-1",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello?"},
                    {"role": "assistant", "content": "Hi."},
                    {"role": "user", "content": "And goodbye."},
                ],
            },
            {"category": "chat", "turns": ["First.", "Second."]},
        ],
    )


def prepare_demo_sets(out_dir: Path) -> list[Path]:
    """The demo's questions as MT-Bench JSONL and the GSM8K-style parquet, each prepared by the
    stage's own function as the rule prepare_eval_set writes it: the prepared files."""
    from eaglenest.settings.eval_sets import EvalSetSettings
    from eaglenest.stages.eval_sets.eval_sets import prepare_eval_set

    out_dir.mkdir(parents=True, exist_ok=True)
    sources = {
        "mt_bench": write_demo_mt_bench(out_dir / "question.jsonl"),
        "gsm8k": write_gsm8k_parquet(out_dir / "gsm8k.parquet"),
    }
    prepared = []
    for name, source in sources.items():
        out = out_dir / f"{name}.prepared.parquet"
        prepare_eval_set(EvalSetSettings(name, str(source), "auto"), out, out_dir / f"{name}.json")
        prepared.append(out)
    return prepared


def set_decoding(target_dir: Path, kwargs: dict | None = None, names=("mt_bench", "gsm8k")):
    """The SetDecodeSettings evaluate_drafter's rule passes for these sets over `target_dir`
    (the config checked without the sets, whose files are the test's own, their names set
    after)."""
    from eaglenest.common.config import validate_config
    from eaglenest.settings.eval_sets import SetDecodeSettings

    target = {"path": str(target_dir), "chat_template_kwargs": kwargs or {}}
    config = validate_config({"target": target})
    config["evaluate"]["sets"] = [{"name": name, "path": f"{name}.jsonl"} for name in names]
    return SetDecodeSettings.from_config(config)


def demo_engine_sets(out_dir: Path, target_dir: Path, max_new_tokens: int):
    """The demo's sets (prepare_demo_sets, made once in `out_dir`) as the vLLM evaluation decodes
    them over `target_dir` (stages/evaluate/sets.py's EngineSets)."""
    from eaglenest.stages.evaluate.sets import engine_sets

    prepared = sorted(out_dir.glob("*.prepared.parquet"))
    if not prepared:
        prepared = prepare_demo_sets(out_dir)
    return engine_sets(prepared, set_decoding(target_dir), max_new_tokens)
