"""EAGLE-3 (arXiv 2503.01840): the drafter and its training-time-test forward (model.py), and the
checkpoint vLLM and SGLang load (export.py). Its loss is stages/train/loss.py's `ttt_loss`."""
