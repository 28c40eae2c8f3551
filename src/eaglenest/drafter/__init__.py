"""The drafter, the product of the whole pipeline: its config (config.py), its building blocks
(layers.py), the EAGLE-3 model and training-time test (model.py), the attention training-time
test runs (attention.py), the batches it trains on (batches.py), and its export as the
checkpoint vLLM and SGLang load (export.py)."""
