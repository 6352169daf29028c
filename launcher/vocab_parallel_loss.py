"""One tensor-parallel rank's causal-LM loss, as ColossalAI computes it on vocabulary-sharded logits.

Under `cai_tp` the LM head is `VocabParallelLMHead1D` with `parallel_output=True`: each rank holds
logits over its slice of the vocabulary, and the loss is ColossalAI's `dist_cross_entropy`
(colossalai/shardformer/layer/loss.py, 0.5.0), whose `DistCrossEntropy` autograd function
all-reduces a max, the target logit and the exp-sum across the tensor-parallel group. Those
all-reduces work in place on per-token vectors, so one rank allocates exactly what the same
sequence of tensor operations allocates without them. The tracer runs this function on the
shard model's logits so the traced step holds the tensors a real rank holds: contiguous shifted
copies of labels and logits, the max-subtracted logits (exponentiated in place), the softmax
saved for backward, and the in-place gradient built from it. Each statement below is the
operation at the cited place in loss.py; only the collectives and their waits are left out.
"""
from __future__ import annotations

IGNORE_INDEX = -100  # loss.py `_IGNORE_IDX`


def _function():
    import torch

    class VocabParallelCrossEntropy(torch.autograd.Function):
        """`DistCrossEntropy` (loss.py) on one rank that owns vocabulary rows [0, shard)."""

        @staticmethod
        def forward(ctx, vocab_logits, target, ignore_index):
            logits_max = torch.max(vocab_logits, dim=-1)[0]  # all-reduce MAX in place
            shard = vocab_logits.size()[-1]
            mask = (target < 0) | (target >= shard)
            masked_target = target.clone() - 0
            masked_target[mask] = 0
            masked_target_1d = masked_target.view(-1).contiguous()
            vocab_logits = vocab_logits - logits_max.unsqueeze(dim=-1)
            logits_2d = vocab_logits.view(-1, shard)
            idx = torch.arange(start=0, end=logits_2d.shape[0], device=logits_2d.device)
            pred_logits_1d = logits_2d[idx, masked_target_1d].contiguous()
            pred_logits = pred_logits_1d.view_as(target)
            pred_logits[mask] = 0.0  # all-reduce SUM in place
            exp_logits = vocab_logits
            torch.exp(vocab_logits, out=exp_logits)
            sum_exp_logits = torch.sum(exp_logits, dim=-1, dtype=torch.float32)  # all-reduce SUM in place
            loss = torch.where(target == ignore_index, 0.0, torch.log(sum_exp_logits) - pred_logits)
            loss = torch.sum(loss)  # mode="sum"
            exp_logits = exp_logits.div(sum_exp_logits.unsqueeze(dim=-1)).to(vocab_logits.dtype)
            exp_logits[target == ignore_index] = 0.0
            ctx.save_for_backward(exp_logits, mask, masked_target_1d)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            exp_logits, mask, masked_target_1d = ctx.saved_tensors
            grad_logits = exp_logits
            grad_logits_2d = grad_logits.view(-1, grad_logits.shape[-1])
            update = 1.0 - mask.view(-1).float().to(exp_logits.dtype)
            grad_logits_2d[torch.arange(0, grad_logits_2d.shape[0]), masked_target_1d] -= update
            grad_logits.mul_(grad_output.unsqueeze(dim=-1))
            return grad_logits, None, None

    return VocabParallelCrossEntropy


def vocab_parallel_loss(logits, labels):
    """`dist_cross_entropy(labels, logits, ...)` without sequence parallelism (loss.py): shift,
    make both contiguous, count the non-ignored labels, sum the vocab-parallel cross entropy and
    divide by the count."""
    labels = labels[..., 1:]
    logits = logits[..., :-1, :]
    labels = labels.contiguous()
    logits = logits.contiguous()
    num_nonzero = (labels != IGNORE_INDEX).sum()
    labels = labels.view(-1)
    logits = logits.view(-1, logits.size(-1))
    loss = _function().apply(logits, labels, IGNORE_INDEX)
    return (loss / num_nonzero).squeeze()
