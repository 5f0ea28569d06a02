"""The run's sections besides the model: how it trains (TrainConfig), what it reads (DataConfig),
what it saves (CheckpointConfig), how it generates (DecodeConfig) and the devices it runs on
(MeshConfig). Each checks its own fields; what one section asks of another, the run's Config does."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxformer.config.base import _as_tuples, check_field_types, require

SYNTHETIC = ("copy", "reverse")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the training loop."""

    # The loss; each needs its model.mode. preference: chosen/rejected pairs, the loss in `preference`.
    objective: Literal["lm", "seq2seq", "mlm", "classify", "preference"] = "lm"
    steps: int = 1000  # optimizer steps of the whole run (a resumed run goes on to this count)
    batch_size: int = 32  # global batch, in sequences
    grad_accum: int = 1  # micro-batches per step; batch_size must divide by it (mesh.stage > 1: the pipeline's)
    optimizer: Literal["adamw", "adam"] = "adamw"  # adam: the paper's, no weight decay
    learning_rate: float = 1e-3  # peak; for the noam schedule a multiplier on the paper's formula
    schedule: Literal["noam", "cosine", "constant"] = "cosine"  # noam: the paper's warmup then 1/sqrt(step)
    warmup_steps: int = 100  # steps of linear warmup from 0 (paper: 4000)
    b1: float = 0.9  # Adam's first-moment decay (paper: 0.9)
    b2: float = 0.98  # paper: 0.98
    eps: float = 1e-9  # paper: 1e-9
    weight_decay: float = 0.0  # AdamW decoupled decay; never applied to norms and biases
    clip_norm: float = 1.0  # global gradient-norm clipping; 0 disables
    label_smoothing: float = 0.0  # paper: 0.1
    z_loss: float = 0.0  # weight of log(Z)^2 on the softmax normaliser Z, keeps logits from drifting (PaLM: 1e-4)
    # lambda of multi-token prediction (model.mtp_depth; DeepSeek-V3: 0.3, then 0.1): the loss adds
    # mtp_weight / depth * the sum over the depth's modules of their cross-entropy
    mtp_weight: float = 0.0
    # The token loss (lm, seq2seq, mlm) a chunk of positions at a time: each chunk's logits are made, used
    # and dropped (and remade in the backward pass), so the whole [B, T, V] never exists; the same loss and
    # gradients for a little more time (the output layer's FLOPs x 4/3). loss_chunk: tokens per chunk on
    # each device (its rows of the micro-batch times a run of positions); 0 = never chunk; "auto" = chunk
    # only when the float32 logits a device holds, B x T x V x 4 bytes over the batch, context and
    # vocabulary shards, would exceed max_logits_mib, in chunks whose logits fit in it.
    loss_chunk: int | Literal["auto"] = "auto"
    max_logits_mib: float = 256.0  # "auto" chunks when a device's float32 logits would exceed this
    # The optimizer state (Adam's two moments, 8 bytes a parameter) in host memory (pinned_host) between
    # steps: each step copies it to the device for the update and back (host-device bandwidth every step);
    # the device holds it only while the step runs, from when the compiler schedules the copy. CPU: nothing moves.
    offload_optimizer: bool = False
    mlm_probability: float = 0.15  # BERT: 15% of tokens; 80% [MASK], 10% random, 10% unchanged
    seed: int = 0  # parameters' initialisation and every step's dropout / masking keys (folded in from the step)
    log_every: int = 25  # steps between metric lines (and TensorBoard points)
    eval_every: int = 250  # steps between evaluations on the validation split
    eval_batches: int = 16  # validation batches per evaluation (at most the split's)
    num_samples: int = 3  # samples (decoded as `decode` says) printed at each evaluation
    # lm-evaluation-harness tasks run at each evaluation and at the end (the `eval` extra), each metric logged
    # beside the loss as TASK/METRIC (`shakespeare_cloze/acc`), which a sweep can optimise; lm and seq2seq only
    evals: tuple[str, ...] = ()
    evals_limit: int = 0  # examples per task of train.evals (0: all): a task's cost at every evaluation
    peak_flops: float = 0.0  # one device's peak FLOP/s for MFU; 0 = jaxformer.chips' table, or a matmul probe
    # A step whose loss or gradient is NaN/inf: "stop" the run (the last good checkpoint is kept) or "skip" it
    # (parameters and optimizer state unchanged, counted as skipped_steps in the metrics) and go on.
    on_nonfinite: Literal["stop", "skip"] = "stop"

    def __post_init__(self):
        p = "train"
        object.__setattr__(self, "evals", _as_tuples(self.evals))  # JSON gives lists
        check_field_types(self, p)
        for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_every"):
            require(getattr(self, name) > 0, f"{p}.{name}", f"must be positive, got {getattr(self, name)}")
        require(self.evals_limit >= 0, f"{p}.evals_limit", f"must be >= 0 (0: every example), got {self.evals_limit}")
        require(
            not self.evals or self.objective in ("lm", "seq2seq"),
            f"{p}.evals",
            f"lm-eval tasks score text: objective lm or seq2seq, not {self.objective}",
        )
        require(self.steps < 2**31, f"{p}.steps", f"must be below 2**31 (the step counter is int32), got {self.steps}")
        require(
            self.batch_size % self.grad_accum == 0,
            f"{p}.grad_accum",
            f"grad_accum={self.grad_accum} does not divide batch_size={self.batch_size}",
        )
        require(0 < self.learning_rate < math.inf, f"{p}.learning_rate", f"must be positive, got {self.learning_rate}")
        for name in ("b1", "b2"):  # Adam's moment decays; NaN fails every comparison
            require(0 <= getattr(self, name) < 1, f"{p}.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        require(0 < self.eps < math.inf, f"{p}.eps", f"must be positive, got {self.eps}")
        require(self.warmup_steps >= 0, f"{p}.warmup_steps", "must be >= 0")
        require(0 <= self.label_smoothing < 1, f"{p}.label_smoothing", "must be in [0, 1)")
        require(0 <= self.mtp_weight < math.inf, f"{p}.mtp_weight", f"must be >= 0, got {self.mtp_weight}")
        require(
            self.loss_chunk == "auto" or self.loss_chunk >= 0,
            f"{p}.loss_chunk",
            f"must be tokens per chunk >= 0 (0 = never chunk) or 'auto', got {self.loss_chunk}",
        )
        require(
            0 < self.max_logits_mib < math.inf, f"{p}.max_logits_mib", f"must be positive, got {self.max_logits_mib}"
        )
        require(0 < self.mlm_probability < 1, f"{p}.mlm_probability", "must be in (0, 1)")
        require(self.clip_norm >= 0 and self.weight_decay >= 0, f"{p}.clip_norm", "clip_norm and weight_decay >= 0")
        require(
            self.eval_batches > 0,
            f"{p}.eval_batches",
            f"must be positive (batches per evaluation), got {self.eval_batches}",
        )
        require(self.num_samples >= 0, f"{p}.num_samples", f"must be >= 0, got {self.num_samples}")
        require(self.peak_flops >= 0, f"{p}.peak_flops", f"must be >= 0 (0 = chip table), got {self.peak_flops}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where examples come from and how they become token batches."""

    # A shipped corpus, a synthetic task (copy, reverse), or "files": the user's own `files`.
    source: Literal["shakespeare", "en_de", "lohelp_apps", "files", "copy", "reverse"] = "shakespeare"
    path: str | None = None  # a shipped corpus read from this file instead (same format)
    files: tuple[str, ...] = ()  # source="files": paths or glob patterns (`--set data.files=a.jsonl,b/*.jsonl`)
    format: Literal["auto", "text", "jsonl", "tsv", "parquet"] = "auto"  # auto: by the file name's extension
    text_unit: Literal["line", "paragraph"] = "line"  # plain text: one document per line or per paragraph
    # The names of the fields the objective reads in JSONL / TSV / Parquet; () = text (lm, mlm),
    # source,target (seq2seq), text,label (classify).
    fields: tuple[str, ...] = ()
    # Instruction data (data/templates.py): records {prompt, response} (data.fields renames them) or
    # {"messages": [...]}, written in this template; lm puts the loss on the response tokens only,
    # seq2seq reads the prompt as source and the response as target.
    template: Literal["none", "alpaca", "chatml"] = "none"
    labels: tuple[str, ...] = ()  # classify: the label set (index = class); () = the sorted labels found
    # Prepared (tokenized) corpora are kept here; None: WORKDIR/data. A shared directory lets runs reuse them.
    cache_dir: str | None = None
    prepare_workers: int = 0  # processes that tokenize (0 = one per core)
    # Training rows hold several examples (segment ids, per-segment positions; no attention across
    # them): lm/mlm documents in their windows, translation pairs and classification texts placed
    # first-fit per chunk of batches.
    pack: bool = False
    # Packed classification: at most this many texts share a row; labels are [B, max_segments]. Rows
    # close at this count, so it bounds how short texts fill a row (8 x 16 tokens fill 128).
    max_segments: int = 8
    prefetch: int = 2  # grain threads that read training batches ahead of the step (0: read in the loop)
    tokenizer: Literal["byte", "sentencepiece", "symbols", "hf"] = "byte"  # hf: WORKDIR/hf/tokenizer.json
    spm_vocab_size: int = 2000  # sentencepiece vocabulary (trained on the training split)
    spm_model_type: Literal["bpe", "unigram"] = "bpe"  # sentencepiece's algorithm
    max_len: int = 128  # tokens per sequence (LM window; source/target cap for pairs)
    # seq2seq / classification: the source (encoder input) width, None = max_len. Separate widths
    # (t5x's feature lengths) let a source width matched to the languages' ratio pack as tightly as
    # the target's; sources are cut to it when prepared.
    src_max_len: int | None = None
    too_long: Literal["truncate", "reject"] = "truncate"  # a record over the widths: cut, or fail naming it
    length_buckets: int = 4  # pairs/classification: batches cut to one of this many widths (1 = pad to max_len)
    max_examples: int = 0  # cap on records read (0 = all); keeps CPU runs small
    min_words: int | None = None  # drop records whose text has fewer words (None: en_de/lohelp 3, others 0)
    val_fraction: float = 0.05  # of the records, held out for evaluation during training
    test_fraction: float = 0.05  # of the records, held out for the final report and `jaxformer eval`
    split_seed: int = 0  # splits are a fixed function of this seed
    synthetic_vocab: int = 11  # copy/reverse: V = 11 as in the Annotated Transformer
    synthetic_len: int = 10  # copy/reverse: symbols per sequence

    def __post_init__(self):
        p = "data"
        for name in ("files", "fields", "labels"):  # JSON gives lists
            object.__setattr__(self, name, _as_tuples(getattr(self, name)))
        check_field_types(self, p)
        for name in ("files", "fields", "labels"):
            bad = [v for v in getattr(self, name) if not isinstance(v, str) or not v]
            require(not bad, f"{p}.{name}", f"must be non-empty strings, got {bad[0]!r}" if bad else "")
        require(self.source != "files" or bool(self.files), f"{p}.files", "source='files' needs data.files")
        require(not self.files or self.source == "files", f"{p}.files", f"needs source='files', not {self.source}")
        require(self.min_words is None or self.min_words >= 0, f"{p}.min_words", "must be >= 0")
        require(self.prepare_workers >= 0, f"{p}.prepare_workers", "must be >= 0")
        require(self.prefetch >= 0, f"{p}.prefetch", "must be >= 0")
        require(self.max_len > 1, f"{p}.max_len", f"must be > 1, got {self.max_len}")
        require(
            self.src_max_len is None or self.src_max_len > 1, f"{p}.src_max_len", f"must be > 1, got {self.src_max_len}"
        )
        require(self.max_segments > 0, f"{p}.max_segments", f"must be positive, got {self.max_segments}")
        require(self.spm_vocab_size > 8, f"{p}.spm_vocab_size", "must be > 8")
        require(self.max_examples >= 0, f"{p}.max_examples", "must be >= 0")
        require(self.length_buckets > 0, f"{p}.length_buckets", "must be positive")
        require(
            0 < self.val_fraction < 1 and 0 < self.test_fraction < 1 and self.val_fraction + self.test_fraction < 1,
            f"{p}.val_fraction",
            "val_fraction and test_fraction must be in (0, 1) and sum below 1",
        )
        require(self.synthetic_vocab > 3, f"{p}.synthetic_vocab", "must be > 3")
        require(self.synthetic_len > 0, f"{p}.synthetic_len", f"must be positive, got {self.synthetic_len}")

    @property
    def src_len(self) -> int:
        """The source width: src_max_len, or max_len when it is not set."""
        return self.max_len if self.src_max_len is None else self.src_max_len


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When to save and what to keep (orbax CheckpointManager in WORKDIR/checkpoints)."""

    every: int = 500  # save every N steps; also at the end and on SIGTERM
    keep: int = 3  # the last K checkpoints are kept
    best_metric: str | None = None  # e.g. "nll": also keep the best checkpoint by this eval metric
    best_mode: Literal["min", "max"] = "min"  # best_metric: lower (nll, loss) or higher (accuracy) is better
    async_save: bool = True  # write in the background; the step loop does not wait on disk

    def __post_init__(self):
        check_field_types(self, "checkpoint")
        require(self.every > 0, "checkpoint.every", f"must be positive, got {self.every}")
        require(self.keep > 0, "checkpoint.keep", f"must be positive, got {self.keep}")
        metrics = ("loss", "nll", "accuracy", "perplexity")
        require(
            self.best_metric is None or self.best_metric in metrics,
            "checkpoint.best_metric",
            f"{self.best_metric!r} is not an eval metric ({', '.join(metrics)})",
        )


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How text is generated: samples during training, evaluation, `jaxformer generate|translate`.

    The paper translates with beam 4, length penalty 0.6 and outputs up to input length + 50.
    """

    strategy: Literal["greedy", "sample", "beam"] = "greedy"  # the most likely token, a random one, or beam search
    max_new_tokens: int = 64  # decoder_only: tokens generated after the prompt
    extra_len: int = 50  # encoder_decoder: output up to source length + extra_len tokens (paper: 50)
    temperature: float = 1.0  # sample: logits / temperature
    top_k: int = 0  # sample: keep the k most likely tokens (0 = all)
    top_p: float = 1.0  # sample: keep the smallest set of most likely tokens with mass >= top_p (nucleus)
    min_p: float = 0.0  # sample: keep the tokens at least min_p times as likely as the likeliest (0 = all)
    beam_size: int = 4  # beam: hypotheses kept at each step (paper: 4)
    length_penalty: float = 0.6  # beam: GNMT alpha; score = log P / ((5 + length) / 6) ** alpha
    num_return: int = 1  # beam: the n best sequences returned (<= beam_size)
    use_cache: bool = True  # False recomputes the whole prefix at every step (the reference)
    seed: int = 0  # sample: the sampling key

    def __post_init__(self):
        p = "decode"
        check_field_types(self, p)
        require(self.max_new_tokens > 0, f"{p}.max_new_tokens", f"must be positive, got {self.max_new_tokens}")
        require(self.extra_len >= 0, f"{p}.extra_len", f"must be >= 0, got {self.extra_len}")
        require(self.temperature > 0, f"{p}.temperature", f"must be > 0, got {self.temperature}")
        require(self.top_k >= 0, f"{p}.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        require(0 < self.top_p <= 1, f"{p}.top_p", f"must be in (0, 1], got {self.top_p}")
        require(0 <= self.min_p <= 1, f"{p}.min_p", f"must be in [0, 1] (0 = off), got {self.min_p}")
        require(self.beam_size >= 1, f"{p}.beam_size", f"must be >= 1, got {self.beam_size}")
        require(self.length_penalty >= 0, f"{p}.length_penalty", f"must be >= 0, got {self.length_penalty}")
        require(
            1 <= self.num_return <= (self.beam_size if self.strategy == "beam" else 1),
            f"{p}.num_return",
            f"must be in [1, beam_size={self.beam_size}] for beam search, 1 otherwise; got {self.num_return}",
        )

    def replace(self, **changes) -> DecodeConfig:
        """The config with `changes` applied, validated again.

        Args:
            **changes (object): field=value pairs.

        Returns:
            A new DecodeConfig.

        Raises:
            ConfigError: a changed field's value is invalid.
        """
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh (axes stage, data, fsdp, expert, tensor, context) and the rules placing logical axes on it."""

    # Pipeline stages (docs/guides/pipeline.md): the scanned layer stacks split by layer over `stage`
    # devices, the batch run through them as train.grad_accum micro-batches; 1 = no pipeline.
    stage: int = 1
    virtual_stages: int = 1  # layer chunks per stage, visited in turn (interleaved, circular); 1 = GPipe
    # "1f1b": each micro-batch's backward starts as its forward ends (a stage holds at most 2 S - 1
    # micro-batches' inputs, GPipe all M of them); lm and mlm objectives, virtual_stages=1
    schedule: Literal["gpipe", "1f1b"] = "gpipe"
    data: int = -1  # data-parallel ways; -1 = all devices the other axes leave
    fsdp: int = 1  # FSDP (ZeRO-3) ways: parameters and optimizer state split, batch split too
    tensor: int = 1  # Megatron tensor-parallel ways
    expert: int = 1  # expert-parallel ways (model.moe): experts' kernels split by expert, batch split too
    context: int = 1  # context-parallel ways: each row's sequence split, attention by model.context_attention
    dcn_data: int = 1  # of `data`, ways across slices/hosts on the slower network (hybrid mesh)
    rules: Literal["default", "dp", "fsdp", "tp", "fsdp_tp"] = "default"  # logical axes -> mesh (sharding.RULES)
    custom_rules: tuple | None = None  # ((logical, mesh axis or axes or None), ...) replaces `rules`
    distributed: bool = False  # call jax.distributed.initialize (auto-detects on TPU pods and SLURM)
    coordinator_address: str | None = None  # host:port of process 0 (or JAX_COORDINATOR_ADDRESS)
    num_processes: int | None = None  # or JAX_NUM_PROCESSES
    process_id: int | None = None  # or JAX_PROCESS_ID

    def __post_init__(self):
        object.__setattr__(self, "custom_rules", _as_tuples(self.custom_rules))  # JSON gives lists
        check_field_types(self, "mesh")
        for name in ("stage", "virtual_stages", "context"):
            require(getattr(self, name) > 0, f"mesh.{name}", f"must be positive, got {getattr(self, name)}")
        for name in ("data", "fsdp", "tensor", "expert"):
            size = getattr(self, name)
            require(size == -1 or size > 0, f"mesh.{name}", f"must be positive or -1 (fill), got {size}")
        require(self.dcn_data > 0, "mesh.dcn_data", "must be positive")
        fills = [name for name in ("data", "fsdp", "tensor", "expert") if getattr(self, name) == -1]
        require(
            len(fills) <= 1,
            f"mesh.{fills[-1]}" if fills else "mesh",
            f"at most one of data, fsdp, tensor, expert may be -1 (fill), got {', '.join(fills)}",
        )
        require(
            self.data == -1 or self.data % self.dcn_data == 0,
            "mesh.dcn_data",
            f"dcn_data={self.dcn_data} does not divide mesh.data={self.data}",
        )
