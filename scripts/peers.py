"""Peer implementations for `benchmark.py --compare`, built at the same shapes as jaxformer's.

JAX peer: Hugging Face's Flax models, random-initialised from configs (no downloads) --
FlaxGPT2LMHeadModel (decoder_only), FlaxBartForConditionalGeneration (encoder_decoder),
FlaxBertForMaskedLM (encoder_only) -- trained with the same optax AdamW under jit.
Non-JAX peer: PyTorch's nn.Transformer family on CPU, run in a process of its own:

    python scripts/peers.py torch '{"mode": "decoder_only", "D": 256, "H": 4, "F": 1024, "L": 4, "V": 8192,
                                    "T": 128, "B": 16, "dropout": 0.1, "rounds": 3, "steps": 5}'   # prints JSON

Both need the `bench` extra (pip install -e .[bench]).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("USE_TORCH", "0")  # transformers must not import torch in the JAX process


# ----------------------------------------------------------------------------- Hugging Face Flax


def hf_flax(mode: str, a) -> tuple:
    """(model, params) of the Hugging Face Flax model of `mode` at the benchmark's shapes.

    Attention dropout is off in both implementations (jaxformer's default); residual and
    embedding dropout are `a.dropout`.
    """
    import transformers as hf

    shapes = {"vocab_size": a.vocab}
    if mode == "decoder_only":
        cfg = hf.GPT2Config(
            **shapes, n_positions=a.seq, n_embd=a.d_model, n_layer=a.layers, n_head=a.heads, n_inner=4 * a.d_model,
            resid_pdrop=a.dropout, embd_pdrop=a.dropout, attn_pdrop=0.0,
        )  # fmt: skip
        model = hf.FlaxGPT2LMHeadModel(cfg, input_shape=(1, a.seq), seed=0)
    elif mode == "encoder_decoder":
        cfg = hf.BartConfig(
            **shapes, d_model=a.d_model, encoder_layers=a.layers, decoder_layers=a.layers,
            encoder_attention_heads=a.heads, decoder_attention_heads=a.heads, encoder_ffn_dim=4 * a.d_model,
            decoder_ffn_dim=4 * a.d_model, max_position_embeddings=a.seq, dropout=a.dropout, attention_dropout=0.0,
            activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
            forced_eos_token_id=None,
        )  # fmt: skip
        model = hf.FlaxBartForConditionalGeneration(cfg, input_shape=(1, a.seq), seed=0)
    else:
        cfg = hf.BertConfig(
            **shapes, hidden_size=a.d_model, num_hidden_layers=a.layers, num_attention_heads=a.heads,
            intermediate_size=4 * a.d_model, max_position_embeddings=a.seq, hidden_dropout_prob=a.dropout,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model = hf.FlaxBertForMaskedLM(cfg, input_shape=(1, a.seq), seed=0)
    return model, model.params


def hf_flax_train_step(mode: str, model, optimizer):
    """A jitted AdamW step on the peer: mean cross-entropy over all target positions."""
    import jax
    import optax

    def loss_fn(params, batch, rng):
        if mode == "encoder_decoder":
            out = model(
                input_ids=batch["src"], decoder_input_ids=batch["inputs"], params=params, dropout_rng=rng, train=True
            )
        else:
            out = model(input_ids=batch["inputs"], params=params, dropout_rng=rng, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["targets"]).mean()

    def step(state, batch):
        params, opt_state, rng = state
        rng, dropout_rng = jax.random.split(rng)
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, dropout_rng)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, rng), loss

    return jax.jit(step, donate_argnums=0)


def hf_flax_greedy(model, params, prompt, num_new: int):
    """Jitted greedy `generate` of the peer (decoder_only): the output ids."""
    import jax

    def run(params, prompt):
        out = model.generate(
            prompt, params=params, max_new_tokens=num_new, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        return out.sequences

    return jax.jit(run), params, prompt


# ----------------------------------------------------------------------------- PyTorch


def torch_peer(
    mode: str, D: int, H: int, F: int, L: int, V: int, T: int, B: int, dropout: float, rounds: int, steps: int
):
    """Median step time of PyTorch's nn.Transformer modules with AdamW, per round."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layer = dict(d_model=D, nhead=H, dim_feedforward=F, dropout=dropout, batch_first=True)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, D)
            self.pos = nn.Embedding(T, D)
            if mode == "encoder_decoder":
                self.core = nn.Transformer(num_encoder_layers=L, num_decoder_layers=L, **layer)
            else:
                self.core = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), L, enable_nested_tensor=False)
            self.head = nn.Linear(D, V)

        def forward(self, src, tgt):
            pos = self.pos(torch.arange(T))
            if mode == "encoder_decoder":
                causal = nn.Transformer.generate_square_subsequent_mask(T)
                h = self.core(self.embed(src) + pos, self.embed(tgt) + pos, tgt_mask=causal, tgt_is_causal=True)
            elif mode == "decoder_only":
                causal = nn.Transformer.generate_square_subsequent_mask(T)
                h = self.core(self.embed(tgt) + pos, mask=causal, is_causal=True)
            else:
                h = self.core(self.embed(tgt) + pos)
            return self.head(h)

    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    src, tgt, targets = (torch.randint(4, V, (B, T), generator=g) for _ in range(3))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(src, tgt).reshape(-1, V), targets.reshape(-1))
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t) / steps)
    return {"step_s": statistics.median(times), "threads": torch.get_num_threads(), "version": torch.__version__}


def torch_gpt2(D: int, H: int, L: int, V: int, T: int, B: int, rounds: int, steps: int) -> dict:
    """Hugging Face PyTorch GPT-2 (no dropout) + torch.compile, bfloat16 autocast over float32 weights,
    fused AdamW: median step time per round and peak CUDA memory. Needs a CUDA device."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=V, n_positions=T, n_embd=D, n_layer=L, n_head=H, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    ids = torch.randint(4, V, (B, T), device="cuda")

    @torch.compile
    def loss_fn(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(ids, labels=ids).loss

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(ids).backward()
        opt.step()

    for _ in range(3):  # compiles
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / steps)
    return {
        "step_s": statistics.median(times), "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
        "version": torch.__version__,
    }  # fmt: skip


if __name__ == "__main__":
    peers = {"torch": torch_peer, "torch_gpt2": torch_gpt2}
    if sys.argv[1] not in peers:
        raise SystemExit(__doc__)
    print(json.dumps(peers[sys.argv[1]](**json.loads(sys.argv[2]))))
