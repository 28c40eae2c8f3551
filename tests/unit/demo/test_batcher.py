"""The embedded server's batcher (demo/batcher.py): a request that arrives while a batch runs joins
it, with the answer it gets alone."""

from __future__ import annotations

import asyncio

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from eaglenest.demo.batcher import Batcher, SamplingParams, _Pending


def test_a_request_that_arrives_while_a_batch_runs_joins_it_with_its_own_answer():
    """The batcher adds a request queued during a batch as a new row at the next step (prefilled
        alone, its cache left-padded to the batch's length): each answer equals the request's answer
        alone (one of 4 tokens joins when the batch is 4 long), and a prompt longer than the batch ever
    is waits for the next batch."""
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    batcher = Batcher(model, stop_token_ids={63}, pad_token_id=0)
    loop = asyncio.new_event_loop()

    def request(prompt: list[int], new_tokens: int) -> _Pending:
        return _Pending(
            prompt, SamplingParams(new_tokens, temperature=0), loop, loop.create_future()
        )

    def answer(pending: _Pending) -> list[int]:
        loop.run_until_complete(asyncio.sleep(0))  # the results come back through the loop
        return pending.future.result().completion_token_ids

    def alone(prompt: list[int], new_tokens: int) -> list[int]:
        pending = request(prompt, new_tokens)
        with torch.inference_mode():
            batcher._run_batch([pending])
        return answer(pending)

    first, joiners = request([5, 9, 2], 60), [request([7, 1], 40), request([3, 3, 8, 4], 90)]
    too_long = request(list(range(1, 63)) * 2, 10)  # longer than the batch ever is (3 + 60)
    for pending in (*joiners, too_long):
        batcher._queue.put(pending)
    with torch.inference_mode():
        batcher._run_batch([first])
    assert batcher.stats.batches == 1 and batcher.stats.max_batch_size_seen == 3
    assert batcher._held == [too_long] and batcher._queue.empty()
    for pending in (first, *joiners):
        prompt, new_tokens = pending.prompt_token_ids, pending.params.max_new_tokens
        assert answer(pending) == alone(prompt, new_tokens)
    loop.close()
