"""The model backend of `eaglenest serve`: a transformers causal LM behind the batcher
(batcher.py), with the chat template, stop tokens and sampling defaults the model ships."""

from __future__ import annotations

import logging
from typing import Any

from eaglenest.demo.protocol import ChatRequest, Completion, RequestError

log = logging.getLogger(__name__)

GREEDY_TEMPERATURE = 1e-5  # below this, sample greedily (vLLM's threshold)


class ModelBackend:
    """A transformers causal LM behind the dynamic batcher (batcher.py)."""

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        trust_remote_code: bool = False,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 64,
        gather_window_s: float = 0.005,
        max_model_len: int | None = None,
        default_max_tokens: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from eaglenest.common.devices import resolve_device
        from eaglenest.demo.batcher import Batcher
        from eaglenest.target_model.files import resolve_target_dir

        # Local directories, or hub names resolved in the local cache (never downloaded here).
        model_dir = str(resolve_target_dir(model_path, "target.path"))
        tokenizer_dir = (
            str(resolve_target_dir(tokenizer_path, "target.tokenizer"))
            if tokenizer_path
            else model_dir
        )
        device = resolve_device(device)
        if dtype == "auto" and device == "cpu":
            dtype = "float32"  # half precision matmuls are slow (or missing) on many CPUs
        self.tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_dir, trust_remote_code=trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            dtype=dtype if dtype == "auto" else getattr(torch, dtype),
            trust_remote_code=trust_remote_code,
        )
        model.to(device).eval()
        self.stop_token_ids = stop_token_ids(model.generation_config, self.tokenizer)
        pad_token_id = self.tokenizer.pad_token_id
        if pad_token_id is None:  # padded positions are masked: any id will do
            pad_token_id = min(self.stop_token_ids)
        self.max_model_len = max_model_len or getattr(model.config, "max_position_embeddings", None)
        self.sampling_defaults = sampling_defaults(model.generation_config)
        self.default_max_tokens = int(
            default_max_tokens or self.sampling_defaults.get("max_new_tokens") or 4096
        )
        self.batcher = Batcher(
            model,
            self.stop_token_ids,
            pad_token_id,
            max_batch_size=max_batch_size,
            gather_window_s=gather_window_s,
        )
        log.info(
            "loaded %s on %s (%s); stop tokens %s; sampling defaults %s",
            model_path,
            device,
            model.dtype,
            sorted(self.stop_token_ids),
            self.sampling_defaults,
        )

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()

    def render_prompt(self, request: ChatRequest) -> list[int]:
        return render_prompt(self.tokenizer, request)

    def waiting(self) -> int:
        return self.batcher.waiting()

    async def complete(self, request: ChatRequest, *, paced: bool = False) -> Completion:
        """The whole answer; a streamed one is then sent at once (the batcher does not stream)."""
        from eaglenest.demo.batcher import SamplingParams

        prompt_ids = self.render_prompt(request)
        params = SamplingParams(
            max_new_tokens=max_new_tokens(
                request, len(prompt_ids), self.max_model_len, self.default_max_tokens
            ),
            temperature=first_set(
                request.temperature, self.sampling_defaults.get("temperature"), 1.0
            ),
            top_p=first_set(request.top_p, self.sampling_defaults.get("top_p"), 1.0),
            seed=request.seed,
        )
        if params.temperature < GREEDY_TEMPERATURE:
            params = SamplingParams(params.max_new_tokens, 0.0, 1.0, params.seed)
        result = await self.batcher.generate(prompt_ids, params)
        generated = result.completion_token_ids
        text_ids = generated[:-1] if result.finish_reason == "stop" else generated
        text = self.tokenizer.decode(
            text_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return Completion(prompt_ids, generated, text, result.finish_reason)

    def stats(self) -> dict[str, Any]:
        stats = self.batcher.stats
        return {
            "backend": "model",
            "batches": stats.batches,
            "completions": stats.requests,
            "generated_tokens": stats.generated_tokens,
            "max_batch_size_seen": stats.max_batch_size_seen,
        }


def render_prompt(tokenizer: Any, request: ChatRequest) -> list[int]:
    """The prompt's ids: the tokenizer's chat template with the request's chat_template_kwargs."""
    import jinja2

    try:
        prompt = tokenizer.apply_chat_template(
            request.messages,
            tokenize=False,
            add_generation_prompt=True,
            **request.chat_template_kwargs,
        )
    # Template errors are the request's fault (roles, content types, kwargs).
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise RequestError(f"the chat template failed on this request: {error}") from None
    # Like vLLM: the template already wrote every special token the prompt needs.
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def max_new_tokens(
    request: ChatRequest, prompt_len: int, max_model_len: int | None, default_max_tokens: int
) -> int:
    """The request's max_tokens, else the default, within the context; a max_tokens past the
    context is refused, as vLLM refuses it."""
    if max_model_len is None:
        return request.max_tokens or default_max_tokens
    room = max_model_len - prompt_len
    if room < 1 or (request.max_tokens is not None and request.max_tokens > room):
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt "
            f"has {prompt_len} and max_tokens is {request.max_tokens}",
            param="max_tokens",
        )
    return request.max_tokens or min(room, default_max_tokens)


def stop_token_ids(generation_config: Any, tokenizer: Any) -> set[int]:
    """End-of-turn ids: generation_config's eos ids (chat models list <|im_end|> there) and the
    tokenizer's eos."""
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def sampling_defaults(generation_config: Any) -> dict[str, float]:
    # vLLM applies the sampling values a model ships in generation_config.json (max_new_tokens
    # becomes the default max_tokens); do the same.
    shipped = generation_config.to_diff_dict() if generation_config is not None else {}
    keys = ("temperature", "top_p", "max_new_tokens")
    return {k: float(shipped[k]) for k in keys if shipped.get(k) is not None}


def first_set(*values: float | None) -> float:
    return next(v for v in values if v is not None)
