"""``specserve train-drafter``: a DFlash2 block drafter for the loaded target, trained on its own responses
(data.py), with the block objective (objective.py), resumable with published-layout checkpoints (loop.py)."""
