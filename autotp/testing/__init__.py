"""Parity-test your own models and policies the way autotp tests itself, as `torch.testing` does for torch.

    from autotp.testing import run_ranks, compare_training, assert_parity, tiny_config

    def check(rank, world):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))   # same seed on every rank
        return compare_training(model, ids, tp_size=world)

    for report in run_ranks(check, 2):   # 2 forked CPU ranks, gloo, no torchrun
        assert_parity(report)

- `run_ranks(fn, world, *args)`: fork `world` CPU ranks with a gloo group, return each rank's result.
- `compare_training(model, ids, tp_size, ...)`: train `model` and a wrapped copy side by side with
  AdamW; report the worst loss, gradient and parameter differences.
- `assert_parity(report)`: fail with the worst tensor named, at the fp32 tolerances below.
- `tiny_config(model_type)`: any model type's default config shrunk to test size, dropout off.
"""

from .parity import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL, assert_parity, compare_training, full_tensor, grad_error
from .spawn import free_port, run_ranks
from .tiny import tiny_config

__all__ = [
    "GRAD_RTOL",
    "LOSS_ATOL",
    "PARAM_ATOL",
    "assert_parity",
    "compare_training",
    "free_port",
    "full_tensor",
    "grad_error",
    "run_ranks",
    "tiny_config",
]
