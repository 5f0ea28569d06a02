"""`jaxformer plan` against the real thing: on an 8-device CPU mesh, its per-device bytes equal those
of the arrays training creates and of the step it compiles, and its largest batch is the edge of fit."""

import json
import os
import subprocess
import sys

SMALL = [
    "model.d_model=64", "model.num_heads=4", "model.d_ff=128", "model.num_decoder_layers=2", "model.max_len=64",
    "data.max_len=64", "train.batch_size=16",
]  # fmt: skip

WORKER = """
import json, sys
import jax, numpy as np
from jaxformer import sharding
from jaxformer.config import apply_overrides, load_experiment
from jaxformer.plan import plan
from jaxformer.train import init_state, jit_steps, make_steps

cfg = apply_overrides(load_experiment("experiments/lm_shakespeare.py"), sys.argv[1:])
planned = plan(cfg)
mesh = sharding.make_mesh(cfg.mesh)
with sharding.use(mesh, sharding.rules_for(cfg.mesh)):
    graphdef, state, optimizer = init_state(cfg, mesh)  # real, sharded arrays
    train, _ = jit_steps(*make_steps(graphdef, cfg, optimizer), state, mesh)
    B, T = cfg.train.batch_size, cfg.data.max_len
    batch = sharding.global_batch(
        {"inputs": np.ones((B, T), np.int32), "targets": np.ones((B, T), np.int32),
         "weights": np.ones((B, T), np.float32)}, mesh, B)
    real = train.lower(state, batch).compile().memory_analysis()
on_device0 = lambda tree: sum(next(s.data.nbytes for s in x.addressable_shards if s.device == jax.devices()[0])
                              for x in jax.tree.leaves(tree))
device_memory = planned.peak * 3
edge = plan(cfg, device_memory=device_memory)
over = plan(cfg, device_memory=device_memory, batch_size=edge.largest_batch + 8)
print(json.dumps({
    "planned": [planned.parameters, planned.optimizer_state, planned.arguments, planned.temporaries],
    "real": [on_device0(state.params), on_device0(state.opt_state), real.argument_size_in_bytes,
             real.temp_size_in_bytes],
    "largest": edge.largest_batch, "fits_at_largest": plan(cfg, device_memory, edge.largest_batch).fits,
    "fits_past_it": over.fits,
}))
"""


def run_on_8_devices(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)


def test_plan_equals_the_arrays_and_step_of_real_training_on_8_devices():
    out = run_on_8_devices("-c", WORKER, *SMALL, "mesh.data=2", "mesh.fsdp=4")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["planned"] == r["real"]  # parameters, optimizer state, compiled arguments and temporaries
    assert r["largest"] > 16 and r["largest"] % 8 == 0
    assert r["fits_at_largest"] and not r["fits_past_it"]


def test_plan_command_prints_json_and_says_what_does_not_fit(tmp_path):
    cmd = ["-m", "jaxformer.cli", "plan", "--config", "experiments/lm_shakespeare.py", "--devices", "4"]
    sets = [a for s in [*SMALL, "mesh.fsdp=4"] for a in ("--set", s)]
    out = subprocess.run([sys.executable, *cmd, *sets, "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    planned = json.loads(out.stdout)
    assert planned["devices"] == 4 and planned["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert planned["parameters"] > 0 and planned["peak"] >= planned["arguments"]
    tight = subprocess.run([sys.executable, *cmd, *sets, "--device-memory", "1MB"], capture_output=True, text=True)
    assert tight.returncode == 1 and "does NOT fit" in tight.stdout and "even the smallest batch" in tight.stdout
    bad = subprocess.run([sys.executable, *cmd, "--set", "mesh.fsdp=3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "mesh" in bad.stderr and "Traceback" not in bad.stderr
