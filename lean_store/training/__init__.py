"""Training state: model, optimizer, scheduler, RNG and trainer state, and ``Checkpointer``."""

from .checkpointer import Checkpointer
from .state import TrainingInfo, load_optimizer, load_training, save_optimizer, save_training

__all__ = [
    "Checkpointer", "TrainingInfo", "load_optimizer", "load_training", "save_optimizer",
    "save_training",
]
