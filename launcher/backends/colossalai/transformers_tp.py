"""ColossalAI 0.5.0 tensor parallelism for Llama-family models on transformers 5.

ColossalAI 0.5.0 pins transformers 4.51. Its shardformer Llama policy
(colossalai/shardformer/policies/llama.py `LlamaPolicy.module_policy`) always replaces
`LlamaModel.forward` with `LlamaPipelineForwards.llama_model_forward` and, under tensor
parallelism, `LlamaForCausalLM.forward` with `llama_for_causal_lm_forward`
(colossalai/shardformer/modeling/llama.py). Those forwards are written against transformers 4.51:
they call `LlamaModel._update_causal_mask` (gone in transformers 5, replaced by
`transformers.masking_utils.create_causal_mask`), index each decoder layer's output as a tuple
(transformers 5 layers return the hidden-state tensor, so `[0]` would silently take the first
sequence of the batch), and import `StaticCache` from `modeling_llama` (now only in
`transformers.cache_utils`).

`apply()` installs transformers-5 forwards for the one configuration the launcher emits for
`cai_tp`: tensor parallelism without pipeline stages, sequence parallelism or ColossalAI's flash
attention. They are the model's own transformers 5 forward (whose attention reshapes with
`-1` heads, so it runs on the column-sharded q/k/v projections the policy installs) plus
ColossalAI's vocabulary-parallel loss `dist_cross_entropy` on the vocabulary-sharded logits of
`VocabParallelLMHead1D`, exactly as ColossalAI's own causal-LM forward computes it. Any other
configuration raises instead of running a forward that would compute the wrong thing.
"""
from __future__ import annotations

_MARK = "_launcher_transformers5"


def needed() -> bool:
    """True where ColossalAI's Llama shardformer forwards do not match the installed transformers."""
    from importlib.metadata import version

    return int(version("transformers").split(".")[0]) >= 5


def _tensor_parallel_only(stage_manager, shard_config) -> None:
    if stage_manager is not None or shard_config.enable_sequence_parallelism or shard_config.enable_flash_attention:
        raise NotImplementedError(
            "ColossalAI 0.5.0's pipeline, sequence-parallel and flash-attention Llama forwards need "
            "transformers 4.51; with transformers 5 only tensor parallelism (pp_size=1) runs")


def apply() -> None:
    """Install the transformers-5 forwards (idempotent; a no-op on transformers 4)."""
    if not needed():
        return
    from transformers import cache_utils
    from transformers.models.llama import modeling_llama

    if not hasattr(modeling_llama, "StaticCache"):
        modeling_llama.StaticCache = cache_utils.StaticCache
    from colossalai.shardformer.layer import dist_cross_entropy
    from colossalai.shardformer.modeling.llama import LlamaPipelineForwards
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if getattr(LlamaPipelineForwards.llama_model_forward, _MARK, False):
        return

    def llama_model_forward(self, input_ids=None, attention_mask=None, position_ids=None,
                            past_key_values=None, inputs_embeds=None, use_cache=None,
                            output_attentions=None, output_hidden_states=None, return_dict=None,
                            cache_position=None, stage_manager=None, hidden_states=None,
                            stage_index=None, shard_config=None, force_sp_gather=True):
        _tensor_parallel_only(stage_manager, shard_config)
        return modeling_llama.LlamaModel.forward(
            self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, use_cache=False)

    def llama_for_causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None,
                                    past_key_values=None, inputs_embeds=None, labels=None,
                                    use_cache=None, output_attentions=None, output_hidden_states=None,
                                    return_dict=None, cache_position=None, stage_manager=None,
                                    hidden_states=None, stage_index=None, shard_config=None, **kwargs):
        _tensor_parallel_only(stage_manager, shard_config)
        outputs = modeling_llama.LlamaModel.forward(
            self.model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, use_cache=False)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = dist_cross_entropy(labels, logits, shard_config, self.lm_head.out_features, self.model.dtype)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    for fn in (llama_model_forward, llama_for_causal_lm_forward):
        setattr(fn, _MARK, True)
        setattr(LlamaPipelineForwards, fn.__name__, staticmethod(fn))
