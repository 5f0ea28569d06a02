"""translate_en_de with Switch Transformer feed-forwards: top-1 routing in every other layer.

    jaxformer train --config experiments/switch_translate.py --workdir runs/switch_translate

Switch (Fedus et al. 2021) in the encoder-decoder: the FFN of every second layer of both stacks is
8 experts as wide as the dense FFN (d_ff=768), each token sent to its single most probable expert
(gate = that probability), so a token meets as many FFN parameters as in translate_en_de.py, its
dense counterpart of equal *active* parameters:
    jaxformer train --config experiments/translate_en_de.py --workdir runs/translate_en_de
Capacity factor 1.25 (tokens past an expert's slots pass through the residual), router jitter
0.01, load-balancing loss 1e-2 and z-loss 1e-3. Eval and translate as for translate_en_de.py.

Time and output: 1500 steps; on 2 CPU cores its step ran at 0.81x the dense translate_en_de's
tokens/s (side by side), so about 1.2 s a step. As for translate_en_de, an early model prints
punctuation (`..`) rather than German: translations are worth reading at the end; after 250 steps
neither model translated yet (BLEU 0.02 here, 0.0 dense; docs/guides/moe.md).
"""

import dataclasses
import pathlib

from jaxformer.config import MoEConfig, load_experiment


def get_config():
    dense = load_experiment(str(pathlib.Path(__file__).with_name("translate_en_de.py")))
    moe = MoEConfig(
        num_experts=8,
        experts_per_token=1,  # Switch: top-1
        every=2,  # layers 1, 3, ... of each stack (the dense config's scan_layers is off)
        router="softmax_topk",
        capacity_factor=1.25,
        router_noise=0.01,
        z_loss_weight=1e-3,
        aux_loss_weight=1e-2,
    )
    return dataclasses.replace(dense, model=dense.model.replace(moe=moe))
