"""The Hugging Face families jaxformer reads and writes, a module each, and their registry.

A family's module holds three functions: `_X_config` (config.json -> `ModelConfig` fields), `_X_hf`
(`ModelConfig` -> config.json fields) and `_X_rules` (`ModelConfig` -> one `Rule` per checkpoint
tensor, `jaxformer.interop.rules`). Adding a family is adding its module here and its row in
`FAMILIES` (its model_type, the base model's prefix, the tensors it ignores), and in `PEFT_MODULES`
when PEFT adapters of it are read. A family that changes one part of another reuses the other's
functions: Mixtral is Llama with experts in the feed-forward, Switch Transformers is T5 with them, and
Qwen 2, Qwen 3 and Qwen 3 MoE are Llama with q, k, v biases, QK-norm, and many small experts;
Gemma 3 reuses Llama's feed-forward rules, DeepSeek-V3 them for its first dense layers.
"""

from jaxformer.interop.families.bart import _bart_config, _bart_hf, _bart_rules
from jaxformer.interop.families.bert import _bert_config, _bert_hf, _bert_rules
from jaxformer.interop.families.common import Family
from jaxformer.interop.families.deepseek import _deepseek_config, _deepseek_hf, _deepseek_rules
from jaxformer.interop.families.gemma import (
    _gemma2_config,
    _gemma2_hf,
    _gemma2_rules,
    _gemma3_config,
    _gemma3_hf,
    _gemma3_rules,
)
from jaxformer.interop.families.gpt2 import _gpt2_config, _gpt2_hf, _gpt2_rules
from jaxformer.interop.families.llama import _llama_config, _llama_hf, _llama_rules
from jaxformer.interop.families.mixtral import _mixtral_config, _mixtral_experts, _mixtral_hf
from jaxformer.interop.families.qwen import (
    _qwen2_config,
    _qwen2_hf,
    _qwen2_rules,
    _qwen3_config,
    _qwen3_hf,
    _qwen3_moe_config,
    _qwen3_moe_hf,
    _qwen3_moe_rules,
    _qwen3_rules,
)
from jaxformer.interop.families.switch import _switch_config, _switch_ffn, _switch_hf
from jaxformer.interop.families.t5 import _t5_config, _t5_hf, _t5_rules

LLAMA_IGNORED = (r"rotary_emb\.inv_freq$", r"^lm_head\.weight$")  # a buffer; the tied output's copy
TIED_COPIES = (r"^(model\.)?(encoder|decoder)\.embed_tokens\.weight$", r"^lm_head\.weight$")
FAMILIES = {
    "gpt2": Family("gpt2", "transformer.", _gpt2_config, _gpt2_hf, _gpt2_rules,
                   ignore=(r"\.attn\.(masked_)?bias$", r"^lm_head\.weight$")),
    "llama": Family("llama", "model.", _llama_config, _llama_hf, _llama_rules,
                    ignore=(r"rotary_emb\.inv_freq$", r"^lm_head\.weight$")),
    "bert": Family("bert", "bert.", _bert_config, _bert_hf, _bert_rules,
                   ignore=(r"position_ids$", r"^cls\.seq_relationship\.", r"^cls\.predictions\.decoder\.",
                           r"^bert\.pooler\.")),
    "bart": Family("bart", "model.", _bart_config, _bart_hf, _bart_rules, ignore=TIED_COPIES),
    "t5": Family("t5", "", _t5_config, _t5_hf, _t5_rules, ignore=TIED_COPIES),
    "mixtral": Family("mixtral", "model.", _mixtral_config, _mixtral_hf,
                      lambda cfg: _llama_rules(cfg, _mixtral_experts),
                      ignore=(r"rotary_emb\.inv_freq$", r"^lm_head\.weight$")),
    "qwen2": Family("qwen2", "model.", _qwen2_config, _qwen2_hf, _qwen2_rules, ignore=LLAMA_IGNORED),
    "qwen3": Family("qwen3", "model.", _qwen3_config, _qwen3_hf, _qwen3_rules, ignore=LLAMA_IGNORED),
    "qwen3_moe": Family("qwen3_moe", "model.", _qwen3_moe_config, _qwen3_moe_hf, _qwen3_moe_rules,
                        ignore=LLAMA_IGNORED),
    "gemma3_text": Family("gemma3_text", "model.", _gemma3_config, _gemma3_hf, _gemma3_rules, ignore=LLAMA_IGNORED),
    "gemma2": Family("gemma2", "model.", _gemma2_config, _gemma2_hf, _gemma2_rules, ignore=LLAMA_IGNORED),
    # the multi-token prediction layers' copies of the embedding and the output head
    "deepseek_v3": Family("deepseek_v3", "model.", _deepseek_config, _deepseek_hf, _deepseek_rules,
                          ignore=(*LLAMA_IGNORED, r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")),
    "switch_transformers": Family("switch_transformers", "", _switch_config, _switch_hf,
                                  lambda cfg: _t5_rules(cfg, _switch_ffn), ignore=TIED_COPIES),
}  # fmt: skip


# PEFT LoRA adapters: per family, each hub module peft adapts (as `target_modules` names it) and the
# jaxformer kernels it holds. A fused module (GPT-2's c_attn = q, k, v) carries one low-rank update of
# the fused kernel: it reads exactly as q, k and v adapters sharing one A; separate q, k, v adapters
# write exactly as one of rank n*R (A stacked, B block-diagonal) via peft's rank_pattern.
LLAMA_PEFT = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "gate_proj": ("wi_gate",),
              "up_proj": ("wi",), "down_proj": ("wo",)}  # fmt: skip
PEFT_MODULES = {
    "gpt2": {"c_attn": ("q", "k", "v"), "attn.c_proj": ("o",), "c_fc": ("wi",), "mlp.c_proj": ("wo",)},
    "llama": LLAMA_PEFT,
    # Qwen 2, 3 and Gemma 3 name their projections as Llama does (Qwen 2's q, k, v biases are not adapted).
    "qwen2": LLAMA_PEFT, "qwen3": LLAMA_PEFT, "gemma3_text": LLAMA_PEFT, "gemma2": LLAMA_PEFT,
    # BERT's attention output and FFN output are both "...output.dense": fuller names tell them apart here;
    # in peft's suffix matching "output.dense" takes both (save_peft writes a regex for the FFN's alone).
    "bert": {"query": ("q",), "key": ("k",), "value": ("v",), "attention.output.dense": ("o",),
             "intermediate.dense": ("wi",), "output.dense": ("wo",)},
    # BART and T5 name a projection alike in the encoder, the decoder and the cross-attention (lora.stacks).
    "bart": {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "out_proj": ("o",), "fc1": ("wi",),
             "fc2": ("wo",)},
    "t5": {"q": ("q",), "k": ("k",), "v": ("v",), "o": ("o",), "wi": ("wi",), "wi_0": ("wi_gate",),
           "wi_1": ("wi",), "wo": ("wo",)},  # wi_0 / wi_1: T5 v1.1's gated FFN (gate, up)
}  # fmt: skip
