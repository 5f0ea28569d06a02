"""mlm_shakespeare with mixture-of-experts feed-forwards (Mixtral-style routing), at the same active width.

    jaxformer train --config experiments/moe_mlm_shakespeare.py --workdir runs/moe_mlm_shakespeare

The encoder-only member of the MoE experiments (moe_shakespeare.py is decoder-only,
switch_translate.py encoder-decoder). Every layer's FFN becomes 8 experts of width 256, each token
taking the 2 best: 2 x 256 = 512 hidden units a token, as the dense mlm_shakespeare.py (d_ff=512),
so both have equal *active* parameters (the router's D x E aside). Its dense counterpart, run side
by side at equal steps:
    jaxformer train --config experiments/mlm_shakespeare.py --workdir runs/mlm_shakespeare
The experts, routing, capacity (1.25) and router losses are moe_shakespeare's, read from that file. The
loss counts the masked positions only, but every position is routed (and competes for capacity).

Time and output: 800 steps, as mlm_shakespeare; time not measured at the full schedule (300 steps
side by side with the dense run took 17 minutes on 2 CPU cores shared with other jobs, at 0.70x the
dense run's tokens/s; docs/guides/moe.md). The held-out masked-token loss and accuracy at the
evaluations of steps 400 and 800 are its output (there is no text to read).
"""

import dataclasses
import pathlib

from jaxformer.config import load_experiment


def get_config():
    here = pathlib.Path(__file__)
    dense = load_experiment(str(here.with_name("mlm_shakespeare.py")))
    moe = load_experiment(str(here.with_name("moe_shakespeare.py"))).model.moe  # the same experts and routing
    return dataclasses.replace(dense, model=dense.model.replace(moe=moe))
