"""The output heads: vocabulary logits (`LMHead`, tied or not), BERT's masked-LM head and the
sequence classifier.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxformer import functional as F
from jaxformer.config import ModelConfig
from jaxformer.layers import Embed, Norm, adapted, param
from jaxformer.sharding import constrain
from jaxformer.stacks import default_positions

Array = jax.Array
init = nnx.initializers


class LMHead(nnx.Module):
    """Vocabulary logits [B, T, V]: tied to an embedding (x E^T, times D^-0.5 first with
    `scale_tied_logits`) or an untied kernel; plus a bias with `logits_bias`; soft-capped with
    `final_logit_softcap`.

    Args:
        cfg: the model's config.
        tied_to: the embedding whose matrix gives the logits, or None for a kernel of its own.
        bias: a vocabulary bias.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, tied_to: Embed | None, *, bias: bool = False, rngs: nnx.Rngs):
        self.cfg = cfg
        self.tied_to = tied_to
        if tied_to is None:
            self.kernel = param(rngs, init.xavier_uniform(), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))
        if bias:
            self.bias = param(rngs, init.zeros, (cfg.vocab_size,), ("vocab",))

    def __call__(self, x_BTD: Array, log_softmax: bool = False) -> Array:
        """Hidden states to vocabulary logits.

        Args:
            x_BTD: [B, T, D] final hidden states.
            log_softmax: return log-probabilities in float32 (the paper's Generator) instead of logits.

        Returns:
            [B, T, V] logits in the compute dtype, or log-probabilities in float32.
        """
        dt = self.cfg.dtype
        if self.tied_to is not None:
            logits_BTV = self.tied_to.attend(x_BTD * self.cfg.d_model**-0.5 if self.cfg.scale_tied_logits else x_BTD)
        else:
            logits_BTV = jnp.einsum("BTD,DV->BTV", x_BTD, self.kernel[...].astype(dt))
            logits_BTV = constrain(adapted(self, "kernel", x_BTD, logits_BTV, None), ("batch", "length", "vocab"))
        if hasattr(self, "bias"):
            logits_BTV = logits_BTV + F.lift(self.bias[...].astype(dt), logits_BTV)
        if cap := self.cfg.final_logit_softcap:  # Gemma 2's soft cap: c * tanh(logits / c), in float32
            logits_BTV = (cap * jnp.tanh(logits_BTV.astype(jnp.float32) / cap)).astype(logits_BTV.dtype)
        # The paper's Generator: log-softmax, in float32.
        return jax.nn.log_softmax(logits_BTV.astype(jnp.float32)) if log_softmax else logits_BTV


class MaskedLMHead(nnx.Module):
    """BERT's masked-LM head: dense D->D, GELU (exact if the model's is), norm, then vocabulary
    logits plus a bias.

    Args:
        cfg: the model's config.
        tied_to: the embedding whose matrix gives the logits, or None.
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, tied_to: Embed | None, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.transform = param(rngs, init.xavier_uniform(), (cfg.d_model, cfg.d_model), ("embed", "mlp"))
        self.transform_bias = param(rngs, init.zeros, (cfg.d_model,), ("mlp",))
        self.norm = Norm(cfg, rngs=rngs)
        self.decoder = LMHead(cfg, tied_to, rngs=rngs)
        self.bias = param(rngs, init.zeros, (cfg.vocab_size,), ("vocab",))

    def __call__(self, x_BTD: Array) -> Array:
        """Hidden states to masked-LM logits.

        Args:
            x_BTD: [B, T, D] the encoder's final hidden states.

        Returns:
            [B, T, V] logits.
        """
        dt = self.cfg.dtype
        act = F.gelu_exact if self.cfg.activation == "gelu_exact" else F.gelu
        h_BTD = jnp.einsum("BTD,DE->BTE", x_BTD, self.transform[...].astype(dt))
        h_BTD = self.norm(act(h_BTD + F.lift(self.transform_bias[...].astype(dt), h_BTD)))
        logits_BTV = self.decoder(h_BTD)
        return logits_BTV + F.lift(self.bias[...].astype(dt), logits_BTV)


class ClassificationHead(nnx.Module):
    """Sequence classification: pool ([CLS] token or masked mean), dense + tanh, dropout, logits [B, C];
    packed rows (`segments_BS`) pool each segment: logits [B, N, C].

    Args:
        cfg: the model's config (num_classes C, pooling).
        rngs: the initialisation keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.pooler = param(rngs, init.xavier_uniform(), (cfg.d_model, cfg.d_model), ("embed", "mlp"))
        self.pooler_bias = param(rngs, init.zeros, (cfg.d_model,), ("mlp",))
        self.out = param(rngs, init.xavier_uniform(), (cfg.d_model, cfg.num_classes), ("embed", None))
        self.out_bias = param(rngs, init.zeros, (cfg.num_classes,), (None,))

    def __call__(
        self,
        x_BSD: Array,
        lengths_B: Array | None,
        dropout_rng: Array | None = None,
        segments_BS: Array | None = None,
        num_segments: int = 0,
    ) -> Array:
        """Pools each row (or each packed segment) and maps it to class logits.

        Args:
            x_BSD: [B, S, D] the encoder's final hidden states.
            lengths_B: [B] the rows' lengths (mean pooling skips padding), or None.
            dropout_rng: the dropout key, or None for no dropout.
            segments_BS: [B, S] segment ids of packed rows (0 = padding), or None.
            num_segments: N, the most segments a packed row holds (with `segments_BS`).

        Returns:
            [B, C] logits; packed rows: [B, N, C].
        """
        cfg, dt = self.cfg, self.cfg.dtype
        if segments_BS is not None:
            pooled_BD = F.segment_pool(x_BSD, segments_BS, num_segments, cfg.pooling).astype(dt)  # [B, N, D]
        elif cfg.pooling == "first":
            pooled_BD = x_BSD[:, 0]
        else:
            live_BS1 = (default_positions(x_BSD[..., 0]) < lengths_B[:, None])[..., None].astype(jnp.float32)
            total_BD = (x_BSD.astype(jnp.float32) * live_BS1).sum(1)
            pooled_BD = (total_BD / jnp.maximum(live_BS1.sum(1), 1.0)).astype(dt)
        h_BD = pooled_BD @ self.pooler[...].astype(dt)
        h_BD = jnp.tanh(h_BD + F.lift(self.pooler_bias[...].astype(dt), h_BD))
        h_BD = F.dropout(h_BD, cfg.dropout_rate, dropout_rng)
        logits_BC = h_BD @ self.out[...].astype(dt)
        return logits_BC + F.lift(self.out_bias[...].astype(dt), logits_BC)
