"""A user's model, outside the package: an MLP classifier for 16 features and 4 classes (docs/models.md).

Started with ``--model tabular:build --data DIR`` (DIR holding inputs.npy and targets.npy), from this
directory or with it on PYTHONPATH. ``hidden`` is a setting: ``--model-config hidden=128``.
"""

import torch.nn.functional as F
from torch import nn

from ravnest_swarm.models import sequential_model


def build(hidden: int = 64):
    return sequential_model(
        "tabular",
        layers=[
            ("inner", lambda: nn.Sequential(nn.Linear(16, hidden), nn.ReLU())),
            ("middle", lambda: nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())),
            ("outer", lambda: nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())),
            ("classifier", lambda: nn.Linear(hidden, 4)),
        ],
        input_shape=(16,),
        loss=F.cross_entropy,
    )


def build_normalised(hidden: int = 64, dropout: float = 0.5):
    """The same with batch norm and dropout: built on ``meta`` in training mode (batch norm refuses a batch of one
    there), and evaluated as a user runs it, in eval mode."""
    return sequential_model(
        "tabular_normalised",
        layers=[
            ("inner", lambda: nn.Sequential(nn.Linear(16, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                            nn.Dropout(dropout))),
            ("flatten", nn.Flatten),  # no parameters: it takes no room in the averaged vector
            ("classifier", lambda: nn.Linear(hidden, 4)),
        ],
        input_shape=(16,),
        loss=F.cross_entropy,
    )


def build_tied():
    """Two layers that share one module's weights (tied weights): refused in one line."""
    shared = nn.Linear(16, 16)
    return sequential_model("tabular_tied", layers=[("inner", lambda: shared), ("again", lambda: shared),
                                                    ("classifier", lambda: nn.Linear(16, 4))],
                            input_shape=(16,), loss=F.cross_entropy)
