"""Every mode pipelined over 2 stages of 8 CPU devices against one device: the first batch's loss and
gradients, GPipe beside data=4, interleaved (2 chunks a stage) beside fsdp=2 x tensor=2 and 1F1B beside
data=4 (decoder_only and encoder_only), 4 scanned layers a stack, 2 micro-batches, float32, and the three
schedules again for a decoder of multi-head latent attention (`model.mla`). The suite runs three of these
cases (tests/test_sharding.py); this runs all eleven (a few minutes of compiling on a CPU).

    python scripts/pipeline_check.py

Prints one line per case: the relative error of the loss and the largest of the gradients', and the
collective permutes of the compiled program.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
from pipeline_common import loss_and_grads, worst_gradient_error  # beside this file

from jaxformer import config as C

B, T = 8, 8
CASES = {
    "gpipe_dp4": dict(stage=2, data=4),
    "interleaved_fsdp2_tp2": dict(stage=2, virtual_stages=2, fsdp=2, tensor=2),
    "1f1b_dp4": dict(stage=2, data=4, schedule="1f1b"),  # not encoder_decoder (Config refuses it)
}


MLA = C.MLAConfig(kv_lora_rank=8, q_lora_rank=6, rope_head_dim=4, nope_head_dim=6, v_head_dim=10)


def config(mode: str, mesh: dict) -> C.Config:
    mode, latent = mode.removesuffix("+mla"), mode.endswith("+mla")
    objective = {"decoder_only": "lm", "encoder_decoder": "seq2seq", "encoder_only": "mlm"}[mode]
    model = C.tiny(mode, vocab_size=64, d_model=32, num_heads=4, d_ff=64, dropout_rate=0.0, check_token_ids=False)
    if latent:  # latent attention's own projections: no biases, RoPE on its decoupled dims
        model = model.replace(mla=MLA, position="rope", use_bias=False)
    layers = {n: 4 if getattr(model, n) else 0 for n in ("num_encoder_layers", "num_decoder_layers")}
    return C.Config(
        model=model.replace(scan_layers=True, **layers),
        data=C.DataConfig(max_len=T),
        train=C.TrainConfig(objective=objective, batch_size=B, grad_accum=2),
        mesh=C.MeshConfig(**{"data": 1} | mesh),
    )


def main() -> None:
    for mode in ("decoder_only", "encoder_only", "encoder_decoder", "decoder_only+mla"):
        _, ref_loss, ref_grads = loss_and_grads(config(mode, {}), jax.devices()[:1])
        for name, mesh in CASES.items():
            if mode == "encoder_decoder" and mesh.get("schedule") == "1f1b":
                continue
            step, loss, grads = loss_and_grads(config(mode, mesh))
            worst, permutes = worst_gradient_error(grads, ref_grads), step.as_text().count(" collective-permute")
            print(f"{mode:16s} {name:22s} loss {abs(loss - ref_loss) / abs(ref_loss):.1e}  "
                  f"gradients {worst:.1e}  permutes {permutes}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
