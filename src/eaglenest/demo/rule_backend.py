"""The rule backend of `eaglenest serve --rule` (`server.backend: rule`): the cite target's
answers written by its rule (cite_tasks.py), token for token what its greedy decoding writes,
without running the model.

The cite target's answers are 2,000 to 40,000 tokens long: transformers on a CPU takes many
minutes to decode one, while the rule writes it at once. The target's build proves that the two
agree (cite_build.py: teacher-forced over whole answers, the target's argmax at every position
is the rule's next token), and saves the shape the rule needs beside the weights
(`cite_rule.json`); the tests hold the served ids and text to the model server's.

Sampling: the rule answers as greedy decoding, whatever the request's seed, and serves only the
sampling that is greedy decoding on this target; the rest is refused (serve the model for it).
Greedy requests (temperature 0) are. So is any temperature <= 1 with a top_p at or below the
right token's smallest probability at temperature 1 (which the build measures over its check
answers and saves in `cite_rule.json`; the backend takes it rounded down to two decimals): the
nucleus then holds the right token alone at every position (a lower temperature only sharpens
the distribution), as with the pipeline's default top_p 0.95. Measured: 0.99999 at 160 states
(answers of 600 tokens), 0.99996 at 640, 0.9984 at 10,240 (33,543 tokens), each target's right
token leading the best other one by 10 logits or more. Margins of 10 logits do NOT make top_p 1
sampling greedy on long answers: at temperature 1 the other tokens' probabilities add up to
about 6e-4 a position at 10,240 states, 20 tokens sampled off the rule over a 33,543-token answer
(a whole answer the greedy one with probability ~e^-20; 0.96 for 2,000-token answers at 640
states, 0.998 for 600 at 160), and 0.006 of an answer at temperature 0.6: refused, as is any
temperature above 1.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

from eaglenest.common.io import read_json
from eaglenest.demo.cite_tasks import (
    CITE_RULE_FILE,
    answer_text,
    cite_example_at,
    parse_cite_prompt,
    shape_of,
)
from eaglenest.demo.example import DemoExample
from eaglenest.demo.model_backend import (
    GREEDY_TEMPERATURE,
    first_set,
    max_new_tokens,
    render_prompt,
    sampling_defaults,
    stop_token_ids,
)
from eaglenest.demo.protocol import ChatRequest, Completion, RequestError
from eaglenest.demo.tasks import END_OF_TURN

log = logging.getLogger(__name__)

MAX_TEMPERATURE = 1.0  # the right token's probability is measured at 1; below, it only grows


class RuleBackend:
    """The cite target's answers from its rule: ModelBackend's interface, no model."""

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        trust_remote_code: bool = False,
        max_model_len: int | None = None,
        default_max_tokens: int | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from eaglenest.target_model.files import resolve_target_dir

        model_dir = resolve_target_dir(model_path, "target.path")
        rule = _cite_rule(Path(model_dir))
        self.shape = shape_of(rule["shape"])
        # Rounded down: a margin for answers less sure than the build's check answers.
        self.greedy_top_p = math.floor(rule["min_right_probability"] * 100) / 100
        tokenizer_dir = (
            resolve_target_dir(tokenizer_path, "target.tokenizer") if tokenizer_path else model_dir
        )
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(tokenizer_dir), trust_remote_code=trust_remote_code
        )
        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        generation_config = GenerationConfig.from_pretrained(str(model_dir))
        # The limits and defaults ModelBackend reads from the same files, so a cut falls where
        # the model server's falls.
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", None)
        self.sampling_defaults = sampling_defaults(generation_config)
        self.default_max_tokens = int(
            default_max_tokens or self.sampling_defaults.get("max_new_tokens") or 4096
        )
        end_of_turn = self.tokenizer.convert_tokens_to_ids(END_OF_TURN)
        if end_of_turn not in stop_token_ids(generation_config, self.tokenizer):
            raise ValueError(f"{model_dir}: {END_OF_TURN} is not a stop token of the target")
        self.completions = 0
        self.generated_tokens = 0
        log.info("rule backend for the cite target %s: %s", model_dir, self.shape)

    def waiting(self) -> int:
        return 0  # no queue: every answer is written at once

    async def complete(self, request: ChatRequest, *, paced: bool = False) -> Completion:
        """The whole answer, as the target's greedy decoding writes it (streamed at once)."""
        return await asyncio.to_thread(self._complete, request)

    def _complete(self, request: ChatRequest) -> Completion:
        example = self._example(request)
        prompt_ids = render_prompt(self.tokenizer, request)
        # The build proves the answer after the cite prompt alone, thinking on: a request's prompt
        # must be that one (or run on into the answer, which greedy decoding then finishes).
        proven = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": example.prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )
        ids = self.tokenizer(proven + answer_text(example), add_special_tokens=False)["input_ids"]
        if ids[: len(prompt_ids)] != prompt_ids or len(ids) <= len(prompt_ids):
            raise RequestError(
                "the rule backend knows the cite target's answer to a cite prompt alone, in one "
                "user turn with thinking on (as the target's build proves it); this request "
                "renders another prompt (other turns, or chat_template_kwargs that change it)",
                param="messages",
            )
        self._check_sampling(request)
        answer_ids = ids[len(prompt_ids) :]
        limit = max_new_tokens(
            request, len(prompt_ids), self.max_model_len, self.default_max_tokens
        )
        # As the batcher ends it: the stop token counts before the length limit.
        finish_reason = "stop" if len(answer_ids) <= limit else "length"
        answer_ids = answer_ids[:limit]
        text_ids = answer_ids[:-1] if finish_reason == "stop" else answer_ids
        text = self.tokenizer.decode(
            text_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        self.completions += 1
        self.generated_tokens += len(answer_ids)
        return Completion(prompt_ids, answer_ids, text, finish_reason)

    def _check_sampling(self, request: ChatRequest) -> None:
        """RequestError unless sampling as the request asks is greedy decoding on this target."""
        defaults = self.sampling_defaults
        temperature = first_set(request.temperature, defaults.get("temperature"), 1.0)
        top_p = first_set(request.top_p, defaults.get("top_p"), 1.0)
        if temperature < GREEDY_TEMPERATURE:
            return
        if temperature > MAX_TEMPERATURE:
            raise RequestError(
                f"the rule backend serves greedy decoding, which sampling at temperature "
                f"{temperature:g} is not on the cite target (above {MAX_TEMPERATURE:g}, its "
                "margins shrink): serve the model (server.backend: model) to sample there",
                param="temperature",
            )
        if top_p > self.greedy_top_p:
            raise RequestError(
                f"the rule backend serves greedy decoding, which sampling at top_p {top_p:g} is "
                f"not on the cite target's long answers: send top_p <= {self.greedy_top_p:g} "
                "(the nucleus then holds the rule's token alone) or temperature 0, or serve the "
                "model (server.backend: model)",
                param="top_p",
            )

    def _example(self, request: ChatRequest) -> DemoExample:
        """The cite example whose prompt is the request's last user turn; RequestError naming
        what of a cite prompt it lacks."""
        users = [m for m in request.messages if m["role"] == "user"]
        text = (users[-1].get("content") or "") if users else ""
        try:
            key, start, book = parse_cite_prompt(self.shape, text)
        except ValueError as error:
            raise RequestError(
                "the rule backend answers cite prompts only (eaglenest.demo.cite_tasks."
                f"cite_prompt) and this request's last user turn is none: {error}",
                param="messages",
            ) from None
        return cite_example_at(self.shape, key, start, book)

    def stats(self) -> dict[str, Any]:
        return {
            "backend": "rule",
            "completions": self.completions,
            "generated_tokens": self.generated_tokens,
        }


def _cite_rule(model_dir: Path) -> dict[str, Any]:
    path = model_dir / CITE_RULE_FILE
    if not path.is_file():
        raise ValueError(
            f"server.backend rule (eaglenest serve --rule) answers for a cite target "
            f"(demo_target.tasks cite) only, and {model_dir} has no {CITE_RULE_FILE} (which "
            "a cite target's build writes): serve this target with server.backend model"
        )
    return read_json(path)
