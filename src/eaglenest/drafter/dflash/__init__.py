"""DFlash (arXiv 2602.06036): a block of tokens drafted in one forward: the model (model.py), its
objective (loss.py), the decoding vLLM's proposer does (decode.py) and its export (export.py)."""
