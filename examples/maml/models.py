"""The 4-block conv net of the few-shot example (the sinusoid MLP is in ``sinusoid.py``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ConvNet"]


def _block(in_channels: int, out_channels: int) -> nn.Sequential:
    # track_running_stats=False: MAML normalises with the statistics of the batch at hand, at
    # meta-train and meta-test time alike (Finn et al.), so the net has no buffers to keep in
    # sync across workers and BatchNorm composes with torch.func.vmap.
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
        nn.BatchNorm2d(out_channels, track_running_stats=False),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


class ConvNet(nn.Module):
    """The 4-block conv net of the MAML few-shot experiments (64 filters, 3x3, BN, ReLU, max-pool).

    A 28x28 input shrinks to 14, 7, 3 and 1 pixels, so the head sees ``hidden`` features.

    Args:
        n_way: Number of classes of one task (outputs of the linear head).
        in_channels: Channels of the input images.
        hidden: Filters of every conv layer.

    Example:
        >>> ConvNet(n_way=5)(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 5])
    """

    def __init__(self, n_way: int, in_channels: int = 1, hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _block(in_channels, hidden),
            _block(hidden, hidden),
            _block(hidden, hidden),
            _block(hidden, hidden),
            nn.Flatten(),
        )
        self.head = nn.Linear(hidden, n_way)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(B, C, 28, 28)`` to logits ``(B, n_way)``."""
        return self.head(self.features(x))  # type: ignore[no-any-return]
