import torch

# GPU tests run on a CUDA machine (scripts/gpu_check.sh); elsewhere there is nothing to collect.
collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
