"""Pictures of a run and of a switch: the loss curve, and each switch's rank-to-rank bytes.

``transfer_matrix`` is pure (the planner only, no torch.distributed); the plotting functions need
matplotlib (the ``dev`` extra) and raise ``PlotError`` with the install command when it is missing.
"""

from lightning_dynatrain.viz.transfer_matrix import TransferMatrix, transfer_matrix

__all__ = ["TransferMatrix", "transfer_matrix"]
