import torch

# Ranks are forked from this process: keep it single-threaded so no OpenMP pool is forked mid-use.
torch.set_num_threads(1)
