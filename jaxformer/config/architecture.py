"""The model's architecture: ModelConfig (the `model` section), its mixture of experts, MoEConfig
(`model.moe`), and its multi-head latent attention, MLAConfig (`model.mla`): what the layers are built from."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxformer.config.base import check_field_types, require
from jaxformer.config.rope import RopeScalingConfig

MODES = ("encoder_only", "decoder_only", "encoder_decoder")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward (Shazeer et al. 2017; GShard; Switch; Mixtral): a router sends
    each token to `experts_per_token` of `num_experts` FFNs. num_experts=0 (the default) is dense.

    Overridden as `--set model.moe.num_experts=8`.
    """

    num_experts: int = 0  # E; 0 = every feed-forward is dense
    experts_per_token: int = 2  # top-k (Switch: 1, Mixtral: 2)
    every: int = 1  # layer i (from 0) is MoE when (i + 1) % every == 0 (Switch: 2, ST-MoE: 4); both stacks
    encoder_every: int | None = None  # the encoder's own period (Switch's steps may differ); None = every, 0 = none
    encoder_offset: int | None = None  # encoder layer i is MoE when i % encoder_every == this; None = period - 1
    decoder_every: int | None = None  # the decoder's own (a decoder-only model's stack); None = every, 0 = none
    decoder_offset: int | None = None  # decoder layer i is MoE when i % decoder_every == this; None = period - 1
    # softmax_topk: top-k of the softmax probabilities, kept as they are (Switch, GShard);
    # topk_softmax: softmax over the k largest logits (Mixtral); sigmoid_topk (DeepSeek-V3): sigmoid
    # scores, the k chosen by score + a balance bias (`router_bias`), weighted by their unbiased scores
    router: Literal["softmax_topk", "topk_softmax", "sigmoid_topk"] = "softmax_topk"
    normalize_topk: bool = True  # sigmoid_topk: the k weights divided by their sum (HF norm_topk_prob)
    routed_scaling: float = 1.0  # sigmoid_topk: the weights times this (HF routed_scaling_factor; V3: 2.5)
    # sigmoid_topk, group-limited top-k (HF n_group, topk_group; V3: 8, 4): the experts in num_groups
    # groups, a group scored by the sum of its two best biased scores; a token chooses among the experts
    # of its best groups_per_token groups alone (in DeepSeek-V3: at most 4 nodes per token)
    num_groups: int = 1
    groups_per_token: int = 1  # the best groups a token may choose its experts from (HF topk_group)
    # sigmoid_topk, aux-loss-free balancing (DeepSeek-V3 2.1.2; V3: 1e-3): after each optimizer step each
    # MoE layer's bias_e += balance_rate * sign(mean load - load_e), load = the step's tokens sent to e
    balance_rate: float = 0.0
    # the first k layers of each MoE stack are dense FFNs of model.d_ff (HF first_k_dense_replace; V3: 3);
    # `every`/offsets still count from layer 0: layer i is MoE when i >= first_dense and the pattern says so
    first_dense: int = 0
    # 0 = dropless (tokens sorted by expert, a grouped matmul); > 0: each expert takes at most
    # ceil(capacity_factor * T * k / E) tokens of a row, the rest skip the FFN (Switch: 1.25)
    capacity_factor: float = 0.0
    # > 0: each expert takes at most this many tokens of a row, whatever the row's length (Hugging Face
    # Switch Transformers' expert_capacity); instead of capacity_factor, which must then be 0
    expert_capacity: int = 0
    router_noise: float = 0.0  # Switch's jitter: router inputs times U(1 - eps, 1 + eps) while training
    z_loss_weight: float = 0.0  # router z-loss (ST-MoE: 1e-3): mean log(sum exp logits)^2
    aux_loss_weight: float = 0.0  # load-balancing loss (Switch: 1e-2): E * sum_e f_e P_e
    shared_experts: int = 0  # dense FFNs every token goes through beside its routed ones (DeepSeekMoE)
    expert_d_ff: int | None = None  # each expert's width; None = model.d_ff

    def __post_init__(self):
        p = "model.moe"
        check_field_types(self, p)
        require(self.num_experts >= 0, f"{p}.num_experts", f"must be >= 0 (0 = dense), got {self.num_experts}")
        require(self.every > 0, f"{p}.every", f"must be positive, got {self.every}")
        for stack in ("encoder", "decoder"):
            every, offset = getattr(self, f"{stack}_every"), getattr(self, f"{stack}_offset")
            require(
                every is None or every >= 0,
                f"{p}.{stack}_every",
                f"must be >= 0 (0 = no MoE layer in the {stack}), got {every}",
            )
            every = self.every if every is None else every
            require(
                offset is None or 0 <= offset < every,
                f"{p}.{stack}_offset",
                f"must be in [0, {stack}_every={every}) (layer i is MoE when i % {every} == offset), got {offset}"
                if every
                else f"{stack}_every=0 has no MoE layer to place; got offset {offset}",
            )
        require(self.shared_experts >= 0, f"{p}.shared_experts", f"must be >= 0, got {self.shared_experts}")
        require(
            self.expert_d_ff is None or self.expert_d_ff > 0,
            f"{p}.expert_d_ff",
            f"must be positive, got {self.expert_d_ff}",
        )
        for name in ("capacity_factor", "z_loss_weight", "aux_loss_weight"):
            value = getattr(self, name)
            require(0 <= value < math.inf, f"{p}.{name}", f"must be >= 0, got {value}")
        require(self.expert_capacity >= 0, f"{p}.expert_capacity", f"must be >= 0, got {self.expert_capacity}")
        require(
            not (self.expert_capacity and self.capacity_factor),
            f"{p}.expert_capacity",
            f"expert_capacity={self.expert_capacity} and capacity_factor={self.capacity_factor} both set the "
            "capacity: give one (the other 0)",
        )
        require(0 <= self.router_noise < 1, f"{p}.router_noise", f"must be in [0, 1), got {self.router_noise}")
        require(self.first_dense >= 0, f"{p}.first_dense", f"must be >= 0, got {self.first_dense}")
        require(
            0 < self.routed_scaling < math.inf, f"{p}.routed_scaling", f"must be positive, got {self.routed_scaling}"
        )
        require(
            0 <= self.balance_rate < math.inf, f"{p}.balance_rate", f"must be >= 0 (0 = off), got {self.balance_rate}"
        )
        require(self.num_groups >= 1, f"{p}.num_groups", f"must be >= 1, got {self.num_groups}")
        require(
            1 <= self.groups_per_token <= self.num_groups,
            f"{p}.groups_per_token",
            f"must be in [1, num_groups={self.num_groups}], got {self.groups_per_token}",
        )
        if self.router != "sigmoid_topk":  # DeepSeek-V3's routing options mean nothing to a softmax router
            for name, off in (("normalize_topk", True), ("routed_scaling", 1.0), ("num_groups", 1),
                              ("balance_rate", 0.0)):  # fmt: skip
                require(
                    getattr(self, name) == off,
                    f"{p}.{name}",
                    f"belongs to router='sigmoid_topk' (DeepSeek-V3), not router={self.router!r}",
                )
        if self.num_experts:
            require(
                1 <= self.experts_per_token <= self.num_experts,
                f"{p}.experts_per_token",
                f"must be in [1, num_experts={self.num_experts}], got {self.experts_per_token}",
            )
            G = self.num_groups
            require(
                self.num_experts % G == 0,
                f"{p}.num_groups",
                f"num_groups={G} does not divide num_experts={self.num_experts}",
            )
            per_group = self.num_experts // G
            require(
                G == 1 or per_group >= 2,
                f"{p}.num_groups",
                f"a group is scored by its two best experts: num_experts={self.num_experts} / num_groups={G} "
                f"leaves {per_group}",
            )
            require(
                self.experts_per_token <= self.groups_per_token * per_group,
                f"{p}.experts_per_token",
                f"{self.experts_per_token} experts cannot be chosen from groups_per_token={self.groups_per_token} "
                f"groups of {per_group}",
            )

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def layout(self, stack: Literal["encoder", "decoder"]) -> tuple[int, int]:
        """A stack's MoE layout: (every, offset), its layer i MoE when i % every == offset.

        Args:
            stack: "encoder" or "decoder" (a decoder-only model's stack is the decoder).

        Returns:
            (every, offset); every = 0 when the stack has no MoE layer (or MoE is off).
        """
        every = getattr(self, f"{stack}_every")
        every = self.every if every is None else every
        if not self.enabled or not every:
            return 0, 0
        offset = getattr(self, f"{stack}_offset")
        return every, every - 1 if offset is None else offset

    def is_moe_layer(self, stack: Literal["encoder", "decoder"], index: int) -> bool:
        """Whether layer `index` (from 0) of `stack` has the MoE feed-forward.

        Args:
            stack: "encoder" or "decoder".
            index: the layer's index in its stack.

        Returns:
            True for an MoE layer.
        """
        every, offset = self.layout(stack)
        return every > 0 and index >= self.first_dense and index % every == offset


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2, V3): keys and values come per head from a latent of C
    = `kv_lora_rank` dims, which is what decoding caches (with the R rope dims of the key, shared by
    the heads), instead of 2 * H * K values per token. kv_lora_rank=0 (the default) is ordinary attention.

    Overridden as `--set model.mla.kv_lora_rank=512`.
    """

    kv_lora_rank: int = 0  # C, the cached latent's width (DeepSeek-V3: 512); 0 = MLA off
    q_lora_rank: int = 0  # Cq, the queries' low-rank width (V3: 1536); 0 = queries straight from D (V2-Lite)
    rope_head_dim: int = 64  # R, decoupled RoPE dims per head; the key's R computed once for all heads
    nope_head_dim: int = 128  # query and key dims per head that carry no position
    v_head_dim: int = 128  # value dims per head

    def __post_init__(self):
        p = "model.mla"
        check_field_types(self, p)
        for name in ("kv_lora_rank", "q_lora_rank"):
            value = getattr(self, name)
            require(value >= 0, f"{p}.{name}", f"must be >= 0 (0 = off), got {value}")
        for name in ("rope_head_dim", "nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            require(value > 0, f"{p}.{name}", f"must be positive, got {value}")
        require(
            self.rope_head_dim % 2 == 0, f"{p}.rope_head_dim", f"RoPE needs an even width, got {self.rope_head_dim}"
        )
        require(
            not self.q_lora_rank or self.kv_lora_rank,
            f"{p}.q_lora_rank",
            f"compresses MLA's queries: set kv_lora_rank too (got q_lora_rank={self.q_lora_rank}, kv_lora_rank=0)",
        )

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key width, nope_head_dim + rope_head_dim."""
        return self.nope_head_dim + self.rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Transformer in one of three modes.

    Defaults are the paper's base model ("Attention Is All You Need", Table 3).
    """

    mode: Literal["encoder_only", "decoder_only", "encoder_decoder"] = "encoder_decoder"  # BERT, GPT, the paper / T5
    vocab_size: int = 37_000  # shared BPE vocabulary of the paper's WMT en-de model
    d_model: int = 512  # D
    num_heads: int = 8  # H
    num_kv_heads: int | None = None  # G; None = num_heads (multi-head), 1 = multi-query
    head_dim: int | None = None  # K; None = d_model // num_heads
    d_ff: int = 2048  # F
    num_encoder_layers: int = 6  # L of the encoder stack (paper N = 6); decoder_only has none
    num_decoder_layers: int = 6  # L of the decoder stack (paper N = 6); encoder_only has none
    max_len: int = 512  # longest sequence the positional encoding covers
    dropout_rate: float = 0.1  # residual and embedding dropout (paper P_drop)
    attention_dropout_rate: float = 0.0  # on attention weights (Annotated Transformer uses P_drop)
    # gelu: tanh approximation (GPT-2); gelu_exact: with erf (BERT, BART); swiglu, geglu: gated (Llama, T5 v1.1)
    activation: Literal["relu", "gelu", "gelu_exact", "swiglu", "geglu"] = "relu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # rmsnorm: no mean subtracted, no bias (T5, Llama)
    # post: LayerNorm(x + Sublayer(x)) as in the paper; pre: x + Sublayer(Norm(x)); sandwich: x +
    # Norm(Sublayer(Norm(x))), a norm on each sublayer's output too (Gemma 2, 3)
    norm_position: Literal["post", "pre", "sandwich"] = "post"
    norm_plus_one: bool = False  # rmsnorm scales by (1 + w), w stored and initialised at 0 (Gemma)
    norm_eps: float = 1e-6  # added to the variance inside every norm
    # relative: T5's bucketed relative-position bias on each stack's self-attention logits
    position: Literal["sinusoidal", "learned", "rope", "relative", "none"] = "sinusoidal"
    rope_base: float = 10_000.0  # rope: base of the rotary frequencies, base^(-2i/K) (Llama: 10000)
    # > 0: a local layer's query sees the `sliding_window` latest positions, itself included (Mistral, Gemma)
    sliding_window: int = 0
    # with sliding_window: layer i is global (the whole causal prefix) when (i + 1) % global_every == 0
    # (Gemma 3: 6, Gemma 2: 2), the others local; 0 = every layer local
    global_every: int = 0
    rope_local_base: float | None = None  # the local layers' RoPE base (Gemma 3: 10000); None = rope_base
    position_offset: int = 0  # learned: position p reads table row p + offset (BART: 2; max_len + offset rows)
    relative_buckets: int = 32  # relative: buckets of the bias table (T5: 32)
    relative_max_distance: int = 128  # relative: distances beyond this share the last bucket (T5: 128)
    embed_norm: bool = False  # a norm on the summed embeddings before the first layer (BERT, BART)
    type_vocab_size: int = 0  # encoder: > 0 adds token-type (sentence A/B) embeddings (BERT: 2)
    scale_attention: bool = True  # attention logits / sqrt(K); T5 folds the scale into its initialisation
    # the attention logits' scale instead (Gemma: query_pre_attn_scalar^-0.5); None: as scale_attention says
    attention_scale: float | None = None
    final_logit_softcap: float = 0.0  # > 0: logits = c * tanh(logits / c) (Gemma 2: 30); 0 = none
    # > 0: attention logits = c * tanh(logits / c) before the mask (Gemma 2: 50); the reference path alone
    attention_softcap: float = 0.0
    use_bias: bool = True  # biases in projections (the paper's linear layers have them)
    qkv_bias: bool = False  # biases on the query, key and value projections alone (Qwen 2), with use_bias=False
    # RMSNorm over each head's K on queries and keys, before RoPE (Qwen 3, Gemma 3): a [K] gain each
    qk_norm: bool = False
    share_embeddings: bool = True  # encoder and decoder input embeddings are one matrix
    tie_output: bool = True  # output logits use the (decoder) input embedding, transposed
    scale_embeddings: bool = True  # multiply embeddings by sqrt(D), paper section 3.4
    logits_bias: bool = False  # a bias on the decoder's vocabulary logits (BART's final_logits_bias)
    scale_tied_logits: bool = False  # tied output: multiply the final states by D^-0.5 first (T5 v1.0)
    num_classes: int = 0  # encoder_only: > 0 adds a sequence classification head
    pooling: Literal["first", "mean"] = "first"  # classification pooling: [CLS] token or masked mean
    pad_id: int = 0  # the padding token: written after EOS by decoding; a Hugging Face config's pad_token_id
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; parameters stay float32
    # auto: cuDNN flash attention on GPU, splash attention on TPU, XLA's fused attention elsewhere; with
    # mesh.context > 1 the same inside each ring block on GPU and TPU, XLA's einsums elsewhere
    attention_impl: Literal["naive", "auto", "xla", "cudnn", "splash"] = "naive"
    # With mesh.context > 1, attention over the split sequence: "ring" passes key/value blocks around
    # the context axis (never more than two on a device); "allgather" gathers them all first.
    context_attention: Literal["ring", "allgather"] = "ring"
    # How the steps lay a causal sequence over the context axis: "contiguous" blocks, or "zigzag" (each
    # device holds blocks i and 2n-1-i of 2n: the same share of the causal triangle, so no device idles).
    context_layout: Literal["contiguous", "zigzag"] = "contiguous"
    # float32 matmuls: "default" leaves JAX's setting (GPUs then use TF32, ~1e-3 off float32; TPUs
    # bfloat16 passes); "high" / "highest" ask for more. bfloat16 compute is unaffected.
    matmul_precision: Literal["default", "high", "highest"] = "default"
    scan_layers: bool = False  # one compiled layer body scanned over a stacked `layers` axis
    # What a layer keeps for the backward pass. "none": everything its backward reads; "dots_saveable":
    # matmul outputs, the elementwise rest recomputed; "full": nothing, the layer recomputed. "auto":
    # "dots_saveable" when scanned, "none" unrolled: a scan stores each kept value of every layer as a
    # loop output, and with "none" its temporaries were 1.5-2x the unrolled stack's once activations
    # dominate them (TPU compiler; docs/guides/accelerators.md, "Scanned layers"). Host offload (where
    # the backend has host memory it can copy to in the step: TPU, GPU; on CPU nothing moves):
    # "offload_dots" keeps what "dots_saveable" keeps in host memory; "offload_inputs" is "full" with
    # each layer's input kept there (docs/guides/long-context.md).
    remat: Literal["auto", "none", "full", "dots_saveable", "offload_dots", "offload_inputs"] = "auto"
    check_token_ids: bool = True  # reject ids outside [0, V): a host callback under jit; fit checks on the host
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)  # mixture of experts (num_experts=0: dense)
    # RoPE's frequencies stretched past the trained length (linear, yarn, llama3; kind="none": plain RoPE)
    rope_scaling: RopeScalingConfig = dataclasses.field(default_factory=RopeScalingConfig)
    # multi-token prediction (DeepSeek-V3 2.2; V3: 1): D extra modules, module k predicting token i + k + 1
    # from module k-1's states and the embedding of token i + k; training only (train.mtp_weight), decoder_only
    mtp_depth: int = 0
    mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)  # latent attention (kv_lora_rank=0: off)

    def __post_init__(self):
        p = "model"
        for name, cls in (("moe", MoEConfig), ("mla", MLAConfig), ("rope_scaling", RopeScalingConfig)):
            section = getattr(self, name)
            if isinstance(section, dict):  # JSON (a saved config) gives the section as an object
                known = {f.name for f in dataclasses.fields(cls)}
                for key in section:
                    require(key in known, f"{p}.{name}.{key}", f"unknown field (known: {', '.join(sorted(known))})")
                object.__setattr__(self, name, cls(**section))
        check_field_types(self, p)
        for name in ("vocab_size", "d_model", "num_heads", "d_ff", "max_len"):
            require(getattr(self, name) > 0, f"{p}.{name}", f"must be positive, got {getattr(self, name)}")
        for name in ("num_encoder_layers", "num_decoder_layers", "num_classes", "position_offset", "type_vocab_size"):
            require(getattr(self, name) >= 0, f"{p}.{name}", f"must be >= 0, got {getattr(self, name)}")
        if self.head_dim is None:
            require(
                self.d_model % self.num_heads == 0,
                f"{p}.num_heads",
                f"num_heads={self.num_heads} does not divide d_model={self.d_model} (or set head_dim)",
            )
        else:
            require(self.head_dim > 0, f"{p}.head_dim", f"must be positive, got {self.head_dim}")
        kv = self.kv_heads
        require(kv > 0, f"{p}.num_kv_heads", f"must be positive, got {kv}")
        require(
            self.num_heads % kv == 0,
            f"{p}.num_kv_heads",
            f"num_kv_heads={kv} does not divide num_heads={self.num_heads}",
        )
        for name in ("dropout_rate", "attention_dropout_rate"):
            rate = getattr(self, name)
            require(0.0 <= rate < 1.0, f"{p}.{name}", f"must be in [0, 1), got {rate}")
        require(
            not (self.qkv_bias and self.use_bias),
            f"{p}.qkv_bias",
            "use_bias=True already gives every projection a bias; qkv_bias adds them to q, k, v alone",
        )
        require(
            not self.norm_plus_one or self.norm == "rmsnorm",
            f"{p}.norm_plus_one",
            f"scales an RMSNorm by (1 + w): needs norm='rmsnorm', not {self.norm!r}",
        )
        require(self.sliding_window >= 0, f"{p}.sliding_window", f"must be >= 0 (0 = none), got {self.sliding_window}")
        require(self.global_every >= 0, f"{p}.global_every", f"must be >= 0, got {self.global_every}")
        if self.sliding_window:
            require(
                self.mode == "decoder_only",
                f"{p}.sliding_window",
                f"a window over the latest positions is a causal decoder's: mode={self.mode!r}",
            )
        else:
            require(
                not self.global_every, f"{p}.global_every", "places global layers among local ones: set sliding_window"
            )
        require(
            self.rope_local_base is None or (self.sliding_window > 0 and self.position == "rope"),
            f"{p}.rope_local_base",
            "is the local layers' RoPE base: needs position='rope' and sliding_window > 0",
        )
        require(
            not self.rope_scaling.enabled or self.position == "rope",
            f"{p}.rope_scaling.kind",
            f"{self.rope_scaling.kind!r} scales RoPE's frequencies: needs position='rope', not {self.position!r}",
        )
        require(
            self.rope_scaling.layers == "all" or self.sliding_window > 0,
            f"{p}.rope_scaling.layers",
            "'global' leaves the local layers unscaled: needs sliding_window > 0",
        )
        require(
            self.attention_scale is None or 0 < self.attention_scale < math.inf,
            f"{p}.attention_scale",
            f"must be positive (or None), got {self.attention_scale}",
        )
        require(
            0 <= self.final_logit_softcap < math.inf,
            f"{p}.final_logit_softcap",
            f"must be >= 0 (0 = none), got {self.final_logit_softcap}",
        )
        require(
            0 <= self.attention_softcap < math.inf,
            f"{p}.attention_softcap",
            f"must be >= 0 (0 = none), got {self.attention_softcap}",
        )
        require(self.norm_eps > 0, f"{p}.norm_eps", f"must be positive, got {self.norm_eps}")
        require(0 <= self.pad_id < self.vocab_size, f"{p}.pad_id", f"must be in [0, vocab_size={self.vocab_size})")
        if self.position == "sinusoidal":
            require(
                self.d_model % 2 == 0, f"{p}.d_model", f"sinusoidal positions need an even d_model, got {self.d_model}"
            )
        if self.position == "rope":
            require(
                self.dim_per_head % 2 == 0, f"{p}.head_dim", f"RoPE needs an even head dim, got {self.dim_per_head}"
            )
        require(
            self.position_offset == 0 or self.position == "learned",
            f"{p}.position_offset",
            f"an offset into the position table needs position='learned', not {self.position!r}",
        )
        if self.position == "relative":
            require(self.relative_buckets >= 4, f"{p}.relative_buckets", f"must be >= 4, got {self.relative_buckets}")
            require(
                self.relative_max_distance > self.relative_buckets // 2,
                f"{p}.relative_max_distance",
                f"must exceed relative_buckets // 2 = {self.relative_buckets // 2}, got {self.relative_max_distance}",
            )
        require(
            self.type_vocab_size == 0 or self.mode != "decoder_only",
            f"{p}.type_vocab_size",
            "token-type embeddings belong to an encoder; mode='decoder_only' has none",
        )
        require(
            not self.logits_bias or self.mode != "encoder_only",
            f"{p}.logits_bias",
            "mode='encoder_only': the masked-LM head always has its bias",
        )
        require(
            not self.scale_tied_logits or self.tie_output,
            f"{p}.scale_tied_logits",
            "rescales only tied output logits (tie_output=True)",
        )
        if self.mode in ("encoder_only", "encoder_decoder"):
            require(self.num_encoder_layers > 0, f"{p}.num_encoder_layers", f"mode={self.mode} needs an encoder")
        if self.mode in ("decoder_only", "encoder_decoder"):
            require(self.num_decoder_layers > 0, f"{p}.num_decoder_layers", f"mode={self.mode} needs a decoder")
        require(
            self.num_classes == 0 or self.mode == "encoder_only",
            f"{p}.num_classes",
            "a classification head needs mode='encoder_only'",
        )
        require(self.mtp_depth >= 0, f"{p}.mtp_depth", f"must be >= 0 (0 = none), got {self.mtp_depth}")
        require(
            not self.mtp_depth or self.mode == "decoder_only",
            f"{p}.mtp_depth",
            f"multi-token prediction extends a causal language model: needs mode='decoder_only', not {self.mode!r}",
        )
        for stack in self.stacks:
            if self.moe.first_dense and self.moe.layout(stack)[0]:
                layers = getattr(self, f"num_{stack}_layers")
                require(
                    self.moe.first_dense < layers,
                    f"{p}.moe.first_dense",
                    f"first_dense={self.moe.first_dense} leaves no MoE layer in the {stack}'s {layers} layers",
                )
        if self.mla.enabled:
            self._check_mla()
        N = self.scan_block
        if self.scan_layers and self.sliding_window and self.global_every:
            require(
                (self.num_decoder_layers - self.dense_head("decoder")) % N == 0,
                f"{p}.global_every",
                f"global_every={self.global_every} with scan_layers=True scans blocks of {N} layers: "
                f"{p}.num_decoder_layers={self.num_decoder_layers} (less moe.first_dense) is not a multiple; "
                "set scan_layers=False",
            )
        if self.scan_layers and N > 1:  # scanned in blocks of N layers: whole blocks only
            for stack in self.stacks:
                name, own = f"num_{stack}_layers", getattr(self.moe, f"{stack}_every")
                field, value = ("every", self.moe.every) if own is None else (f"{stack}_every", own)
                why = "" if self.moe.layout(stack)[0] == N else " (the least common multiple of the stacks' every)"
                head = self.dense_head(stack)
                require(
                    (getattr(self, name) - head) % N == 0,
                    f"{p}.moe.{field}",
                    f"{field}={value} with scan_layers=True scans blocks of {N} layers{why}: "
                    f"{p}.{name}={getattr(self, name)}{f' less first_dense={head}' if head else ''} is not a "
                    "multiple; set scan_layers=False",
                )

    def _check_mla(self) -> None:
        """What latent attention (`model.mla`) takes: its own RoPE dims, no biases or norms on q, k, v."""
        p = "model"
        refusals = (
            (
                "position",
                self.position != "rope",
                f"MLA's decoupled dims are rotary: needs 'rope', not {self.position!r}",
            ),
            ("use_bias", self.use_bias, "MLA's projections have no biases (DeepSeek): set use_bias=False"),
            ("qkv_bias", self.qkv_bias, "MLA's projections have no biases"),
            ("qk_norm", self.qk_norm, "MLA normalises its latents (q_norm, kv_norm), not each head's q and k"),
            ("sliding_window", self.sliding_window > 0, "MLA attends over the whole causal prefix (no window yet)"),
            ("attention_softcap", self.attention_softcap > 0, "MLA's logits are not soft-capped (yet)"),
            (
                "num_kv_heads",
                self.num_kv_heads not in (None, self.num_heads),
                "MLA's keys and values come per head from the latent: leave num_kv_heads unset",
            ),
        )
        for name, refused, why in refusals:
            require(not refused, f"{p}.{name}", f"{why} (model.mla.kv_lora_rank={self.mla.kv_lora_rank})")

    def is_local_layer(self, index: int) -> bool:
        """Whether decoder layer `index` (from 0) attends over a sliding window (`sliding_window`,
        `global_every`).

        Args:
            index: the layer's index in the decoder stack.

        Returns:
            True for a local (windowed) layer.
        """
        return self.sliding_window > 0 and not (self.global_every and (index + 1) % self.global_every == 0)

    def dense_head(self, stack: Literal["encoder", "decoder"]) -> int:
        """The dense layers a stack starts with (`moe.first_dense`), which a scanned stack runs unrolled
        before its scanned blocks; 0 when the stack has no MoE layer.

        Args:
            stack: "encoder" or "decoder".

        Returns:
            The number of leading dense layers.
        """
        return self.moe.first_dense if self.moe.layout(stack)[0] else 0

    @property
    def logits_scale(self) -> float | None:
        """The attention logits' scale: `attention_scale`, else None (K^-0.5) or 1 without `scale_attention`;
        times the RoPE scaling's `logits_factor` (a yarn mscale_all_dim: DeepSeek's softmax scale)."""
        factor = self.rope_scaling.logits_factor
        if self.attention_scale is not None:
            return self.attention_scale * factor
        if not self.scale_attention:
            return factor
        return None if factor == 1.0 else self.dim_per_head**-0.5 * factor

    @property
    def stacks(self) -> tuple[str, ...]:
        """The mode's layer stacks: ("encoder",), ("decoder",) or ("encoder", "decoder")."""
        return {"encoder_only": ("encoder",), "decoder_only": ("decoder",)}.get(self.mode, ("encoder", "decoder"))

    @property
    def scan_block(self) -> int:
        """Layers per block of a scanned stack: N when MoE takes every N-th layer (N - 1 dense layers and
        the MoE one scanned as one body), the least common multiple of the stacks' N when they differ
        (`moe.encoder_every`, `moe.decoder_every`) and of `global_every` with a sliding window, else 1
        (every layer alike)."""
        windows = self.global_every if self.sliding_window else 1  # local and global layers alternate
        return math.lcm(windows or 1, *(max(self.moe.layout(stack)[0], 1) for stack in self.stacks))

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim_per_head(self) -> int:
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    def replace(self, **changes) -> ModelConfig:
        """The config with `changes` applied, validated again.

        Args:
            **changes (object): field=value pairs.

        Returns:
            A new ModelConfig.

        Raises:
            ConfigError: a changed field's value is invalid.
        """
        return dataclasses.replace(self, **changes)
