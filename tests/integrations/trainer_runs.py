"""An AutoTPTrainer that records its losses, for the Trainer tests of tests/integrations/ (a helper module beside
them, not a test module)."""

from __future__ import annotations

from transformers import Trainer, TrainingArguments

import autotp
from models import Sequences, tiny_model


def recording_trainer(path: str, tp: int, fsdp: bool, steps: int = 1, save: bool = False, cp: int = 1) -> Trainer:
    """AutoTPTrainer on a tiny Llama wrapped at `tp` (and `cp`), keeping each step's loss unrounded in `.losses`."""
    from autotp.hf_trainer import AutoTPTrainer

    class Recording(AutoTPTrainer):
        losses: list[float] = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses = [*self.losses, loss.item()]
            return loss

    args = TrainingArguments(
        output_dir=path,
        per_device_train_batch_size=2,
        max_steps=steps,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        seed=0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="steps" if save else "no",
        save_steps=1,
    )
    return Recording(
        model=autotp.wrap(tiny_model("llama"), tp_size=tp, cp_size=cp),
        args=args,
        train_dataset=Sequences(12),
        fully_shard=fsdp,
    )
