"""Training checkpoints: model, optimizer, scheduler, RNG and trainer state
(``save_training``, ``load_training``, ``save_optimizer``, ``load_optimizer``, aliased at the
root as ``ls.save_training`` ...), and ``Checkpointer`` for one checkpoint per step."""

from .api import load_optimizer, load_training, save_optimizer, save_training, training_info
from .checkpointer import Checkpointer
from .state import TrainingInfo

__all__ = [
    "Checkpointer", "TrainingInfo", "load_optimizer", "load_training", "save_optimizer",
    "save_training", "training_info",
]
