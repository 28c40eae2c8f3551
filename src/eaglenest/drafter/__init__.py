"""The drafter, the product of the whole pipeline: a room per drafter family, each holding that
family's model, objective and export, readable top to bottom (eagle3/, p_eagle/, dflash/; the
family table every stage reads is eaglenest.settings.families), and what the families share: the
config (config.py), the building blocks (layers.py), the attention training-time test runs
(attention.py), the draft-vocabulary head and the export files (vocab_head.py), the per-slot loss
of the parallel families (block_loss.py) and the batches they all train on (batches.py).
EAGLE-3's training-time-test loss is the train stage's (stages/train/loss.py, `ttt_loss`): it is
the run's objective over TTT steps, with the DDP rescaling the stage owns."""
