"""What runs inside vLLM, or starts it: one room for the code that crosses into vLLM's environment.

vLLM pins another transformers (<5.20) than ours and has none of our other dependencies (polars,
pandera, aiohttp, ...), so it runs in its own environment (`make vllm`, `vllm.python` of the
config) and our modules that run there are started as `python -m eaglenest.vllm_engine.<module>`
with our source on PYTHONPATH (process.py).

Under vLLM's interpreter (the engine side):
- capture.py: the offline capture engine of a hidden-state shard (started by
  stages/hidden_states/vllm_backend.py); connector.py: the KV connector vLLM loads by name in its
  workers to write each request's states;
- serve.py: vLLM's OpenAI server with that capture method (started by
  capture/server.py, `eaglenest serve-capture`);
- decode.py: plain and EAGLE-3 decoding for the evaluation in vLLM (started by
  stages/evaluate/vllm_evaluate.py);
- process.py (both sides: starting a module under vLLM's interpreter and talking to it) and
  cpu.py (what vLLM's CPU build needs to compute what its GPU build does).

What a capture engine is started with is built in our environment, by capture/request.py.

The import rule, held by tests/house/test_layout.py: a module of this package imports nothing of
eaglenest outside it. A module run under vLLM's interpreter, and everything of ours it imports,
stays inside this package and imports nothing but the standard library, vLLM and what vLLM itself
depends on (torch, numpy, safetensors, huggingface_hub). The stage-level logic (packing states
into shards, computing acceptance) stays in its stage and imports this package.
"""
