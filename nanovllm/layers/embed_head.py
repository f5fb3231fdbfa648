"""Vocab-parallel token embedding and LM head."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size
from nanovllm.layers.cpu_linear import packed_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.shard_size
        self.end = min(self.start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        shard = loaded[self.start:self.end]
        param.data[:shard.shape[0]].copy_(shard)
        param.data[shard.shape[0]:].zero_()  # padding rows of the last shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(in_shard, input_ids - self.start, 0)
        y = F.embedding(local, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    packed_weight: torch.Tensor | None = None  # as LinearBase's (layers/cpu_linear.py)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: [T, vocab_size] buffer to write the logits into (a CUDA graph's static output)."""
        if self.packed_weight is not None:
            logits = packed_linear(hidden, self.packed_weight, None)
        elif out is not None and tp_size() == 1:
            return torch.mm(hidden, self.weight.t(), out=out)
        else:
            logits = F.linear(hidden, self.weight)
        if tp_size() > 1:
            logits = all_gather_last_dim(logits)
        logits = logits[..., :self.vocab_size]
        return logits if out is None else out.copy_(logits)
