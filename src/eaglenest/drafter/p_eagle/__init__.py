"""P-EAGLE (arXiv 2602.01469): EAGLE-3 drafting its K tokens in one forward: the model
(model.py), its objective (loss.py) and its export (export.py)."""
