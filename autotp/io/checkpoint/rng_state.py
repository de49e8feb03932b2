"""The random generators a training run draws from (torch CPU and CUDA, Python, NumPy): captured, restored, re-seeded.

A checkpoint restores each rank's generators exactly when it is loaded at the layout it was saved
at. At another layout there is no rank to take them from: every generator is seeded from the saved
state of global rank 0 and the new data-parallel rank, so the ranks of a TP group draw alike (as
`wrap` requires) and replicas differ, and two resumes at one layout draw the same numbers. Only
what is drawn after the load changes (dropout masks, sampled data orders that read these
generators); the weights and the optimizer are restored exactly.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """Every generator's state, as plain data that pickles."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    state["numpy"] = np.random.get_state()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what `capture` took (CUDA only where this process has as many devices initialised)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def reseed(saved: dict[str, Any], replica: int) -> int:
    """Seed every generator from `saved` (global rank 0's captured state) and this data-parallel `replica`."""
    digest = hashlib.blake2b(saved["torch"].numpy().tobytes() + replica.to_bytes(8, "little"), digest_size=8)
    seed = int.from_bytes(digest.digest(), "little") >> 1
    torch.manual_seed(seed)  # CUDA's generators too
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        return seed
    np.random.seed(seed % 2**32)
    return seed
