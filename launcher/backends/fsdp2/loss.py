"""Cross-entropy on vocabulary-sharded logits (loss parallelism) for fsdp2_tp: Megatron's
vocab-parallel cross-entropy (arXiv:1909.08053 sec. 3; ColossalAI 0.5.0
colossalai/shardformer/layer/loss.py `DistCrossEntropy`), on each rank's local logits with
explicit all-reduces over the tensor-parallel group: the max, the target logit and the exp-sum.

The same statements, without the collectives, are what the tracer runs on a tensor-parallel
shard (launcher/vocab_parallel_loss.py), so the memory model and the run allocate the same
tensors. torch's `loss_parallel` (torch/distributed/tensor/parallel/loss.py) computes the same
loss inside DTensor's op handlers, whose temporaries (`shifted`, `exp(shifted)` in
`_log_softmax`) no allocation tracker on the CPU can see (a TorchDispatchMode is inactive inside
a subclass's dispatch), so its peak could not be checked against a real run here.
"""
from __future__ import annotations

IGNORE_INDEX = -100


def _function():
    import torch
    import torch.distributed as dist

    class VocabParallelCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, vocab_logits, target, ignore_index, group, vocab_start):
            logits_max = torch.max(vocab_logits, dim=-1)[0]
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
            shard = vocab_logits.size()[-1]
            target = target - vocab_start
            mask = (target < 0) | (target >= shard)
            masked_target = target.clone() - 0
            masked_target[mask] = 0
            masked_target_1d = masked_target.view(-1).contiguous()
            vocab_logits = vocab_logits - logits_max.unsqueeze(dim=-1)
            logits_2d = vocab_logits.view(-1, shard)
            idx = torch.arange(start=0, end=logits_2d.shape[0], device=logits_2d.device)
            pred_logits_1d = logits_2d[idx, masked_target_1d].contiguous()
            pred_logits = pred_logits_1d.view_as(target)
            pred_logits[mask] = 0.0
            dist.all_reduce(pred_logits, op=dist.ReduceOp.SUM, group=group)
            exp_logits = vocab_logits
            torch.exp(vocab_logits, out=exp_logits)
            sum_exp_logits = torch.sum(exp_logits, dim=-1, dtype=torch.float32)
            dist.all_reduce(sum_exp_logits, op=dist.ReduceOp.SUM, group=group)
            loss = torch.where(target + vocab_start == ignore_index, 0.0, torch.log(sum_exp_logits) - pred_logits)
            loss = torch.sum(loss)
            exp_logits = exp_logits.div(sum_exp_logits.unsqueeze(dim=-1)).to(vocab_logits.dtype)
            exp_logits[target + vocab_start == ignore_index] = 0.0
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
            return grad_logits, None, None, None, None

    return VocabParallelCrossEntropy


def vocab_parallel_loss(local_logits, labels, group, vocab_start: int):
    """Mean next-token cross-entropy over the non-ignored labels (transformers' ForCausalLMLoss
    without num_items_in_batch), from this rank's logits over vocabulary rows
    [vocab_start, vocab_start + shard)."""
    labels = labels[..., 1:].contiguous()
    logits = local_logits[..., :-1, :].contiguous()
    num_nonzero = (labels != IGNORE_INDEX).sum()
    loss = _function().apply(logits.view(-1, logits.size(-1)), labels.view(-1), IGNORE_INDEX, group, vocab_start)
    return (loss / num_nonzero).squeeze()
