"""One real training step on real CPU tensors, shaped like a TraceKey: the reference the traced
estimates are compared with (tests/unit/test_trace.py, tests/unit/test_peft_trace.py)."""
import torch


def train_one_step(model, key, opt, vocab_size: int) -> None:
    """Forward with the model's own loss (under autocast when the key asks), backward, the
    optimizer step if any, zero_grad(set_to_none=True)."""
    ids = torch.randint(0, vocab_size, (key.micro_batch_size, key.seq_len))
    with torch.autocast("cpu", dtype=getattr(torch, key.autocast_dtype or "float32"),
                        enabled=key.autocast_dtype is not None):
        if getattr(key, "loss", "model") == "fp32_shift_copy":
            loss = _transformers_4_44_loss(model, ids)
        elif getattr(key, "loss", "model") == "shift_copy":
            loss = _qwen_v1_loss(model, ids)
        else:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    del loss
    if opt is not None:
        opt.step()
    (opt or model).zero_grad(set_to_none=True)


def _transformers_4_44_loss(model, labels):
    """LlamaForCausalLM.forward's loss lines in transformers 4.44 (models/llama/modeling_llama.py),
    with the outputs dropped before backward as HF Trainer's compute_loss does."""
    logits = model(input_ids=labels).logits
    logits = logits.float()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    loss_fct = torch.nn.CrossEntropyLoss()
    shift_logits = shift_logits.view(-1, model.config.vocab_size)
    shift_labels = shift_labels.view(-1)
    return loss_fct(shift_logits, shift_labels)


def _qwen_v1_loss(model, labels):
    """QWenLMHeadModel.forward's loss lines (Qwen (v1)'s modeling_qwen.py; transformers 4.2x's
    BloomForCausalLM and OPTForCausalLM have the same): the lm_head's logits in the model's dtype,
    with the outputs dropped before backward as HF Trainer's compute_loss does."""
    lm_logits = model(input_ids=labels).logits
    shift_logits = lm_logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    loss_fct = torch.nn.CrossEntropyLoss()
    return loss_fct(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
