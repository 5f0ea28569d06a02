"""The run's config (Config): one section each of model, train, data, checkpoint, mesh, decode,
lora and grpo, and what the sections ask of one another (an objective and its mode, the batch over the mesh,
context parallelism and the ring's kernels, the tokenizer against the vocabulary); SECTIONS by name."""

from __future__ import annotations

import dataclasses

from jaxformer.config.architecture import ModelConfig
from jaxformer.config.base import require
from jaxformer.config.grpo import GRPOConfig, check_grpo
from jaxformer.config.lora import LoRAConfig, check_lora_fits
from jaxformer.config.preference import PreferenceConfig
from jaxformer.config.sections import (
    SYNTHETIC,
    CheckpointConfig,
    DataConfig,
    DecodeConfig,
    MeshConfig,
    TrainConfig,
)

SPLASH_TILE = 128  # splash attention's tiles: a block's lengths (and zig-zag's halves) are multiples of it


def ring_blocks_unfit(kernel: str, dtype, head_dim: int, q_block: int, kv_block: int) -> str | None:
    """Why the fused kernel `kernel` cannot attend the ring's blocks of q_block queries and kv_block
    keys, as far as their shapes and dtype tell (None: nothing here says it cannot). Config validation
    asks it before anything is built; `jaxformer.ring` asks it with the arrays, then (cuDNN) JAX's own
    checks of this machine (cuDNN present, the GPU's largest head dim).

    Args:
        kernel: "splash" or "cudnn" (any other name: None).
        dtype (str | numpy.dtype): the compute dtype.
        head_dim: K, the dimension of a head.
        q_block: the queries of one block (T / the context axis).
        kv_block: the keys of one block (S / the context axis).

    Returns:
        The reason, or None.
    """
    if kernel == "splash" and (q_block % SPLASH_TILE or kv_block % SPLASH_TILE):
        return (
            f"splash attention needs ring blocks of multiples of {SPLASH_TILE} positions, not {q_block} and {kv_block}"
        )
    if kernel == "cudnn":
        why = "cuDNN flash attention cannot attend the ring's blocks"
        if str(dtype) not in ("bfloat16", "float16"):
            return f"{why}: it computes in bfloat16 or float16, not {dtype} (model.dtype)"
        if head_dim % 8 or head_dim > 256:
            return f"{why}: the head dim must be <= 256 and a multiple of 8, but got {head_dim}"
        if q_block % 2 or kv_block % 2:
            return f"{why}: blocks of even lengths, not {q_block} and {kv_block}"
    return None


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run: model, optimisation, data, checkpoints, mesh, and how it generates."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    preference: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)  # `jaxformer grpo` only

    def __post_init__(self):
        objective, mode = self.train.objective, self.model.mode
        allowed = {
            "lm": "decoder_only",
            "seq2seq": "encoder_decoder",
            "mlm": "encoder_only",
            "classify": "encoder_only",
            "preference": ("decoder_only", "encoder_decoder"),  # a completion after its prompt, or from it
        }
        require(
            mode in ((allowed[objective],) if isinstance(allowed[objective], str) else allowed[objective]),
            "train.objective",
            f"objective={objective!r} needs model.mode={allowed[objective]!r}, got {mode!r}",
        )
        if objective == "preference":
            self._check_preference()
        if objective == "classify":
            require(self.model.num_classes > 0, "model.num_classes", "classification needs num_classes > 0")
            n = len(self.data.labels)
            classes = self.model.num_classes
            require(n <= classes, "data.labels", f"{n} labels but model.num_classes={classes}")
        d = self.data
        require(
            d.src_max_len is None
            or objective in ("seq2seq", "classify")
            or (objective == "preference" and self.model.mode == "encoder_decoder"),
            "data.src_max_len",
            f"objective={objective!r} reads no source (only seq2seq, classify and encoder_decoder preference do)",
        )
        require(
            not (d.pack and objective == "classify") or d.max_segments <= d.src_len,
            "data.max_segments",
            f"{d.max_segments} texts cannot share a row of {d.src_len} tokens",
        )
        needs = {"lm": 1, "mlm": 1, "seq2seq": 2, "classify": 2, "preference": 3}.get(objective)
        if (
            d.template != "none" and objective != "preference"
        ):  # instruction records: a prompt and a response, from the user's files
            require(
                objective in ("lm", "seq2seq"),
                "data.template",
                f"instruction data trains objective 'lm' or 'seq2seq', not {objective!r}",
            )
            require(d.source == "files", "data.template", f"needs data.source='files' (instruction records), "
                    f"not {d.source!r}")  # fmt: skip
            require(d.format != "text", "data.template", "plain text holds no prompt/response records: use JSONL")
            needs = 2
        require(
            not self.data.fields or needs is None or len(self.data.fields) == needs,
            "data.fields",
            f"objective={objective!r} reads {needs} field(s), got {self.data.fields}",
        )
        self._check_tokenizer()
        self._check_lora()
        self._check_deepseek()
        if self.grpo.enabled:
            check_grpo(self)
        m = self.mesh
        if m.data > 0 and m.fsdp > 0 and m.expert > 0:  # a fill (-1) is known only with the devices
            shards, names = m.data * m.fsdp * m.expert, "mesh.data x mesh.fsdp"
            sizes = f"{m.data} x {m.fsdp}" + (f" x {m.expert}" if m.expert > 1 else "")
            require(
                self.train.batch_size % shards == 0,
                "train.batch_size",
                f"batch_size={self.train.batch_size} does not divide over the batch shards "
                f"({names}{' x mesh.expert' if m.expert > 1 else ''} = {sizes})",
            )
        if m.expert != 1 and self.model.moe.enabled:
            require(
                m.expert == -1 or self.model.moe.num_experts % m.expert == 0,
                "mesh.expert",
                f"expert={m.expert} does not divide model.moe.num_experts={self.model.moe.num_experts}",
            )
        require(
            self.model.attention_dropout_rate == 0 or self.model.attention_impl in ("naive", "auto"),
            "model.attention_dropout_rate",
            f"attention_impl={self.model.attention_impl!r} (a fused kernel) applies no dropout to attention "
            f"probabilities: set it to 0 or attention_impl to 'naive' or 'auto'",
        )
        if m.context > 1:
            self._check_context()
        if m.stage > 1 or m.virtual_stages > 1 or m.schedule != "gpipe":
            self._check_stage()
        if self.model.position in ("sinusoidal", "learned"):
            require(
                self.data.max_len <= self.model.max_len,
                "data.max_len",
                f"data.max_len={self.data.max_len} exceeds model.max_len={self.model.max_len}",
            )
            require(
                d.src_len <= self.model.max_len,
                "data.src_max_len",
                f"data.src_max_len={d.src_len} exceeds model.max_len={self.model.max_len}",
            )

    def _check_deepseek(self) -> None:
        """Multi-token prediction trains a language model's extra modules; the balance bias is state the
        full train step updates."""
        model, t = self.model, self.train
        require(
            not t.mtp_weight or model.mtp_depth,
            "train.mtp_weight",
            f"mtp_weight={t.mtp_weight} weighs the multi-token prediction loss: set model.mtp_depth > 0",
        )
        require(
            not model.mtp_depth or t.objective == "lm",
            "model.mtp_depth",
            f"multi-token prediction is a language-model loss: objective 'lm', not {t.objective!r}",
        )
        require(
            not model.mtp_depth or self.mesh.context == 1,
            "model.mtp_depth",
            f"multi-token prediction shifts tokens along the sequence, which mesh.context={self.mesh.context} splits",
        )
        require(
            not (model.moe.enabled and model.moe.balance_rate and self.lora.enabled),
            "model.moe.balance_rate",
            "LoRA trains adapters alone: the routers' balance bias is part of the frozen base",
        )

    def _check_preference(self) -> None:
        """What preference pairs need of the data and mesh (`jaxformer.post_train`)."""
        d = self.data
        require(d.source == "files", "data.source", f"preference pairs are read from data.files (JSONL), not "
                f"{d.source!r}")  # fmt: skip
        require(d.format in ("auto", "jsonl"), "data.format", f"preference pairs are JSONL records, not {d.format!r}")
        require(d.tokenizer in ("byte", "hf"), "data.tokenizer", f"preference pairs use a tokenizer that needs no "
                f"training ('byte', or an imported model's 'hf'), not {d.tokenizer!r}")  # fmt: skip
        require(not d.pack, "data.pack", "preference pairs are not packed (a row holds one completion)")
        require(self.mesh.context == 1, "mesh.context", "preference pairs are not split over a context axis")

    def _check_context(self) -> None:
        """What context parallelism cannot split (ring attention takes no logits bias or dropout)."""
        m, model, d = self.mesh, self.model, self.data
        require(model.position != "relative", "mesh.context",
                "context parallelism takes no relative position bias (model.position='relative', T5)")  # fmt: skip
        require(model.attention_dropout_rate == 0, "mesh.context",
                "context parallelism applies no attention dropout: set model.attention_dropout_rate to 0")  # fmt: skip
        require(not model.mla.enabled, "mesh.context",
                "context parallelism has no latent attention (model.mla): its ring takes one head dim for keys and "
                "values")  # fmt: skip
        # Inside the ring cuDNN or splash attends each visiting block (ring.fused_kernel); the all-gather
        # strategy attends densely: a fused kernel asked for by name there is refused rather than
        # ignored ("auto" falls back to XLA's einsums, and says so).
        fused = model.attention_impl in ("cudnn", "splash")
        require(not fused or model.context_attention == "ring", "model.attention_impl",
                f"{model.attention_impl!r} attends the ring's blocks; model.context_attention='allgather' "
                "attends densely: use 'auto' or context_attention='ring'")  # fmt: skip
        for field, length in (("data.max_len", d.max_len), ("data.src_max_len", d.src_len)):
            require(length % m.context == 0, field, f"{length} is not divisible by mesh.context={m.context}")
        if fused:  # each attention's blocks (queries, keys) per device: the kernel named must take them all
            T, S = d.max_len // m.context, d.src_len // m.context
            blocks = {"decoder_only": [(T, T)], "encoder_only": [(S, S)]}.get(model.mode, [(S, S), (T, T), (T, S)])
            for q_block, kv_block in blocks:
                why = ring_blocks_unfit(model.attention_impl, model.dtype, model.dim_per_head, q_block, kv_block)
                require(why is None, "model.attention_impl", f"{model.attention_impl!r}: {why} (mesh.context="
                        f"{m.context}; 'auto' attends such blocks with XLA's einsums)")  # fmt: skip
        if model.context_layout == "zigzag":
            require(self.train.objective in ("lm", "seq2seq"), "model.context_layout",
                    f"zigzag balances causal attention; objective={self.train.objective!r} attends both ways: "
                    "use 'contiguous'")  # fmt: skip
            require(d.max_len % (2 * m.context) == 0, "data.max_len",
                    f"{d.max_len} is not divisible by 2 x mesh.context={m.context} (zigzag's 2n blocks)")  # fmt: skip

    def _check_stage(self) -> None:
        """What a pipeline over `mesh.stage` needs: scanned stacks it can split, enough micro-batches,
        micro-batches the batch axes divide, and none of the axes or layers it does not compose with."""
        m, model, t = self.mesh, self.model, self.train
        require(m.stage > 1 or m.virtual_stages == 1, "mesh.virtual_stages",
                f"virtual_stages={m.virtual_stages} needs mesh.stage > 1")  # fmt: skip
        require(m.stage > 1, "mesh.schedule", f"schedule={m.schedule!r} needs mesh.stage > 1")
        require(model.scan_layers, "model.scan_layers",
                f"mesh.stage={m.stage} splits a scanned stack's layers: set model.scan_layers=true")  # fmt: skip
        for name in ("num_encoder_layers", "num_decoder_layers"):
            layers = getattr(model, name)
            require(layers % (m.stage * m.virtual_stages) == 0, f"model.{name}",
                    f"{name}={layers} does not divide into mesh.stage x mesh.virtual_stages = "
                    f"{m.stage} x {m.virtual_stages} chunks of whole layers")  # fmt: skip
        require(t.grad_accum >= m.stage, "train.grad_accum",
                f"the pipeline runs train.grad_accum micro-batches: grad_accum={t.grad_accum} leaves stages of "
                f"mesh.stage={m.stage} idle; set it >= {m.stage}")  # fmt: skip
        if m.data > 0 and m.fsdp > 0:
            shards, micro = m.data * m.fsdp, t.batch_size // t.grad_accum
            require(micro % shards == 0, "train.batch_size",
                    f"a micro-batch of {micro} rows (batch_size={t.batch_size} / grad_accum={t.grad_accum}) "
                    f"does not divide over mesh.data x mesh.fsdp = {m.data} x {m.fsdp}")  # fmt: skip
        if m.schedule == "1f1b":  # its backward is the tail's summed loss: a token loss on one stack
            require(m.virtual_stages == 1, "mesh.schedule",
                    f"'1f1b' runs one chunk a stage: virtual_stages={m.virtual_stages} needs 'gpipe'")  # fmt: skip
            require(model.mode != "encoder_decoder", "mesh.schedule",
                    "'1f1b' pipelines one stack and its loss: mode='encoder_decoder' needs 'gpipe'")  # fmt: skip
            require(t.objective in ("lm", "mlm"), "mesh.schedule",
                    f"'1f1b' runs the token loss per micro-batch: objective={t.objective!r} needs 'gpipe'")  # fmt: skip
        for field, on in (("mesh.context", m.context > 1), ("mesh.expert", m.expert != 1),
                          ("model.moe", model.moe.enabled), ("lora.rank", self.lora.enabled),
                          ("train.objective", t.objective == "preference"),
                          ("model.mtp_depth", model.mtp_depth > 0)):  # fmt: skip
            require(not on, field, f"mesh.stage={m.stage}: pipelining does not compose with {field} (yet): "
                    "the pipeline supports the data, fsdp and tensor axes and dense layers")  # fmt: skip

    def _check_lora(self) -> None:
        """The rank against the widths of the projections adapted (known only with the model)."""
        lora, model = self.lora, self.model
        if not lora.enabled:
            return
        require(not model.mla.enabled, "lora.rank",
                "LoRA adapts q, k, v and o; latent attention (model.mla) has other projections (no adapters "
                "yet)")  # fmt: skip
        ffn = [t for t in lora.targets if t in ("wi", "wi_gate", "wo")]
        require(
            not (ffn and model.moe.enabled),
            "lora.targets",
            f"{', '.join(map(repr, ffn))}: LoRA on feed-forward kernels is not supported with model.moe "
            "(the experts' kernels are stacked [E, ...]); adapt the attention projections (q, k, v, o)",
        )
        require(
            not (lora.base == "int8" and model.moe.enabled),
            "lora.base",
            "'int8' cannot store the MoE layers' expert kernels (model.moe): use lora.base='compute'",
        )
        check_lora_fits(lora, model)

    def _check_tokenizer(self) -> None:
        """Token ids against the model: the tokenizers whose sizes are known without a corpus, and the
        synthetic tasks' lengths (their sequences are synthetic_len long, whatever data.max_len says)."""
        d, model = self.data, self.model
        synthetic = d.source in SYNTHETIC
        require(
            synthetic == (d.tokenizer == "symbols"),
            "data.tokenizer",
            f"data.source={d.source!r} is written in symbols: set data.tokenizer='symbols', not {d.tokenizer!r}"
            if synthetic
            else f"'symbols' is for the copy/reverse tasks, not data.source={d.source!r}",
        )
        if synthetic:
            require(
                self.train.objective == "seq2seq",
                "train.objective",
                f"data.source={d.source!r} is a seq2seq task, not objective={self.train.objective!r}",
            )
            require(
                d.synthetic_vocab <= model.vocab_size,
                "model.vocab_size",
                f"model.vocab_size={model.vocab_size} is below data.synthetic_vocab={d.synthetic_vocab} (pad 0, "
                f"bos 1, symbols 2..{d.synthetic_vocab - 1}): model.vocab_size must be >= {d.synthetic_vocab}",
            )
            require(
                d.synthetic_len <= model.max_len or model.position not in ("sinusoidal", "learned"),
                "data.synthetic_len",
                f"data.synthetic_len={d.synthetic_len} exceeds model.max_len={model.max_len} "
                f"(position={model.position!r} has a table of max_len positions)",
            )
        if d.tokenizer == "sentencepiece":  # SentencePiece makes exactly spm_vocab_size pieces, or fails
            require(
                d.spm_vocab_size <= model.vocab_size,
                "data.spm_vocab_size",
                f"data.spm_vocab_size={d.spm_vocab_size} exceeds model.vocab_size={model.vocab_size}",
            )

    def to_dict(self) -> dict:
        """The config as nested dicts of plain values (what config.json holds).

        Returns:
            section -> field -> value.
        """
        return dataclasses.asdict(self)


SECTIONS = {
    "model": ModelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "mesh": MeshConfig,
    "decode": DecodeConfig,
    "lora": LoRAConfig,
    "preference": PreferenceConfig,
    "grpo": GRPOConfig,
}
