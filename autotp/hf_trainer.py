"""The public face of autotp's Trainer integration: `AutoTPTrainer` and `tp_trainer(TrainerClass)`.

The code lives in `autotp.integrations.trainer`; this path is the one users import, and it stays.
"""

from .integrations.trainer import AutoTPTrainer, tp_trainer

__all__ = ["AutoTPTrainer", "tp_trainer"]
