"""Dtypes and tolerances of the attention-kernel tests (against the plain-torch reference)."""
import torch

ON_GPU = torch.cuda.is_available()  # conftest.py selects the Triton interpreter otherwise
if ON_GPU:
    DTYPES = [torch.bfloat16, torch.float16]
    TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
else:  # bf16 tl.dot is wrong under TRITON_INTERPRET=1: never tested there
    DTYPES = [torch.float32, torch.float16]
    TOL = {torch.float16: 1e-2, torch.float32: 1e-4}
