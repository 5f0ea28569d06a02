"""The compiled preference step's memory with LoRA: the reference as the base without its adapters (what
`train.objective=preference` does) against a stored copy of the weights, and a full fine-tune's copy.

    python scripts/preference_memory.py [--d-model 512 --layers 8 --vocab 32000 --batch 8 --len 256]

Compiles each step for this machine (nothing runs) and prints `memory_analysis()`: argument bytes (the
state and the batch) and temporary bytes (what the step allocates), in MiB.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import Config, DataConfig, LoRAConfig, ModelConfig, PreferenceConfig, TrainConfig
from jaxformer.train import make_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8, help="pairs a step")
    p.add_argument("--len", type=int, default=256, help="positions a row")
    a = p.parse_args()
    model = ModelConfig(mode="decoder_only", vocab_size=a.vocab, d_model=a.d_model, num_heads=8, d_ff=4 * a.d_model,
                        num_encoder_layers=0, num_decoder_layers=a.layers, max_len=a.len, dtype="bfloat16",
                        dropout_rate=0.0)  # fmt: skip
    T, B = a.len, a.batch
    batch = {"inputs": jnp.ones((B, 2, T), jnp.int32), "targets": jnp.ones((B, 2, T), jnp.int32),
             "weights": jnp.ones((B, 2, T), jnp.float32)}  # fmt: skip
    mib = lambda n: f"{n / 2**20:,.1f}"
    rows = []
    for name, lora in (("LoRA, reference = base without adapters", 16), ("LoRA, reference = a stored copy", 16),
                       ("full, reference = a frozen copy", 0)):  # fmt: skip
        cfg = Config(
            model=model,
            data=DataConfig(source="files", files=("pairs.jsonl",), tokenizer="byte", max_len=T),
            train=TrainConfig(objective="preference", batch_size=B, num_samples=0),
            lora=LoRAConfig(rank=lora, targets=("q", "v")) if lora else LoRAConfig(),
            preference=PreferenceConfig(),
        )
        graphdef, state, optimizer = init_state_abstract(cfg)
        if "stored copy" in name:
            state = state.replace(reference=jax.tree.map(lambda x: x, state.weights))
        step = make_steps(graphdef, cfg, optimizer)[0]
        mem = jax.jit(step, donate_argnums=0).lower(state, batch).compile().memory_analysis()
        weights = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state.weights))
        rows.append((name, mib(weights), mib(mem.argument_size_in_bytes), mib(mem.temp_size_in_bytes)))
    print(f"D={a.d_model}, L={a.layers}, V={a.vocab}, {B} pairs of {T} positions, bfloat16 compute")
    print(f"{'':42s} {'weights':>9s} {'arguments':>10s} {'temporary':>10s}  (MiB)")
    for name, *figures in rows:
        print(f"{name:42s} " + " ".join(f"{f:>9s}" for f in figures))


def init_state_abstract(cfg):
    """(graphdef, the state's shapes, optimizer): nothing is allocated."""
    from jaxformer.state import state_factory

    graphdef, create, optimizer = state_factory(cfg)
    return graphdef, jax.eval_shape(create), optimizer


if __name__ == "__main__":
    main()
