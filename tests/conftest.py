import torch

# Ranks are forked from this process: keep it single-threaded so no OpenMP pool is forked mid-use.
torch.set_num_threads(1)

# wrap imports PEFT when it is installed (autotp.io.adapters); importing it here once spares every forked rank the ~2 s.
import peft  # noqa: E402,F401
