import torch

# GPU tests run on a CUDA machine (scripts/gpu_check.sh); elsewhere there is nothing to collect.
# The tensor-parallel ones need two devices (`STAGES=tp` on a two-GPU machine).
if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]
elif torch.cuda.device_count() < 2:
    collect_ignore_glob = ["test_tensor_parallel_gpu.py"]
else:
    collect_ignore_glob = []
