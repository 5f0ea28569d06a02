"""mlm_shakespeare with mixture-of-experts feed-forwards (Mixtral-style routing), at the same active width.

    jaxformer train --config experiments/moe_mlm_shakespeare.py --workdir runs/moe_mlm_shakespeare

The encoder-only member of the MoE experiments (moe_shakespeare.py is decoder-only,
switch_translate.py encoder-decoder). Every layer's FFN becomes 8 experts of width 256, each token
taking the 2 best: 2 x 256 = 512 hidden units a token, as the dense mlm_shakespeare.py (d_ff=512),
so both have equal *active* parameters (the router's D x E aside). Its dense counterpart, run side
by side at equal steps:
    jaxformer train --config experiments/mlm_shakespeare.py --workdir runs/mlm_shakespeare
A capacity of 1.25, ST-MoE's z-loss and Switch's load-balancing loss at their papers' weights. The
loss counts the masked positions only, but every position is routed (and competes for capacity).

Time and output: 800 steps, as mlm_shakespeare; time not measured at the full schedule (300 steps
side by side with the dense run took 17 minutes on 2 CPU cores shared with other jobs, at 0.70x the
dense run's tokens/s; docs/guides/moe.md). The held-out masked-token loss and accuracy at the
evaluations of steps 400 and 800 are its output (there is no text to read).
"""

import dataclasses
import pathlib

from jaxformer.config import MoEConfig, load_experiment


def get_config():
    dense = load_experiment(str(pathlib.Path(__file__).with_name("mlm_shakespeare.py")))
    moe = MoEConfig(
        num_experts=8,
        experts_per_token=2,
        router="topk_softmax",  # Mixtral
        expert_d_ff=256,  # 2 experts x 256 = the dense d_ff of 512 per token
        capacity_factor=1.25,
        z_loss_weight=1e-3,  # ST-MoE
        aux_loss_weight=1e-2,  # Switch
    )
    return dataclasses.replace(dense, model=dense.model.replace(moe=moe))
