"""Bad input over the public surface, one row a case: what is given, and what must come back.

From the command line: exit code 2 and one line `error: ...` saying what is wrong and where (argparse's
usage errors: its usage line, then the error), never a traceback from inside JAX or orbax, and a
workdir that a refused command leaves as it found it. From Python: the exception class and message.
Nothing here trains: the workdirs are written at step 0, once for the module.
"""

import contextlib
import dataclasses
import importlib.util
import json
import pathlib
import re
import shlex
import shutil
import signal
import sys
import tempfile
import types

import jax
import jax.numpy as jnp
import numpy as np
import processes
import pytest
from flax import nnx

import jaxformer as jf
import jaxformer.engine  # jf.engine in the API cases, whatever ran before them
from jaxformer import cli, decode, lora
from jaxformer.checkpoint import CheckpointWriteError
from jaxformer.config import ConfigError, DecodeConfig, TrainConfig, apply_overrides, from_dict, load_experiment
from jaxformer.data import DataError, HFTokenizer, SentencePieceTokenizer

SMALL = {  # each experiment's model made small: the cases are about input, not capacity
    "lm": ["model.d_model=32", "model.d_ff=64", "model.num_decoder_layers=1"],
    "copy": ["model.num_encoder_layers=1", "model.num_decoder_layers=1"],
    "mlm": ["model.d_model=32", "model.d_ff=64", "model.num_encoder_layers=1"],
}
EXPERIMENT = {"lm": "lm_shakespeare", "copy": "copy_task", "mlm": "mlm_shakespeare"}


def write_workdir(path, name):
    """A training workdir at step 0 (config.json and one checkpoint), as `train` leaves it."""
    from jaxformer.checkpoint import start_workdir
    from jaxformer.state import state_factory

    cfg = apply_overrides(load_experiment(f"experiments/{EXPERIMENT[name]}.py"), SMALL[name])
    start_workdir(path, cfg, jax.jit(state_factory(cfg)[1])())
    return path


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Paths the cases name as {lm}, {copy}, {mlm} (step-0 workdirs), {tmp}, and the files below."""
    root = tmp_path_factory.mktemp("bad-inputs")
    paths = {name: write_workdir(root / name, name) for name in EXPERIMENT}
    files = {
        "empty": None,  # a directory with nothing in it
        "garbage": {"config.json": "{not json"},
        "unknown_section": {"config.json": json.dumps({"modle": {}})},
        "config_only": {"config.json": (paths["lm"] / "config.json").read_text()},
        "not_utf8": {"prompts.txt": b"KING:\n\xff\xfe oh\n"},
        "blank": {"prompts.txt": "KING:\n\n"},
        "readme": {"README.md": "# jaxformer\n"},
        "broken": {"broken.py": "def get_config(:\n"},
        "no_function": {"exp.py": "x = 1\n"},
        "returns_dict": {"exp.py": "def get_config():\n    return {'model': {}}\n"},
        "invalid_inside": {
            "exp.py": "from jaxformer.config import TrainConfig\ndef get_config():\n    return TrainConfig(steps=0)\n"
        },
        "unknown_family": {"config.json": json.dumps({"model_type": "mamba", "vocab_size": 8})},
        "llama_no_width": {"config.json": json.dumps({"model_type": "llama", "vocab_size": 8})},
        # Mixture-of-experts checkpoints asking for what jaxformer's MoE cannot do (the golden models' configs).
        "mixtral_top5": {"config.json": json.dumps(_golden_config("mixtral") | {"num_experts_per_tok": 5})},
        "switch_router_bias": {"config.json": json.dumps(_golden_config("switch") | {"router_bias": True})},
        "deepseek_fp8": {
            "config.json": json.dumps(
                _golden_config("deepseek_v3")
                | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
            )
        },
        "deepseek_interleave": {"config.json": json.dumps(_golden_config("deepseek_v3") | {"rope_interleave": False})},
        "qwen_dynamic_rope": {
            "config.json": json.dumps(
                _golden_config("qwen3") | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
            )
        },
        "switch_step_float": {"config.json": json.dumps(_golden_config("switch") | {"decoder_sparse_step": 1.5})},
        "no_weights": {
            "config.json": json.dumps(
                {"model_type": "gpt2", "vocab_size": 16, "n_embd": 8, "n_head": 2, "n_layer": 1, "n_positions": 16}
            )
        },
        "damaged_weights": {  # a download cut short or overwritten
            "config.json": json.dumps(
                {"model_type": "gpt2", "vocab_size": 16, "n_embd": 8, "n_head": 2, "n_layer": 1, "n_positions": 16}
            ),
            "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}",
        },
        "damaged_tokenizers": {"tokenizer.model": b"\x0agarbage", "tokenizer.json": "{not json"},
        "sweep_without_function": {"sweep.py": "x = 1\n"},
        "metrics_missing": {"config.json": "{}"},
        # an lm-eval task over a local file (read from the working directory) that is not there
        "task_missing_data": {
            "cloze.yaml": "task: local_cloze\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            "    test: missing/cloze.jsonl\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
            "doc_to_choice: '{{choices}}'\ndoc_to_target: answer\n"
        },
        # Instruction records (data.template): a good first line, then the fault on line 2.
        "chat_no_role": {
            "chat.jsonl": GOOD_PAIR + '{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}\n'
        },
        "chat_unknown_role": {"chat.jsonl": GOOD_PAIR + '{"messages": [{"role": "tool", "content": "1"}]}\n'},
        "chat_no_answer": {"chat.jsonl": GOOD_PAIR + '{"messages": [{"role": "user", "content": "hi"}]}\n'},
        "pair_no_response": {"pairs.jsonl": GOOD_PAIR + '{"prompt": "Upper: ab"}\n'},
        # responses that are all empty (each record is dropped), and all but one
        "empty_responses": {"pairs.jsonl": 3 * '{"prompt": "Upper: ab", "response": " "}\n'},
        "one_response": {"pairs.jsonl": GOOD_PAIR + 2 * '{"prompt": "Upper: ab", "response": ""}\n'},
        # Preference records (train.objective=preference): a good first pair, then the fault on line 2.
        "pref_equal": {"pairs.jsonl": GOOD_PREFERENCE + '{"prompt": "Upper: ab", "chosen": "AB", "rejected": "AB"}\n'},
        "pref_no_rejected": {"pairs.jsonl": GOOD_PREFERENCE + '{"prompt": "Upper: ab", "chosen": "AB"}\n'},
    }
    for name, content in files.items():
        directory = root / name
        directory.mkdir()
        for file, text in (content or {}).items():
            (directory / file).write_bytes(text if isinstance(text, bytes) else text.encode())
    (root / "a_file").write_text("not a directory\n")
    peft = _peft_adapters(root)
    return {**{k: str(v) for k, v in paths.items()}, "tmp": str(root), **{k: str(root / k) for k in files}, **peft}


def _golden_config(name: str) -> dict:
    return json.loads((pathlib.Path(__file__).parent / "golden" / name / "config.json").read_text())


def _peft_adapters(root):
    """PEFT adapter directories beside the golden GPT-2 base: one for a wider base, and bad configs."""
    from safetensors.numpy import load_file, save_file

    golden = pathlib.Path(__file__).parent / "golden" / "peft" / "gpt2"
    good = json.loads((golden / "adapter" / "adapter_config.json").read_text())
    tensors = load_file(golden / "adapter" / "adapter_model.safetensors")
    wider = {n: np.zeros([2 * d if d != good["r"] else d for d in t.shape], np.float32) for n, t in tensors.items()}
    configs = {
        "peft_other_base": good,
        "peft_not_lora": good | {"peft_type": "PREFIX_TUNING"},
        "peft_no_r": {k: v for k, v in good.items() if k != "r"},
        "peft_dora": good | {"use_dora": True},
        "peft_lm_head": good | {"target_modules": ["c_attn", "lm_head"]},
    }
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text(json.dumps(config))
        save_file(wider if name == "peft_other_base" else tensors, root / name / "adapter_model.safetensors")
    return {"peft_base": str(golden / "base"), **{name: str(root / name) for name in configs}}


GOOD_PAIR = '{"prompt": "Reverse: ab", "response": "ba"}\n'
GOOD_PREFERENCE = '{"prompt": "Reverse: ab", "chosen": "ba", "rejected": "ab"}\n'


def cli_case(argv: str, message: str, rc: int = 2, found_while_reading: bool = False, marks=()):
    """`found_while_reading`: bad content of the user's data, found while it is tokenized into WORKDIR/data:
    the workdir then exists (its config.json), but no step ran and no checkpoint was written."""
    return pytest.param(
        argv, message, rc, found_while_reading, id=argv.replace(TRAIN, "train --set ")[:60], marks=marks
    )


# lm-evaluation-harness's tasks: the eval extra (CI installs it)
HARNESS = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="pip install -e '.[eval]'")


TRAIN = "train --config experiments/copy_task.py --workdir {tmp}/never --set "
MLA = "model.mla.kv_lora_rank=8 --set model.position=rope"  # latent attention on the copy task's model
INSTRUCT = "train --config experiments/instruct_tiny.py --workdir {tmp}/never --set "
DPO = "train --config experiments/dpo_tiny.py --workdir {tmp}/never --set "
CLI_CASES = [
    # Config fields, refused before anything is read, built or written (the workdir is never created).
    cli_case(TRAIN + "model.mode=gpt", r"model\.mode: 'gpt' is not one of the choices: 'encoder_only', 'decoder_only'"),
    cli_case(TRAIN + "model.d_model=0", r"model\.d_model: "),
    cli_case(TRAIN + "model.d_model=abc", r"model\.d_model: cannot parse 'abc' as int"),
    cli_case(TRAIN + "model.d_model=1.5", r"model\.d_model: cannot parse '1\.5' as int"),
    cli_case(TRAIN + "model.d_model=1e99", r"model\.d_model: cannot parse '1e99' as int"),  # no 100-digit int
    cli_case(TRAIN + "model.num_heads=3", r"model\.num_heads: num_heads=3 does not divide d_model=64"),
    cli_case(TRAIN + "model.vocab_size=-1", r"model\.vocab_size: "),
    cli_case(TRAIN + "model.max_len=0", r"model\.max_len: "),
    cli_case(TRAIN + "model.dropout_rate=1.5", r"model\.dropout_rate: "),
    cli_case(
        TRAIN + "lora.rank=4 --set lora.targets=q,query", r"lora\.targets: unknown 'query' \(valid: q, k, v, o, wi"
    ),
    cli_case(
        TRAIN + "lora.stacks=decoder,middle", r"lora\.stacks: unknown 'middle' \(valid: encoder, decoder, cross\)"
    ),
    cli_case(TRAIN + "lora.rank=-1", r"lora\.rank: must be positive \(or 0 = off\), got -1"),
    # stacks a decoder-only model does not have: its q and v would get no adapter, and "0 trained" would train
    *[
        cli_case(
            "train --config experiments/lm_shakespeare.py --workdir {tmp}/never --set lora.rank=2 "
            f"--set lora.stacks={stack}",
            rf"lora\.stacks: \('{stack}',\) names no stack of a decoder_only model \(it has decoder\): 'q', 'v'",
        )
        for stack in ("encoder", "cross")
    ],
    cli_case(
        TRAIN + "lora.rank=2 --set lora.stacks=cross --set lora.targets=q,wi",
        r"lora\.targets: 'wi' adapts nothing in lora\.stacks=\('cross',\): cross-attention has q, k, v, o",
    ),
    cli_case(TRAIN + "lora.rank=65", r"lora\.rank: rank=65 exceeds the width 64 of projection 'q'"),
    cli_case(TRAIN + "lora.rank=4 --set lora.targets=wi_gate", r"lora\.targets: 'wi_gate' exists only for gated"),
    cli_case(TRAIN + "lora.rank=4 --set lora.targets=", r"lora\.targets: LoRA on \(rank > 0\) needs at least one"),
    cli_case(TRAIN + "lora.alpha=0", r"lora\.alpha: must be > 0, got 0"),
    cli_case(TRAIN + "lora.dropout=1", r"lora\.dropout: must be in \[0, 1\), got 1"),
    cli_case(TRAIN + "lora.dropout=-0.1", r"lora\.dropout: must be in \[0, 1\), got -0\.1"),
    cli_case(TRAIN + "lora.rank=4 --set lora.targets=head", r"lora\.targets: 'head': the output projection is"),
    cli_case(TRAIN + "lora.base=int4", r"lora\.base: 'int4' is not one of the choices: 'compute', 'int8'"),
    cli_case(TRAIN + "lora.base=int8", r"lora\.base: 'int8' quantizes the frozen base of a LoRA run: set lora\.rank"),
    cli_case(TRAIN + "mesh.context=0", r"mesh\.context: must be positive, got 0"),
    cli_case(TRAIN + "mesh.context=3", r"data\.max_len: 10 is not divisible by mesh\.context=3"),
    cli_case(TRAIN + "model.context_attention=stripes", r"model\.context_attention: 'stripes' is not one of the"),
    cli_case(
        TRAIN + "mesh.context=2 --set model.attention_impl=splash --set model.context_attention=allgather",
        r"model\.attention_impl: 'splash' attends the ring's blocks; model\.context_attention='allgather'",
    ),
    cli_case(
        TRAIN + "mesh.context=2 --set model.attention_impl=cudnn --set model.context_attention=allgather",
        r"model\.attention_impl: 'cudnn' attends the ring's blocks; model\.context_attention='allgather'",
    ),
    # a fused kernel named for the ring's blocks that cannot take them (config.ring_blocks_unfit; the layer's
    # trace-time check, which also asks this machine, was a traceback from layers.py)
    cli_case(
        TRAIN + "mesh.context=2 --set model.attention_impl=splash",
        r"model\.attention_impl: 'splash': splash attention needs ring blocks of multiples of 128 positions, "
        r"not 5 and 5",
    ),
    cli_case(
        TRAIN + "mesh.context=2 --set model.attention_impl=cudnn",
        r"model\.attention_impl: 'cudnn': cuDNN flash attention cannot attend the ring's blocks: it computes in "
        r"bfloat16 or float16, not float32 \(model\.dtype\)",
    ),
    cli_case(
        TRAIN + "mesh.context=2 --set model.attention_impl=cudnn --set model.dtype=bfloat16",
        r"model\.attention_impl: 'cudnn': cuDNN flash .*: blocks of even lengths, not 5 and 5 \(mesh\.context=2",
    ),
    # Latent attention (model.mla): its own fields, and what it does not combine with, each named.
    cli_case(TRAIN + "model.mla.kv_lora_rank=-1", r"model\.mla\.kv_lora_rank: must be >= 0 \(0 = off\), got -1"),
    cli_case(TRAIN + "model.mla.rope_head_dim=3", r"model\.mla\.rope_head_dim: RoPE needs an even width, got 3"),
    cli_case(TRAIN + "model.mla.q_lora_rank=8", r"model\.mla\.q_lora_rank: compresses MLA's queries: set kv_lora_rank"),
    cli_case(TRAIN + "model.mla.kv_lora_rank=8", r"model\.position: MLA's decoupled dims are rotary: needs 'rope'"),
    cli_case(TRAIN + MLA, r"model\.use_bias: MLA's projections have no biases \(DeepSeek\): set use_bias=False"),
    cli_case(TRAIN + MLA + " --set model.use_bias=false --set model.qk_norm=true", r"model\.qk_norm: MLA normalises"),
    cli_case(
        TRAIN + MLA + " --set model.use_bias=false --set mesh.context=2",
        r"mesh\.context: context parallelism has no latent attention \(model\.mla\)",
    ),
    cli_case(TRAIN + MLA + " --set model.use_bias=false --set lora.rank=4", r"lora\.rank: LoRA adapts q, k, v and o;"),
    # RoPE scaling (model.rope_scaling): its own fields, and the positions it needs.
    cli_case(
        TRAIN + "model.rope_scaling.kind=linear --set model.rope_scaling.factor=0.5",
        r"model\.rope_scaling\.factor: must be >= 1 for kind='linear', got 0\.5",
    ),
    cli_case(
        TRAIN + "model.rope_scaling.kind=yarn --set model.rope_scaling.factor=4",
        r"model\.rope_scaling\.original_max_len: kind='yarn' needs the length the model was trained at",
    ),
    cli_case(
        TRAIN + "model.rope_scaling.kind=linear --set model.rope_scaling.factor=2",
        r"model\.rope_scaling\.kind: 'linear' scales RoPE's frequencies: needs position='rope', not 'sinusoidal'",
    ),
    cli_case(TRAIN + "model.rope_scaling.kind=ntk", r"model\.rope_scaling\.kind: 'ntk' is not one of the choices"),
    cli_case(TRAIN + "model.moe.num_experts=-1", r"model\.moe\.num_experts: must be >= 0 \(0 = dense\), got -1"),
    cli_case(TRAIN + "model.moe.expert_capacity=-2", r"model\.moe\.expert_capacity: must be >= 0, got -2"),
    cli_case(TRAIN + "model.moe.encoder_every=-1", r"model\.moe\.encoder_every: must be >= 0 \(0 = no MoE layer in"),
    cli_case(
        TRAIN + "model.moe.decoder_every=2 --set model.moe.decoder_offset=2",
        r"model\.moe\.decoder_offset: must be in \[0, decoder_every=2\) \(layer i is MoE when i % 2 == offset\)",
    ),
    cli_case(
        TRAIN + "model.moe.encoder_every=0 --set model.moe.encoder_offset=0",
        r"model\.moe\.encoder_offset: encoder_every=0 has no MoE layer to place",
    ),
    cli_case(
        TRAIN + "model.moe.num_experts=6 --set mesh.expert=4",
        r"mesh\.expert: expert=4 does not divide model\.moe\.num_experts=6",
    ),
    # mesh.expert=-1 is filled only once the devices are known: the mesh refuses it then, before any compile
    # (on a compile-only TPU slice of 4 chips, so that the fill is not 1)
    pytest.param(
        "plan --config experiments/copy_task.py --target tpu-v5e:2x2 --set model.moe.num_experts=6 "
        "--set mesh.data=1 --set mesh.expert=-1",
        r"mesh\.expert: mesh\.expert=-1 fills to 4, which does not divide model\.moe\.num_experts=6",
        2,
        False,
        id="plan mesh.expert=-1 fills to 4, 6 experts",
        marks=pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu"),
    ),
    cli_case(
        TRAIN + "model.moe.expert_capacity=4 --set model.moe.capacity_factor=1.25",
        r"model\.moe\.expert_capacity: expert_capacity=4 and capacity_factor=1\.25 both set the capacity",
    ),
    # DeepSeek-V3's routing, balancing, dense head and multi-token prediction
    cli_case(
        TRAIN + "model.moe.num_experts=8 --set model.moe.router=sigmoid_topk --set model.moe.num_groups=3",
        r"model\.moe\.num_groups: num_groups=3 does not divide num_experts=8",
    ),
    cli_case(
        TRAIN + "model.moe.num_experts=8 --set model.moe.router=sigmoid_topk --set model.moe.num_groups=4 "
        "--set model.moe.groups_per_token=5",
        r"model\.moe\.groups_per_token: must be in \[1, num_groups=4\], got 5",
    ),
    cli_case(
        TRAIN + "model.moe.num_experts=4 --set model.moe.balance_rate=0.001",
        r"model\.moe\.balance_rate: belongs to router='sigmoid_topk' \(DeepSeek-V3\), not router='softmax_topk'",
    ),
    cli_case(
        TRAIN + "model.moe.num_experts=4 --set model.moe.first_dense=2",
        r"model\.moe\.first_dense: first_dense=2 leaves no MoE layer in the encoder's 2 layers",
    ),
    cli_case(
        TRAIN + "model.moe.num_experts=4 --set model.moe.every=2 --set model.scan_layers=true "
        "--set model.moe.first_dense=1",
        r"model\.moe\.every: every=2 with scan_layers=True scans blocks of 2 layers: "
        r"model\.num_encoder_layers=2 less first_dense=1 is not a multiple",
    ),
    cli_case(TRAIN + "model.mtp_depth=1", r"model\.mtp_depth: multi-token prediction extends a causal language model"),
    cli_case(TRAIN + "train.mtp_weight=0.3", r"train\.mtp_weight: mtp_weight=0\.3 weighs the multi-token prediction"),
    cli_case(TRAIN + "train.mtp_weight=-1", r"train\.mtp_weight: must be >= 0, got -1"),
    cli_case(TRAIN + "model.remat=offload", r"model\.remat: 'offload' is not one of the choices: .*'offload_dots'"),
    cli_case(TRAIN + "train.offload_optimizer=maybe", r"train\.offload_optimizer: "),
    cli_case(TRAIN + "train.loss_chunk=-5", r"train\.loss_chunk: must be tokens per chunk >= 0 \(0 = never chunk\)"),
    cli_case(TRAIN + "model.position=rotary", r"model\.position: 'rotary' is not one of the choices"),
    cli_case(TRAIN + "model.activation=swish", r"model\.activation: 'swish' is not one of the choices"),
    cli_case(TRAIN + "model.norm_position=middle", r"model\.norm_position: 'middle' is not one of the choices"),
    cli_case(TRAIN + "model.dtype=float8", r"model\.dtype: 'float8' is not one of the choices"),
    cli_case(TRAIN + "model.attention_impl=flash", r"model\.attention_impl: 'flash' is not one of the choices"),
    cli_case(TRAIN + "model.matmul_precision=max", r"model\.matmul_precision: 'max' is not one of the choices"),
    cli_case(TRAIN + "model.num_kv_heads=3", r"model\.num_kv_heads: "),
    cli_case(TRAIN + "model.qkv_bias=true", r"model\.qkv_bias: use_bias=True already gives every projection a bias"),
    cli_case(
        TRAIN + "model.sliding_window=4", r"model\.sliding_window: a window over the latest positions is a causal"
    ),
    cli_case(
        TRAIN + "model.global_every=2", r"model\.global_every: places global layers among local ones: set sliding"
    ),
    cli_case(TRAIN + "model.norm_plus_one=true", r"model\.norm_plus_one: scales an RMSNorm by \(1 \+ w\): needs norm="),
    cli_case(TRAIN + "model.attention_scale=-1", r"model\.attention_scale: must be positive \(or None\), got -1"),
    cli_case(TRAIN + "model.final_logit_softcap=-1", r"model\.final_logit_softcap: must be >= 0 \(0 = none\), got -1"),
    cli_case(TRAIN + "model.rope_local_base=100", r"model\.rope_local_base: is the local layers' RoPE base: needs"),
    cli_case(TRAIN + "model.attention_softcap=-1", r"model\.attention_softcap: must be >= 0 \(0 = none\), got -1"),
    cli_case(TRAIN + "model.num_encoder_layers=0", r"model\.num_encoder_layers: "),
    cli_case(TRAIN + "model.num_classes=3", r"model\.num_classes: "),
    cli_case(TRAIN + "model.width=1", r"model\.width: unknown field \(known: "),  # nothing close: no guess
    cli_case(
        TRAIN + "model.num_layer=2",
        r"model\.num_layer: unknown field; did you mean model\.num_decoder_layers or model\.num_encoder_layers\? "
        r"\(known: ",
    ),
    cli_case(
        TRAIN + "model.moe.num_expert=2",
        r"model\.moe\.num_expert: unknown field; did you mean model\.moe\.num_experts\?",
    ),
    cli_case(
        TRAIN + "modle.d_model=1",
        r"modle\.d_model: a field is section\.field "
        r"\(model, train, data, checkpoint, mesh, decode, lora, preference, grpo\); "
        r"did you mean model\?$",
    ),
    cli_case(TRAIN + "model.d_model", r"model\.d_model: an override is section\.field=value"),
    cli_case(TRAIN + "train.steps=0", r"train\.steps: must be positive, got 0"),
    # Seeds: [0, 2**32) (a negative one failed at the first batch, in Grain; one past 64 bits in JAX)
    cli_case(TRAIN + "train.seed=-5", r"train\.seed: must be in \[0, 2\*\*32\) \(a 32-bit seed\), got -5"),
    cli_case(TRAIN + "train.seed=4294967296", r"train\.seed: must be in \[0, 2\*\*32\)"),
    cli_case(TRAIN + "data.split_seed=-1", r"data\.split_seed: must be in \[0, 2\*\*32\)"),
    cli_case(TRAIN + "decode.seed=-1", r"decode\.seed: must be in \[0, 2\*\*32\)"),
    cli_case(TRAIN + "lora.seed=-1", r"lora\.seed: must be in \[0, 2\*\*32\)"),
    cli_case(TRAIN + "train.steps=3e9", r"train\.steps: "),
    cli_case(TRAIN + "train.batch_size=0", r"train\.batch_size: must be positive, got 0"),
    cli_case(TRAIN + "train.grad_accum=3", r"train\.grad_accum: grad_accum=3 does not divide batch_size=64"),
    cli_case(TRAIN + "train.learning_rate=-1", r"train\.learning_rate: must be positive, got -1"),
    cli_case(TRAIN + "train.learning_rate=inf", r"train\.learning_rate: must be positive, got inf"),
    cli_case(TRAIN + "train.learning_rate=nan", r"train\.learning_rate: must be positive, got nan"),
    cli_case(TRAIN + "train.b1=nan", r"train\.b1: must be in \[0, 1\), got nan"),
    cli_case(TRAIN + "train.b2=1.5", r"train\.b2: must be in \[0, 1\), got 1\.5"),
    cli_case(TRAIN + "train.eps=0", r"train\.eps: must be positive, got 0"),
    cli_case(TRAIN + "train.warmup_steps=-1", r"train\.warmup_steps: must be >= 0"),
    cli_case(TRAIN + "train.label_smoothing=1", r"train\.label_smoothing: must be in \[0, 1\)"),
    cli_case(TRAIN + "train.mlm_probability=0", r"train\.mlm_probability: must be in \(0, 1\)"),
    cli_case(TRAIN + "train.clip_norm=-1", r"train\.clip_norm: "),
    cli_case(TRAIN + "train.weight_decay=-0.1", r"train\.clip_norm: clip_norm and weight_decay >= 0"),
    cli_case(TRAIN + "train.eval_batches=0", r"train\.eval_batches: must be positive \(batches per evaluation\)"),
    cli_case(TRAIN + "train.num_samples=-1", r"train\.num_samples: must be >= 0, got -1"),
    cli_case(TRAIN + "train.peak_flops=-1", r"train\.peak_flops: must be >= 0"),
    cli_case(TRAIN + "train.optimizer=sgd", r"train\.optimizer: 'sgd' is not one of the choices: 'adamw', 'adam'"),
    cli_case(TRAIN + "train.schedule=linear", r"train\.schedule: 'linear' is not one of the choices"),
    cli_case(TRAIN + "train.objective=lm", r"train\.objective: objective='lm' needs model\.mode='decoder_only'"),
    cli_case(TRAIN + "train.on_nonfinite=ignore", r"train\.on_nonfinite: 'ignore' is not one of the choices"),
    cli_case(TRAIN + "train.log_every=0", r"train\.log_every: must be positive, got 0"),
    cli_case(TRAIN + "train.eval_every=0", r"train\.eval_every: must be positive, got 0"),
    cli_case(TRAIN + "data.max_len=1", r"data\.max_len: must be > 1, got 1"),
    cli_case(TRAIN + "data.max_len=100", r"data\.max_len: data\.max_len=100 exceeds model\.max_len=16"),
    cli_case(TRAIN + "data.src_max_len=1", r"data\.src_max_len: must be > 1, got 1"),
    cli_case(TRAIN + "data.src_max_len=100", r"data\.src_max_len: data\.src_max_len=100 exceeds model\.max_len=16"),
    cli_case(
        "train --config experiments/lm_shakespeare.py --workdir {tmp}/never --set data.src_max_len=16",
        r"data\.src_max_len: objective='lm' reads no source "
        r"\(only seq2seq, classify and encoder_decoder preference do\)",
    ),
    cli_case(TRAIN + "data.max_segments=0", r"data\.max_segments: must be positive, got 0"),
    cli_case(TRAIN + "data.source=wikipedia", r"data\.source: 'wikipedia' is not one of the choices"),
    cli_case(TRAIN + "data.tokenizer=wordpiece", r"data\.tokenizer: 'wordpiece' is not one of the choices"),
    cli_case(TRAIN + "data.too_long=drop", r"data\.too_long: 'drop' is not one of the choices"),
    cli_case(TRAIN + "data.length_buckets=0", r"data\.length_buckets: must be positive"),
    cli_case(TRAIN + "data.max_examples=-1", r"data\.max_examples: must be >= 0"),
    cli_case(TRAIN + "data.val_fraction=1", r"data\.val_fraction: val_fraction and test_fraction must be in"),
    cli_case(TRAIN + "data.synthetic_vocab=2", r"data\.synthetic_vocab: must be > 3"),
    cli_case(TRAIN + "data.synthetic_len=0", r"data\.synthetic_len: "),
    cli_case(TRAIN + "data.spm_vocab_size=4", r"data\.spm_vocab_size: must be > 8"),
    cli_case(TRAIN + "data.source=files", r"data\.files: source='files' needs data\.files"),
    cli_case(TRAIN + "data.files=a.jsonl", r"data\.files: needs source='files', not copy"),
    cli_case(TRAIN + "data.format=xml", r"data\.format: 'xml' is not one of the choices"),
    cli_case(TRAIN + "data.text_unit=page", r"data\.text_unit: 'page' is not one of the choices"),
    cli_case(TRAIN + "data.prefetch=-1", r"data\.prefetch: must be >= 0"),
    cli_case(TRAIN + "data.prepare_workers=-1", r"data\.prepare_workers: must be >= 0"),
    cli_case(TRAIN + "data.min_words=-1", r"data\.min_words: must be >= 0"),
    cli_case(
        "train --config experiments/lm_shakespeare.py --workdir {tmp}/never --set data.source=files "
        "--set data.files={tmp}/corpus-*.jsonl",
        r"\S+corpus-\*\.jsonl: matches no file",
    ),
    cli_case(
        "train --config experiments/lm_shakespeare.py --workdir {tmp}/never --set data.source=files "
        "--set data.files={not_utf8}/prompts.txt",
        r"\S+prompts\.txt:2: not UTF-8",
        found_while_reading=True,
    ),
    # Instruction data: the template's name, what it applies to, and the records it reads.
    cli_case(
        TRAIN + "data.template=vicuna",
        r"data\.template: 'vicuna' is not one of the choices: 'none', 'alpaca', 'chatml'",
    ),
    cli_case(
        TRAIN + "data.template=alpaca",
        r"data\.template: needs data\.source='files' \(instruction records\), not 'copy'",
    ),
    cli_case(
        "train --config experiments/mlm_shakespeare.py --workdir {tmp}/never --set data.template=chatml",
        r"data\.template: instruction data trains objective 'lm' or 'seq2seq', not 'mlm'",
    ),
    cli_case(
        INSTRUCT + "data.format=text",
        r"data\.template: plain text holds no prompt/response records: use JSONL",
    ),
    cli_case(
        INSTRUCT + "data.files={chat_no_role}/chat.jsonl",
        r"\S+chat\.jsonl:2: messages\[0\]: a turn is \{'role': str, 'content': str\}, got \{'content': 'hi'\}",
        found_while_reading=True,
    ),
    cli_case(
        INSTRUCT + "data.files={chat_unknown_role}/chat.jsonl",
        r"\S+chat\.jsonl:2: messages\[0\]: role 'tool' is not one template 'alpaca' knows \(system, user, assistant\)",
        found_while_reading=True,
    ),
    cli_case(
        INSTRUCT + "data.files={chat_no_answer}/chat.jsonl",
        r"\S+chat\.jsonl:2: messages: no assistant turn",
        found_while_reading=True,
    ),
    # Preference pairs: the loss and its constants, what the pairs need, and the records read.
    cli_case(DPO + "preference.loss=kto", r"preference\.loss: 'kto' is not one of the choices: 'sigmoid', 'ipo'"),
    cli_case(DPO + "preference.beta=0", r"preference\.beta: must be positive, got 0\.0"),
    cli_case(DPO + "data.pack=true", r"data\.pack: preference pairs are not packed"),
    cli_case(
        DPO + "data.files={pref_equal}/pairs.jsonl",
        r"\S+pairs\.jsonl:2: 'chosen' equals 'rejected': the pair prefers nothing",
        found_while_reading=True,
    ),
    cli_case(
        DPO + "data.files={pref_no_rejected}/pairs.jsonl",
        r"\S+pairs\.jsonl:2: no field 'rejected' \(a preference record has 'prompt', 'chosen' and 'rejected'\)",
        found_while_reading=True,
    ),
    cli_case(
        INSTRUCT + "data.files={pair_no_response}/pairs.jsonl",
        r"\S+pairs\.jsonl:2: no field 'response' \(an instruction record has 'prompt' and 'response', or 'messages'\)",
        found_while_reading=True,
    ),
    cli_case(
        INSTRUCT + "data.files={empty_responses}/pairs.jsonl",
        r"\S+pairs\.jsonl: no records left \(3 records dropped: 3 with an empty 'response'\)",
        found_while_reading=True,
    ),
    cli_case(
        INSTRUCT + "data.files={one_response}/pairs.jsonl",
        r"\S+pairs\.jsonl: the validation split is empty \(1 records in all\); 2 records dropped: 2 with an empty "
        r"'response'$",
        found_while_reading=True,
    ),
    cli_case(TRAIN + "checkpoint.every=0", r"checkpoint\.every: must be positive, got 0"),
    cli_case(TRAIN + "checkpoint.keep=0", r"checkpoint\.keep: must be positive, got 0"),
    cli_case(TRAIN + "checkpoint.best_metric=bleu", r"checkpoint\.best_metric: 'bleu' is not an eval metric"),
    cli_case(TRAIN + "checkpoint.best_mode=median", r"checkpoint\.best_mode: 'median' is not one of the choices"),
    cli_case(TRAIN + "checkpoint.async_save=maybe", r"checkpoint\.async_save: cannot parse 'maybe' as bool"),
    cli_case(TRAIN + "mesh.data=0", r"mesh\.data: must be positive or -1 \(fill\), got 0"),
    cli_case(TRAIN + "mesh.fsdp=-2", r"mesh\.fsdp: must be positive or -1 \(fill\), got -2"),
    cli_case(TRAIN + "mesh.data=2", r"mesh: data=2, fsdp=1, tensor=1 makes 2 devices, but 1 are available"),
    cli_case(TRAIN + "mesh.rules=zero3", r"mesh\.rules: 'zero3' is not one of the choices"),
    cli_case(TRAIN + "mesh.dcn_data=0", r"mesh\.dcn_data: must be positive"),
    cli_case(TRAIN + "decode.strategy=nucleus", r"decode\.strategy: 'nucleus' is not one of the choices"),
    cli_case(TRAIN + "decode.temperature=0", r"decode\.temperature: must be > 0, got 0"),
    cli_case(TRAIN + "decode.top_p=0", r"decode\.top_p: must be in \(0, 1\], got 0"),
    cli_case(TRAIN + "decode.top_p=1.5", r"decode\.top_p: must be in \(0, 1\], got 1\.5"),
    cli_case(TRAIN + "decode.top_k=-1", r"decode\.top_k: must be >= 0 \(0 = off\), got -1"),
    cli_case(TRAIN + "decode.min_p=2", r"decode\.min_p: must be in \[0, 1\] \(0 = off\), got 2"),
    cli_case(TRAIN + "decode.beam_size=0", r"decode\.beam_size: must be >= 1, got 0"),
    cli_case(TRAIN + "decode.num_return=5", r"decode\.num_return: must be in \[1, beam_size=4\] for beam search"),
    cli_case(TRAIN + "decode.max_new_tokens=0", r"decode\.max_new_tokens: must be positive, got 0"),
    cli_case(TRAIN + "decode.extra_len=-1", r"decode\.extra_len: must be >= 0, got -1"),
    # Relations between fields once found only as the run went (in the model, the data or the steps): refused
    # by config validation before anything is built or written.
    cli_case(TRAIN + "data.synthetic_len=20", r"data\.synthetic_len: data\.synthetic_len=20 exceeds model\.max_len=16"),
    cli_case(
        TRAIN + "model.vocab_size=8",
        r"model\.vocab_size: model\.vocab_size=8 is below data\.synthetic_vocab=11 .*: model\.vocab_size must be >= 11",
    ),
    cli_case(TRAIN + "data.tokenizer=byte", r"data\.tokenizer: data\.source='copy' is written in symbols"),
    cli_case(
        "train --config experiments/lm_shakespeare.py --workdir {tmp}/never --set data.tokenizer=symbols",
        r"data\.tokenizer: 'symbols' is for the copy/reverse tasks, not data\.source='shakespeare'",
    ),
    cli_case(
        "train --config experiments/lm_shakespeare.py --workdir {tmp}/never --set data.tokenizer=sentencepiece "
        "--set data.spm_vocab_size=300",
        r"data\.spm_vocab_size: data\.spm_vocab_size=300 exceeds model\.vocab_size=260",
    ),
    cli_case(TRAIN + "mesh.fsdp=-1", r"mesh\.fsdp: at most one of data, fsdp, tensor, expert may be -1 \(fill\)"),
    cli_case(TRAIN + "mesh.data=2 --set mesh.dcn_data=3", r"mesh\.dcn_data: dcn_data=3 does not divide mesh\.data=2"),
    # Pipeline stages: what the pipeline needs of the stacks, the micro-batches and the other axes.
    cli_case(TRAIN + "mesh.stage=0", r"mesh\.stage: must be positive, got 0"),
    cli_case(TRAIN + "mesh.virtual_stages=2", r"mesh\.virtual_stages: virtual_stages=2 needs mesh\.stage > 1"),
    cli_case(TRAIN + "mesh.stage=2", r"model\.scan_layers: mesh\.stage=2 splits a scanned stack's layers"),
    cli_case(
        TRAIN + "mesh.stage=3 --set model.scan_layers=true --set train.grad_accum=4",
        r"model\.num_encoder_layers: num_encoder_layers=2 does not divide into mesh\.stage x mesh\.virtual_stages = "
        r"3 x 1 chunks",
    ),
    cli_case(
        TRAIN + "mesh.stage=2 --set mesh.virtual_stages=2 --set model.scan_layers=true --set train.grad_accum=2",
        r"model\.num_encoder_layers: num_encoder_layers=2 does not divide into .* 2 x 2 chunks",
    ),
    cli_case(
        TRAIN + "mesh.stage=2 --set model.scan_layers=true",
        r"train\.grad_accum: the pipeline runs train\.grad_accum micro-batches: grad_accum=1 leaves stages",
    ),
    cli_case(
        TRAIN + "mesh.stage=2 --set model.scan_layers=true --set train.grad_accum=16 --set mesh.data=8",
        r"train\.batch_size: a micro-batch of 4 rows \(batch_size=64 / grad_accum=16\) does not divide over "
        r"mesh\.data x mesh\.fsdp = 8 x 1",
    ),
    cli_case(
        TRAIN + "mesh.stage=2 --set model.scan_layers=true --set train.grad_accum=2 --set mesh.context=2",
        r"mesh\.context: mesh\.stage=2: pipelining does not compose with mesh\.context",
    ),
    cli_case(
        TRAIN + "mesh.stage=2 --set model.scan_layers=true --set train.grad_accum=2 --set model.moe.num_experts=4",
        r"model\.moe: mesh\.stage=2: pipelining does not compose with model\.moe",
    ),
    cli_case(
        DPO + "mesh.stage=2 --set model.scan_layers=true --set train.grad_accum=2",
        r"train\.objective: mesh\.stage=2: pipelining does not compose with train\.objective",
    ),
    cli_case(
        TRAIN + "mesh.stage=2 --set model.scan_layers=true --set train.grad_accum=2",
        r"mesh: 1 devices are not divisible by the fixed axes' product stage=2",
    ),
    # 1F1B: one stack and its token loss per micro-batch
    cli_case(TRAIN + "mesh.schedule=1f1b", r"mesh\.schedule: schedule='1f1b' needs mesh\.stage > 1"),
    cli_case(
        TRAIN + "mesh.stage=2 --set model.scan_layers=true --set train.grad_accum=2 --set mesh.schedule=1f1b",
        r"mesh\.schedule: '1f1b' pipelines one stack and its loss: mode='encoder_decoder' needs 'gpipe'",
    ),
    cli_case(
        DPO + "mesh.stage=2 --set model.scan_layers=true --set train.grad_accum=2 --set mesh.schedule=1f1b",
        r"mesh\.schedule: '1f1b' runs the token loss per micro-batch: objective='preference' needs 'gpipe'",
    ),
    cli_case(
        TRAIN + "mesh.data=1 --set mesh.fsdp=3",
        r"train\.batch_size: batch_size=64 does not divide over the batch shards \(mesh\.data x mesh\.fsdp = 1 x 3\)",
    ),
    cli_case(
        TRAIN + "model.attention_dropout_rate=0.1 --set model.attention_impl=xla",
        r"model\.attention_dropout_rate: attention_impl='xla' \(a fused kernel\) applies no dropout",
    ),
    # Found when the data is first looked at, before a corpus is read or a tokenizer or cache is kept: configs of
    # models alone (tests, benchmarks) keep the default byte/shakespeare data they never read.
    cli_case(
        "train --config experiments/classify_lohelp.py --workdir {tmp}/never --set data.source=shakespeare",
        r"data\.source='shakespeare' holds 1 field\(s\) per record \(text\), but objective='classify' reads 2",
        found_while_reading=True,
    ),
    cli_case(
        "train --config experiments/lm_shakespeare.py --workdir {tmp}/never --set model.vocab_size=100",
        r"\S+shakespeare\.txt\.xz: the byte tokenizer has 260 ids but model\.vocab_size=100 \(set it to at least 260\)",
        found_while_reading=True,
    ),
    cli_case(
        "train --config experiments/lm_shakespeare.py --workdir {tmp}/never --set data.tokenizer=sentencepiece "
        "--set data.spm_vocab_size=20 --set data.max_examples=2000",
        r"data\.spm_vocab_size=20 is too small for the training split: .* need data\.spm_vocab_size >= \d+",
        found_while_reading=True,
    ),
    # Experiment files and workdirs.
    cli_case("train --config {tmp}/missing.py --workdir {tmp}/never", r"experiment file \S+missing\.py does not exist"),
    cli_case("train --config {readme}/README.md --workdir {tmp}/never", r"experiment file \S+ is not a Python file"),
    cli_case("train --config {broken}/broken.py --workdir {tmp}/never", r"experiment file \S+broken\.py, line 1: "),
    cli_case("train --config {no_function}/exp.py --workdir {tmp}/never", r"\S+exp\.py defines no get_config\(\)"),
    cli_case(
        "train --config {returns_dict}/exp.py --workdir {tmp}/never",
        r"\S+exp\.py: get_config\(\) returned dict, not jaxformer\.config\.Config",
    ),
    cli_case("train --config {invalid_inside}/exp.py --workdir {tmp}/never", r"train\.steps: must be positive, got 0"),
    cli_case("train --workdir {empty}", r"\S+config\.json does not exist: \S+ is not a training workdir"),
    cli_case("train --workdir {garbage}", r"\S+config\.json is not a jaxformer config \(JSON, line 1, column 2: "),
    cli_case("train --workdir {unknown_section}", r"\S+config\.json: modle: unknown config section"),
    cli_case(
        "train --workdir {tmp}/a_file --config experiments/copy_task.py", r"--workdir \S+a_file is not a directory"
    ),
    cli_case("train --workdir {lm} --profile-steps 5", r"--profile-steps "),
    cli_case("train --workdir {lm} --profile-steps 5:3", r"--profile-steps "),
    cli_case("train --config experiments/copy_task.py", r"the following arguments are required: --workdir"),
    cli_case("frobnicate", r"argument command: invalid choice: 'frobnicate'"),
    # A sweep's storage that no retry can open, and a worker count that is not one: refused at once.
    cli_case(
        "sweep experiments/sweeps/copy_task.py --workdir {tmp}/sweep --storage bogus://x",
        r"--storage bogus://x: SQLAlchemy cannot open it here \(NoSuchModuleError: ",
    ),
    cli_case(
        "sweep experiments/sweeps/copy_task.py --workdir {tmp}/sweep --storage mysql://u:pw@h/db",
        r"--storage mysql://u:\*\*\*@h/db: SQLAlchemy cannot open it here \(ModuleNotFoundError: ",
        marks=pytest.mark.skipif(importlib.util.find_spec("MySQLdb") is not None, reason="MySQL's driver is here"),
    ),
    cli_case(
        "sweep experiments/sweeps/copy_task.py --workdir {tmp}/sweep --storage no-url", r"--storage: not a database"
    ),
    cli_case(
        "sweep experiments/sweeps/copy_task.py --workdir {tmp}/sweep --workers two",
        r"argument --workers: a number of processes or auto, not 'two'",
    ),
    # Read-only commands.
    cli_case("eval --workdir {empty}", r"\S+config\.json does not exist: \S+ is not a training workdir"),
    cli_case("eval --workdir {config_only}", r"\S+checkpoints holds no checkpoint: train first"),
    # lm-evaluation-harness tasks (jaxformer/evaluation): refused before the model is read
    cli_case(
        "train --config experiments/mlm_shakespeare.py --workdir {tmp}/never --set train.evals=shakespeare_cloze",
        r"train\.evals: lm-eval tasks score text: objective lm or seq2seq, not mlm$",
    ),
    cli_case(
        "train --config experiments/lm_shakespeare.py --workdir {tmp}/never --set train.evals=no_such_task",
        r"train\.evals: unknown task 'no_such_task'",
        marks=HARNESS,
    ),
    cli_case(
        "eval --workdir {lm} --tasks shakespeare_cloze --limit 0",
        r"--limit must be > 0 \(examples per task, or a fraction < 1\), got 0$",
    ),
    cli_case(
        "eval --workdir {lm} --tasks shakespeare_cloze --batch-size 0",
        r"--batch-size must be >= 1 \(rows per forward pass\), got 0$",
    ),
    cli_case("eval --workdir {lm} --hf {lm} --tasks shakespeare_cloze", r"--tasks: give one of --workdir W"),
    cli_case(
        "eval --workdir {lm} --tasks shakespeare_cloze --set decode.beam_size=4",
        r"--set decode\.beam_size=4: with --tasks the model is evaluated as saved",
    ),
    cli_case(
        "eval --workdir {lm} --tasks no_such_task",
        r"unknown task 'no_such_task': not a task of lm-eval nor of --include-path \(shipped: instruct_exact, ",
        marks=HARNESS,
    ),
    cli_case(
        "eval --workdir {lm} --tasks local_cloze --include-path {task_missing_data}",
        r"task 'local_cloze': its data_files\.test missing/cloze\.jsonl does not exist \(relative to \S+\)$",
        marks=HARNESS,
    ),
    cli_case(
        "eval --workdir {lm} --tasks local_cloze --include-path {tmp}/nowhere",
        r"--include-path \S+/nowhere: no such directory$",
        marks=HARNESS,
    ),
    cli_case("export --workdir {empty} --out {tmp}/out", r"\S+config\.json does not exist"),
    # `serve`: the server's settings and the workdir, checked before the engine loads anything
    cli_case("serve --workdir {lm} --port 70000", r"serve\.port: a TCP port in \[1, 65535\], got 70000"),
    cli_case("serve --workdir {lm} --port 0", r"serve\.port: a TCP port in \[1, 65535\], got 0"),
    cli_case("serve --workdir {lm} --set engine.seed=-1", r"engine\.seed: must be in \[0, 2\*\*32\)"),
    cli_case("serve --workdir {lm} --port http", r"argument --port: invalid int value: 'http'"),
    cli_case("serve --workdir {lm} --api-key ''", r"serve\.api_key: a non-empty key without spaces"),
    cli_case("serve --workdir {lm} --host ''", r"serve\.host: an address to listen on"),
    cli_case("serve --workdir {lm} --model-name 'a b'", r"serve\.model_name: a non-empty name without spaces"),
    cli_case("serve --workdir {tmp}/missing", r"\S+config\.json does not exist: \S+ is not a training workdir"),
    cli_case("serve --workdir {empty}", r"\S+config\.json does not exist: \S+ is not a training workdir"),
    cli_case(
        "serve --workdir {lm} --set train.steps=3", r"--set train\.steps=3: `serve` --set changes the engine only"
    ),
    # `serve --lora NAME=WORKDIR`: a LoRA run's adapters beside the model, refused before anything is served
    cli_case("serve --workdir {lm} --lora tuned", r"--lora 'tuned': NAME=WORKDIR expected"),
    cli_case("serve --workdir {lm} --lora lm={lm}", r"--lora lm=\.\.\.: 'lm' is the base model's name too"),
    cli_case("serve --workdir {lm} --lora plain={lm}", r"--lora: adapters\['plain'\]: the model has no LoRA adapters"),
    cli_case(
        "serve --workdir {lm} --lora other={mlm}",
        r"--lora: adapters\['other'\]: model\.mode='encoder_only' differs from the served model's 'decoder_only'",
    ),
    cli_case("export --workdir {config_only} --out {tmp}/out", r"\S+checkpoints holds no checkpoint: train first"),
    cli_case("export-hf --workdir {empty} {tmp}/out", r"\S+config\.json does not exist"),
    cli_case("export-hf --workdir {copy} {tmp}/out", r"no Hugging Face family expresses this model"),
    cli_case("plot --workdir {empty}", r"\S+metrics\.jsonl does not exist"),
    cli_case("config {tmp}/missing.py", r"experiment file \S+missing\.py does not exist"),
    cli_case("config {empty}", r"\S+ is a directory without config\.json: give experiments/NAME\.py or a training"),
    cli_case(
        "config experiments/copy_task.py --set train.stepz=5",
        r"train\.stepz: unknown field; did you mean train\.steps\? \(known: ",
    ),
    cli_case(
        "train --config experiments/lm_shakspeare.py --workdir {tmp}/never",
        r"experiment file experiments/lm_shakspeare\.py does not exist; did you mean experiments/lm_shakespeare\.py or "
        r"experiments/mlm_shakespeare\.py\?$",
    ),
    cli_case(
        "generate --workdir {mlm} --prompt KING", r"`generate` needs a decoder_only model; \S+mlm holds encoder_only"
    ),
    cli_case(
        "translate --workdir {lm} --src KING", r"`translate` needs an encoder_decoder model; \S+lm holds decoder_only"
    ),
    cli_case("generate --workdir {lm}", r"give --prompt TEXT or --prompt-file FILE"),
    cli_case("generate --workdir {lm} --prompt-file {tmp}/missing.txt", r"\S+missing\.txt: no such data file"),
    cli_case(
        "generate --workdir {lm} --prompt-file {not_utf8}/prompts.txt",
        r"\S+prompts\.txt:2: not UTF-8 \(invalid start byte at byte 0\)",
    ),
    cli_case("generate --workdir {lm} --prompt-file {blank}/prompts.txt", r"\S+prompts\.txt:2: an empty line"),
    cli_case("generate --workdir {lm} --prompt ''", r"prompt 0 is empty"),
    cli_case(
        "generate --workdir {lm} --prompt " + "x" * 200,
        r"prompt 0 has 200 tokens; with model\.max_len=128 at most 127 fit",
    ),
    cli_case("generate --workdir {lm} --prompt KING --set decode.temperature=0", r"decode\.temperature: must be > 0"),
    cli_case(
        "generate --workdir {lm} --prompt KING --set model.d_model=8",
        r"--set model\.d_model=8: `generate` --set changes decoding only \(decode\.FIELD=VALUE\)",
    ),
    cli_case("generate --workdir {lm} --prompt KING --set decode.num_return=9", r"decode\.num_return: must be in"),
    cli_case(
        "translate --workdir {copy} --src hello",
        r"source 0: 'hello' is not a symbol: this task's tokens are numbers separated by spaces",
    ),
    cli_case(
        "translate --workdir {copy} --src '2 3 99'",
        r"source 0: token id 99 at index 2 is outside the vocabulary \[0, 11\)",
    ),
    cli_case("generate --exported {empty} --prompt KING", r"\S+config\.json does not exist: write one with"),
    cli_case("generate --hf {empty} --prompt KING", r"\S+config\.json does not exist"),
    cli_case("generate --workdir {lm} --hf {empty} --prompt KING", r"argument --hf: not allowed with argument"),
    cli_case("import-hf {empty} --workdir {tmp}/never", r"\S+config\.json does not exist"),
    cli_case(
        "import-hf {unknown_family} --workdir {tmp}/never",
        r"\S+config\.json: model_type='mamba' is not supported "
        r"\(jaxformer reads \['bart', 'bert', 'deepseek_v3', 'gemma2', 'gemma3_text', 'gpt2', ",
    ),
    cli_case(
        "import-hf {no_weights} --workdir {tmp}/never",
        r"\S+no_weights holds neither model\.safetensors nor model\.safetensors\.index\.json",
    ),
    cli_case("import-hf {garbage} --workdir {tmp}/never", r"\S+config\.json is not JSON \(Expecting property name"),
    cli_case("import-hf {llama_no_width} --workdir {tmp}/never", r"\S+/llama_no_width/config\.json lacks '\w+'$"),
    cli_case("generate --hf {llama_no_width} --prompt KING", r"\S+/llama_no_width/config\.json lacks '\w+'$"),
    cli_case(
        "import-hf {mixtral_top5} --workdir {tmp}/never",
        r"config\.json: num_experts_per_tok=5 must be in \[1, num_local_experts=4\]",
    ),
    cli_case(
        "import-hf {switch_router_bias} --workdir {tmp}/never", r"config\.json: router_bias=True is not supported"
    ),
    cli_case(
        "import-hf {deepseek_fp8} --workdir {tmp}/never",
        r"config\.json: quantization_config \(quant_method='fp8'\) is not supported: jaxformer reads float weights",
    ),
    cli_case(
        "import-hf {deepseek_interleave} --workdir {tmp}/never", r"config\.json: rope_interleave=False is not supported"
    ),
    cli_case(
        "import-hf {qwen_dynamic_rope} --workdir {tmp}/never",
        r"config\.json: rope_scaling=\{'rope_type': 'dynamic', 'factor': 2\.0\} is not supported \(jaxformer reads",
    ),
    cli_case(
        "import-hf {switch_step_float} --workdir {tmp}/never",
        r"config\.json: decoder_sparse_step=1\.5 must be a whole number of layers",
    ),
    cli_case(
        "import-hf {peft_base} --workdir {tmp}/never --adapter {peft_other_base}",
        r"\S+adapter_model\.safetensors: base_model\.model\.transformer\.h\.0\.attn\.c_attn\.lora_A\.weight has shape "
        r"\(4, 32\), the base's \S+ wants \(4, 16\) \(r=4\): an adapter for another base model\?",
    ),
    cli_case(
        "import-hf {peft_base} --workdir {tmp}/never --adapter {peft_not_lora}",
        r"\S+adapter_config\.json: peft_type='PREFIX_TUNING'; jaxformer reads LoRA adapters",
    ),
    cli_case("import-hf {peft_base} --workdir {tmp}/never --adapter {peft_no_r}", r"\S+adapter_config\.json lacks r$"),
    cli_case(
        "import-hf {peft_base} --workdir {tmp}/never --adapter {peft_dora}",
        r"\S+adapter_config\.json: use_dora=True is not supported",
    ),
    cli_case(
        "import-hf {peft_base} --workdir {tmp}/never --adapter {peft_lm_head}",
        r"\S+adapter_config\.json: target_modules names 'lm_head', no module of this gpt2 model",
    ),
    cli_case(
        "import-hf {peft_base} --workdir {tmp}/never --adapter {tmp}/nowhere", r"\S+adapter_config\.json does not"
    ),
    cli_case(
        "export-hf --workdir {lm} {tmp}/a_file",
        r"export-hf: \S+a_file is a file, not a directory: give a new directory",
    ),
    cli_case(
        "export-hf --workdir {lm} {garbage}",
        r"export-hf: \S+garbage is not empty \(config\.json\): give a new directory, or --overwrite to replace",
    ),
    cli_case(
        "export-hf --workdir {lm} {readme} --overwrite",
        r"export-hf --overwrite: \S+readme holds no config\.json or adapter_config\.json \(README\.md\): it is not",
    ),
    cli_case(  # a directory that cannot be made (sysfs refuses even root): the OS's reason and the path, one line
        "export-hf --workdir {lm} /sys/jaxformer-export",
        r"export-hf: cannot write the Hugging Face directory /sys/jaxformer-export: [A-Z][a-z ]+ "
        r"\(/sys/jaxformer-export\)$",
    ),
    cli_case("export-hf --workdir {lm} {tmp}/out --adapter", r"--adapter: \S+ has no LoRA adapters \(lora\.rank=0\)"),
    cli_case(
        "generate --hf {damaged_weights} --prompt hi",
        r"\S+damaged_weights/model\.safetensors: not a readable safetensors file \(",
    ),
    cli_case("plan --config experiments/copy_task.py --devices 0", r"--devices: must be positive, got 0"),
    cli_case("plan --config experiments/copy_task.py --device-memory lots", r"--device-memory: cannot read 'lots'"),
    cli_case("plan --config experiments/copy_task.py --within 100", r"--within: a percentage in \[0, 100\), got 100"),
    cli_case("plan --config experiments/copy_task.py --jobs 0", r"--jobs: must be positive, got 0"),
    cli_case(
        "plan --config experiments/copy_task.py --device-memory 100kB",
        r"mesh: the training state alone is 0\.00269 GB a device .* > 0\.0001 GB",
    ),
    cli_case("plan --config {tmp}/missing.py", r"experiment file \S+missing\.py does not exist"),
    cli_case("plan --config experiments/copy_task.py --search", r"--device-memory: give the memory of one device"),
    cli_case(
        "plan --config experiments/copy_task.py --search --target tpu-v5e:2x2 --set train.batch_size=3 "
        "--set model.num_heads=1",
        r"train\.batch_size=3 does not divide over the batch shards of any split of 4 devices",
    ),
    cli_case("plan --config experiments/copy_task.py --search --target tpu-v9:2x2", r"--target tpu-v9:2x2: libtpu"),
    cli_case("sweep {tmp}/missing.py --workdir {tmp}/never", r"sweep file \S+missing\.py does not exist"),
    cli_case("sweep {sweep_without_function}/sweep.py --workdir {tmp}/never", r"\S+sweep\.py defines no get_sweep"),
    cli_case("sweep experiments/sweeps/copy_task.py --workdir {tmp}/never --workers 0", r"--workers: must be"),
    cli_case("sweep experiments/sweeps/copy_task.py --workdir {tmp}/never --workers many", r"argument --workers: "),
    cli_case(
        "sweep experiments/sweeps/copy_task.py --workdir {tmp}/never --trials 0", r"--trials: must be >= 1, got 0"
    ),
    cli_case(
        "sweep experiments/sweeps/copy_task.py --workdir {tmp}/never --set train.learning_rate=0.1",
        r"--set train\.learning_rate: is searched by the sweep",
    ),
    cli_case(
        "sweep experiments/sweeps/copy_task.py --workdir {tmp}/never --set train.stepz=3", r"train\.stepz: unknown"
    ),
]


@contextlib.contextmanager
def refused_within(seconds: int):
    """A refusal comes before any training: a command still running after `seconds` was not refused."""

    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s: the input was not refused up front")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_text_file_pattern_reads_every_file_it_matches_in_order(places, tmp_path, capsys):
    """`translate --src-file` with a glob matching two files translates their lines in the files' sorted
    order, as the same texts given by --src do (a pattern of several files crashed the command)."""
    (tmp_path / "b.txt").write_text("4 5 6\n")
    (tmp_path / "a.txt").write_text("1 2 3\n7 8\n")
    assert cli.main(["translate", "--workdir", places["copy"], "--src-file", str(tmp_path / "*.txt")]) == 0
    from_files = capsys.readouterr().out
    assert cli.main(["translate", "--workdir", places["copy"], "--src", "1 2 3", "--src", "7 8", "--src", "4 5 6"]) == 0
    assert from_files == capsys.readouterr().out and from_files.count("=>") == 3


def test_an_int_override_is_read_exactly_as_written():
    """`--set` reads an int field as written, never through a float: 1e3 and 1_000 are 1000, and 2**53 + 1
    keeps its last digit (a float has none for it) in the refusal of a step count past int32."""
    cfg = load_experiment("experiments/copy_task.py")
    for raw, want in (("1e3", 1000), ("1_000", 1000)):
        assert apply_overrides(cfg, [f"train.steps={raw}"]).train.steps == want
    with pytest.raises(ConfigError, match=r"train\.steps: .*, got 9007199254740993$"):
        apply_overrides(cfg, ["train.steps=9007199254740993"])


def test_a_tuple_override_reads_each_item_by_its_type():
    """`--set` reads a tuple field as comma-separated items of its type: GRPO's reward weights (floats)
    beside its rewards (names), an empty value as (), and an item that is not a float refused by name."""
    cfg = load_experiment("experiments/grpo_reverse.py")
    reward = "jaxformer.post_train.rewards:exact_match"
    two = apply_overrides(cfg, [f"grpo.rewards={reward}, {reward}", "grpo.reward_weights=1, 2.5e-1"]).grpo
    assert two.rewards == (reward, reward) and two.reward_weights == (1.0, 0.25)
    assert apply_overrides(cfg, ["grpo.reward_weights="]).grpo.reward_weights == ()
    with pytest.raises(
        ConfigError, match=r"^grpo\.reward_weights: cannot parse '1,x' as comma-separated float values$"
    ):
        apply_overrides(cfg, ["grpo.reward_weights=1,x"])
    with pytest.raises(ConfigError, match=r"grpo\.reward_weights: 2 weights for 1 rewards"):
        apply_overrides(cfg, ["grpo.reward_weights=1,2"])


@pytest.mark.parametrize("argv, message, rc, found_while_reading", CLI_CASES)
def test_cli_refuses_with_one_line(places, capsys, argv, message, rc, found_while_reading):
    before = sorted(str(p) for p in pathlib.Path(places["tmp"]).rglob("*"))
    try:
        with refused_within(60):
            code = cli.main(shlex.split(argv.format(**places)))
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == rc, err
    assert "Traceback" not in err
    lines = err.splitlines()
    last = lines[-1]
    if not last.startswith("jaxformer"):  # ours: one line; argparse's: usage, then "jaxformer ...: error: ..."
        assert len(lines) == 1, err
    assert re.search("error: " + message, last), last
    after = sorted(str(p) for p in pathlib.Path(places["tmp"]).rglob("*"))
    if found_while_reading:
        made = pathlib.Path(places["tmp"]) / "never"
        assert not list(made.glob("checkpoints/*")) and not (made / "metrics.jsonl").exists()
        shutil.rmtree(made)
    else:
        assert after == before, "a refused command changed the files"


V = 32


@pytest.fixture(scope="module")
def models():
    return {
        mode: jf.build_model(jf.tiny(mode, vocab_size=V, max_len=16)) for mode in ("decoder_only", "encoder_decoder")
    }


def ids(*shape, high=V, dtype=jnp.int32):
    return jnp.asarray(np.arange(np.prod(shape)).reshape(shape) % high, dtype)


def api_case(name, call, error, message):
    return pytest.param(call, error, message, id=name)


def save_past_a_file_size_limit(places):
    """`start_workdir` where every file write past 4 KiB fails (EFBIG, as ENOSPC on a full disk): the
    kernel refuses orbax's and tensorstore's writes alike (a real full disk: test_faults.py)."""
    import resource

    from jaxformer.checkpoint import start_workdir
    from jaxformer.state import state_factory

    cfg = apply_overrides(load_experiment("experiments/copy_task.py"), SMALL["copy"])
    state = jax.jit(state_factory(cfg)[1])()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        start_workdir(pathlib.Path(places["tmp"]) / "limited", cfg, state)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)


LM, S2S = "decoder_only", "encoder_decoder"


def moe_model():
    """A decoder with MoE layers (every other one: its dense layers have FFN kernels LoRA could reach)."""
    return jf.build_model(
        jf.tiny("decoder_only", num_decoder_layers=2, moe=jf.config.MoEConfig(num_experts=2, every=2))
    )


def save_switch_with_first_layer_sparse(places):
    """save_hf of a Switch model whose decoder's MoE layer is its first (layer 0 of 2), which no
    decoder_sparse_step says."""
    from jaxformer.interop import hf

    cfg = hf.config_from_hf(_golden_config("switch"))
    hf.save_hf(
        jf.build_model(cfg.replace(moe=dataclasses.replace(cfg.moe, decoder_offset=0))),
        pathlib.Path(places["tmp"], "never"),
    )


TOKENS = types.SimpleNamespace(bos_id=1, eos_id=2)  # a tokenizer's special ids, for id lists given as sources


def record(**fields):
    from jaxformer.post_train import pairs

    return lambda m, p: pairs.record_texts(fields, pairs.FIELDS, None)


def tokenize_pair(record: tuple, max_len: int):
    """One (where, prompt, chosen, rejected) record tokenized for a decoder of `max_len` positions."""
    from jaxformer.post_train import pairs

    cfg = jf.config.Config(
        model=jf.tiny("decoder_only", vocab_size=260),
        train=TrainConfig(objective="preference"),
        data=jf.config.DataConfig(source="files", files=("pairs.jsonl",), tokenizer="byte", max_len=max_len),
    )
    return pairs.tokenize(cfg, jf.data.ByteTokenizer(), [record])


def engine_with_a_request(model):
    """An engine over `model` with one request queued."""
    from jaxformer.engine import Engine, SamplingParams

    engine = Engine(model, jf.config.EngineConfig(page_size=4, num_pages=8, max_slots=1), eos_id=2)
    engine.add_request([3, 4], SamplingParams(max_tokens=2))
    return engine


def post_train_rewards():
    from jaxformer.post_train import rewards

    return rewards


def score_with(fn):
    """The rewards of two samples by one reward function `fn`, named "bad:fn"."""
    return post_train_rewards().score([("bad:fn", fn)], (1.0,), ["p", "q"], ["a", "b"], ["a", "c"])


def grpo_task(spec):
    """`grpo.task` as the GRPO loop loads it."""
    from jaxformer.post_train import rl

    return rl.load_task(spec)


def short_task() -> str:
    """The spec of a task in a file of its own that returns one record whatever it is asked."""
    path = pathlib.Path(tempfile.mkdtemp()) / "short.py"
    path.write_text("def task(split, count, seed):\n    return [{'prompt': '12', 'answer': '21'}]\n")
    return f"{path}:task"


def grpo_prompts(records):
    """The prompts of `records` checked for a GRPO run whose rows are 16 positions wide."""
    from jaxformer.post_train import rl

    cfg = jf.config.Config(
        model=jf.tiny("decoder_only"), data=jf.config.DataConfig(max_len=16), grpo=jf.config.GRPOConfig(group_size=2)
    )
    return rl.check_records(records, rl.CharTokenizer(), cfg, "grpo.task train")


API_CASES = [
    # Preference tuning built in code: the section, the mode, and one record at a time.
    api_case(
        "PreferenceConfig label smoothing on IPO",
        lambda m, p: jf.config.PreferenceConfig(loss="ipo", label_smoothing=0.1),
        ConfigError,
        r"preference\.label_smoothing: applies to the sigmoid and simpo losses, not 'ipo'",
    ),
    api_case(
        "preference objective on an encoder",
        lambda m, p: jf.config.Config(
            model=jf.tiny("encoder_only"),
            train=TrainConfig(objective="preference"),
            data=jf.config.DataConfig(source="files", files=("pairs.jsonl",), tokenizer="byte"),
        ),
        ConfigError,
        r"train\.objective: objective='preference' needs model\.mode=\('decoder_only', 'encoder_decoder'\)",
    ),
    api_case(
        "pair with an empty completion",
        record(prompt="a", chosen=" ", rejected="b"),
        ValueError,
        r"field 'chosen' is empty: nothing to prefer or reject",
    ),
    api_case(
        "pair of messages without a template",
        record(chosen=[{"role": "assistant", "content": "x"}], rejected=[{"role": "assistant", "content": "y"}]),
        ValueError,
        r"'chosen' and 'rejected' hold messages: set data\.template",
    ),
    api_case(
        "pair longer than the context",
        lambda m, p: tokenize_pair(("pairs.jsonl:3", "Upper: abc", "ABC", "abc"), max_len=8),
        DataError,
        r"pairs\.jsonl:3: 'prompt' and 'chosen' take 14 tokens \(EOS included\), more than data\.max_len \+ 1 = 9",
    ),
    api_case(
        "pair whose completion is a number",
        record(prompt="a", chosen=1, rejected="b"),
        ValueError,
        r"field 'chosen' is int, not a string",
    ),
    # A per-stack MoE layout Hugging Face's Switch cannot say: refused naming both fields, nothing written.
    api_case(
        "save_hf Switch layout with no sparse step",
        lambda m, p: save_switch_with_first_layer_sparse(p),
        ConfigError,
        r"switch_transformers: model\.moe\.decoder_offset: the decoder's MoE layers \[0\] .* no decoder_sparse_step",
    ),
    # LoRA built in code: the section refuses what the command line does, and the rank against the model.
    api_case(
        "LoRAConfig unknown target",
        lambda m, p: jf.config.LoRAConfig(rank=8, targets=("q", "qkv")),
        ConfigError,
        r"lora\.targets: unknown 'qkv' \(valid: q, k, v, o, wi, wi_gate, wo, embed, head\)",
    ),
    api_case(
        "LoRA rank above a projection's width",
        lambda m, p: jf.config.Config(
            model=jf.tiny("decoder_only"),
            train=TrainConfig(objective="lm"),
            lora=jf.config.LoRAConfig(rank=17, targets=("wo",)),
        ),
        ConfigError,
        r"lora\.rank: rank=17 exceeds the width 16 of projection 'wo'",
    ),
    # add_adapters on a model built in code asks what Config asks (config.check_lora_fits): no silent 0 adapters
    api_case(
        "add_adapters: a stack the model lacks",
        lambda m, p: lora.add_adapters(m[LM], jf.config.LoRAConfig(rank=2, stacks=("encoder",))),
        ConfigError,
        r"lora\.stacks: \('encoder',\) names no stack of a decoder_only model \(it has decoder\)",
    ),
    api_case(
        "add_adapters: rank above a projection's width",
        lambda m, p: lora.add_adapters(m[LM], jf.config.LoRAConfig(rank=17, targets=("wo",))),
        ConfigError,
        r"lora\.rank: rank=17 exceeds the width 16 of projection 'wo'",
    ),
    api_case(
        "LoRAConfig targets as a string",
        lambda m, p: jf.config.LoRAConfig(rank=2, targets="qv"),
        ConfigError,
        r"lora\.targets: a tuple of names such as \('q', 'v'\), not the string 'qv'",
    ),
    api_case(
        "LoRAConfig stacks as a string",
        lambda m, p: jf.config.LoRAConfig(rank=2, stacks="decoder"),
        ConfigError,
        r"lora\.stacks: a tuple of names such as \('encoder', 'decoder'\), not the string 'decoder'",
    ),
    # LoRA on a mixture of experts built in code (Config refuses the same from a config): the experts' stacked
    # kernels take neither adapters nor int8 storage, and skipping them would leave them silently full-rank/float.
    api_case(
        "LoRA wi on MoE layers",
        lambda m, p: lora.add_adapters(moe_model(), jf.config.LoRAConfig(rank=2, targets=("q", "wi"))),
        ConfigError,
        r"lora\.targets: 'wi' would adapt the MoE layers of the decoder \(model\.moe\)",
    ),
    api_case(
        "int8 base with MoE layers",
        lambda m, p: lora.quantize_base(moe_model(), jf.config.LoRAConfig(rank=2, base="int8")),
        ConfigError,
        r"lora\.base: 'int8' cannot store the MoE layers' expert kernels \(model\.moe, in the decoder\)",
    ),
    api_case(
        "Config: int8 base with MoE",
        lambda m, p: jf.config.Config(
            model=jf.tiny("decoder_only", moe=jf.config.MoEConfig(num_experts=2)),
            train=TrainConfig(objective="lm"),
            lora=jf.config.LoRAConfig(rank=2, base="int8"),
        ),
        ConfigError,
        r"lora\.base: 'int8' cannot store the MoE layers' expert kernels \(model\.moe\)",
    ),
    # A workdir's or a pretrained model's tokenizer file, damaged: the libraries' own errors named no file.
    api_case(
        "damaged tokenizer.model",
        lambda m, p: SentencePieceTokenizer(pathlib.Path(p["damaged_tokenizers"]) / "tokenizer.model"),
        DataError,
        r"\S+tokenizer\.model is not a SentencePiece model \(.*could not parse",
    ),
    api_case(
        "damaged tokenizer.json",
        lambda m, p: HFTokenizer(p["damaged_tokenizers"]),
        DataError,
        r"\S+tokenizer\.json cannot be read as a Hugging Face tokenizer \(",
    ),
    # Models: token ids that are not ids, shapes that are not [B, T].
    api_case(
        "float ids",
        lambda m, p: m[LM](ids(2, 4, dtype=jnp.float32)),
        TypeError,
        r"ids: token ids must be integers, got float32",
    ),
    api_case("id = vocab", lambda m, p: m[LM](ids(1, 4).at[0, 2].set(V)), ValueError, r"outside the vocabulary"),
    api_case("negative id", lambda m, p: m[LM](ids(1, 4).at[0, 0].set(-1)), ValueError, r"outside the vocabulary"),
    api_case(
        "id = vocab under nnx.jit",
        lambda m, p: nnx.jit(lambda model, x: model(x))(m[LM], ids(1, 4).at[0, 1].set(V + 5)),
        (ValueError, jax.errors.JaxRuntimeError),  # inside a user's jit, XLA's error carries our message
        r"token id 37 .*outside the vocabulary \[0, 32\)",
    ),
    api_case("ids [T]", lambda m, p: m[LM](ids(4)), ValueError, r"ids: token ids are \[B, T\], got shape \(4,\)"),
    api_case("ids [B, T, 1]", lambda m, p: m[LM](ids(1, 4, 1)), ValueError, r"got shape \(1, 4, 1\)"),
    api_case("too long", lambda m, p: m[LM](ids(1, 17)), ValueError, r"17 positions exceed model\.max_len=16"),
    api_case(
        "too long under nnx.jit",
        lambda m, p: nnx.jit(lambda model, x: model(x))(m[LM], ids(1, 20)),
        ValueError,
        r"20 positions exceed model\.max_len=16",
    ),
    api_case("int64 ids past int32", lambda m, p: m[LM](np.full((1, 2), 2**40)), ValueError, r"outside the vocabulary"),
    api_case("string ids", lambda m, p: m[LM]([["a", "b"]]), TypeError, r"token ids must be integers, got str \('a'\)"),
    api_case(
        "encoder-decoder without target", lambda m, p: m[S2S](ids(1, 4)), ValueError, r"takes \(src_ids, tgt_ids\)"
    ),
    api_case("decoder-only given two", lambda m, p: m[LM](ids(1, 4), ids(1, 4)), ValueError, r"takes one id array"),
    api_case(
        "batch sizes differ",
        lambda m, p: m[S2S](ids(2, 4), ids(3, 4)),
        ValueError,
        r"batch sizes differ: src_ids has 2 rows, tgt_ids 3",
    ),
    # Decoding.
    api_case(
        "generate with an encoder-decoder",
        lambda m, p: decode.generate(m[S2S], [[3, 4]], eos_id=None),
        ValueError,
        r"generate\(\) continues prompts of a decoder_only model; this one is encoder_decoder",
    ),
    api_case(
        "translate with a decoder",
        lambda m, p: decode.translate(m[LM], [[3, 4]], bos_id=1, eos_id=2),
        ValueError,
        r"translate\(\) needs an encoder_decoder model; this one is decoder_only",
    ),
    api_case(
        "prompts as a string",
        lambda m, p: decode.generate(m[LM], "KING", eos_id=None),
        TypeError,
        r"prompts are lists of token ids, not text",
    ),
    api_case("empty prompt", lambda m, p: decode.generate(m[LM], [[3], []], eos_id=None), ValueError, r"1 is empty"),
    api_case(
        "prompt too long", lambda m, p: decode.generate(m[LM], [[3] * 16], eos_id=None), ValueError, r"has 16 tokens"
    ),
    api_case(
        "prompt id = vocab", lambda m, p: decode.generate(m[LM], [[V]], eos_id=None), ValueError, r"outside the vocab"
    ),
    api_case(
        "eos outside",
        lambda m, p: decode.generate(m[LM], [[3]], eos_id=V),
        ValueError,
        r"eos_id: token id 32 is outside",
    ),
    api_case(
        "settings not DecodeConfig",
        lambda m, p: decode.generate(m[LM], [[3]], {"strategy": "beam"}, eos_id=None),
        TypeError,
        r"settings: a jaxformer\.config\.DecodeConfig, got dict",
    ),
    # Token ids at every public entry point: one checked conversion (layers.as_token_ids), nothing
    # rounded, wrapped into int32 or clamped; an error naming the argument (and the range).
    *[
        api_case(f"{name}: {case}", call, error, message)
        for name, gen in {
            "generate": lambda m, rows, **k: decode.generate(m[LM], rows, eos_id=k.get("special")),
            "translate": lambda m, rows, **k: decode.translate(m[S2S], rows, bos_id=1, eos_id=k.get("special")),
        }.items()
        for case, call, error, message in [
            (
                "float ids",
                lambda m, p, g=gen: g(m, [[3, 4.0]]),
                TypeError,
                r" 0: token ids must be integers, got float",
            ),
            (
                "2**40",
                lambda m, p, g=gen: g(m, [[3, 2**40]]),
                ValueError,
                r" 0: token id 1099511627776 at index 1 is o",
            ),
            ("2**70", lambda m, p, g=gen: g(m, [[2**70]]), ValueError, r" 0: token id \d+ is outside the vocab.* 32\)"),
            ("negative", lambda m, p, g=gen: g(m, [[3], [-1]]), ValueError, r" 1: token id -1 at index 0 is outside"),
            ("bool in a list", lambda m, p, g=gen: g(m, [[True, 3]]), TypeError, r" 0: .* got bool \(True\)"),
            ("bool array", lambda m, p, g=gen: g(m, np.ones((2, 3), bool)), TypeError, r" 0: .* integers, got bool"),
            ("NumPy floats", lambda m, p, g=gen: g(m, np.ones((2, 3))), TypeError, r" 0: .*integers, got float64"),
            ("jax floats", lambda m, p, g=gen: g(m, jnp.ones((2, 3))), TypeError, r" 0: .*integers, got float32"),
            ("jax ids past V", lambda m, p, g=gen: g(m, ids(2, 3) + V), ValueError, r" 0: token id 32 at index 0 is"),
            ("ragged inside a row", lambda m, p, g=gen: g(m, [[[3], [4, 5]]]), ValueError, r" 0: rows of diff"),
            ("a flat list", lambda m, p, g=gen: g(m, [3, 4]), ValueError, r" 0: token ids are \[T\], got shape \(\)"),
            ("empty row", lambda m, p, g=gen: g(m, [[3], []]), ValueError, r" 1 is empty"),
            ("None", lambda m, p, g=gen: g(m, None), TypeError, r"s: a list of token-id lists .*, got None"),
            ("None row", lambda m, p, g=gen: g(m, [None]), TypeError, r" 0: token ids must be integers, got None"),
            ("float eos", lambda m, p, g=gen: g(m, [[3]], special=2.0), TypeError, r"eos_id: .* integers, got float"),
            ("eos 2**40", lambda m, p, g=gen: g(m, [[3]], special=2**40), ValueError, r"eos_id: token id \d+ is out"),
        ]
    ],
    api_case(
        "translate: float bos",
        lambda m, p: decode.translate(m[S2S], [[3]], bos_id=1.0, eos_id=2),
        TypeError,
        r"bos_id: token ids must be integers, got float",
    ),
    api_case(
        "translate_texts: float ids",
        lambda m, p: decode.translate_texts(m[S2S], TOKENS, [[3, 4.5]], DecodeConfig()),
        TypeError,
        r"source 0: token ids must be integers, got float \(4\.5\)",
    ),
    api_case("strip_after_eos: floats", lambda m, p: decode.strip_after_eos([3.7], 2), TypeError, r"ids: .* got float"),
    api_case("model: ragged rows", lambda m, p: m[LM]([[1, 2], [3]]), ValueError, r"ids: rows of different lengths"),
    api_case("model: no ids", lambda m, p: m[LM]([[]]), ValueError, r"ids is empty \(shape \(1, 0\)\)"),
    api_case("model: None", lambda m, p: m[LM](None), TypeError, r"ids: token ids must be integers, got None"),
    api_case("model: 2**70", lambda m, p: m[LM]([[2**70]]), ValueError, r"ids: token id \d+ is outside the vocabulary"),
    api_case(
        "model: bool src", lambda m, p: m[S2S](ids(1, 4) > 0, ids(1, 4)), TypeError, r"src_ids: .* integers, got bool"
    ),
    api_case(
        "id = vocab under the user's jax.jit, checked: our error, one line",
        lambda m, p: jf.checked(jax.jit(lambda params, x: nnx.merge(nnx.graphdef(m[LM]), params)(x)))(
            nnx.state(m[LM]), ids(1, 4).at[0, 1].set(V + 5)
        ),
        ValueError,
        r"^token id 37 at index \(0, 1\) is outside the vocabulary \[0, 32\)$",
    ),
    # Configs in Python.
    api_case(
        "build_model of a name", lambda m, p: jf.build_model("tiny"), TypeError, r"build_model takes a ModelConfig"
    ),
    api_case("d_model a string", lambda m, p: jf.tiny(d_model="64"), ConfigError, r"model\.d_model: "),
    api_case("unknown preset field", lambda m, p: jf.tiny(width=3), TypeError, r"width"),
    api_case(
        "objective and mode",
        lambda m, p: dataclasses.replace(load_experiment("experiments/copy_task.py"), train=TrainConfig()),
        ConfigError,
        r"train\.objective: objective='lm' needs model\.mode='decoder_only'",
    ),
    api_case(
        "unknown section",
        lambda m, p: from_dict({"modle": {}}),
        ConfigError,
        r"modle: unknown config section; did you mean model\?",
    ),
    # GRPO: the section, the run it needs, and the task's and reward functions' output, each named.
    api_case(
        "Engine.load_weights while a request waits",
        lambda m, p: engine_with_a_request(m[LM]).load_weights(m[LM]),
        ValueError,
        r"load_weights: requests are still running; finish or abort them first",
    ),
    api_case(
        "Engine request larger than the pool",
        lambda m, p: jf.engine.Engine(m[LM], jf.config.EngineConfig(page_size=4, num_pages=3), eos_id=2).add_request(
            [3, 4, 5, 6, 7], jf.engine.SamplingParams(max_tokens=6)
        ),
        ValueError,
        r"prompt \+ max_tokens = 11 positions need 3 pages at once; the pool has 2 \(engine\.num_pages=3",
    ),
    api_case(
        "SamplingParams top_logprobs without logprobs",
        lambda m, p: jf.engine.SamplingParams(top_logprobs=3),
        ValueError,
        r"top_logprobs = 3 needs logprobs=True",
    ),
    api_case(
        "SamplingParams min_tokens over max_tokens",
        lambda m, p: jf.engine.SamplingParams(max_tokens=4, min_tokens=5),
        ValueError,
        r"min_tokens must be in \[0, max_tokens\], got 5",
    ),
    api_case(
        "SamplingParams ignore_eos not a bool",
        lambda m, p: jf.engine.SamplingParams(ignore_eos="yes"),
        ValueError,
        r"ignore_eos must be bool, got 'yes'",
    ),
    api_case(
        "SamplingParams choices with an empty one",
        lambda m, p: jf.engine.SamplingParams(choices=[(5, 6), ()]),
        ValueError,
        r"choices must each be a non-empty sequence of token ids \(ints >= 0\), got \(\)",
    ),
    api_case(
        "SamplingParams stop_token_ids of a token outside the vocabulary",
        lambda m, p: jf.engine.Engine(m[LM], jf.config.EngineConfig(page_size=4, num_pages=8), eos_id=2).add_request(
            [3, 4], jf.engine.SamplingParams(max_tokens=4, stop_token_ids=(7, 10**6))
        ),
        ValueError,
        r"stop_token_ids: token id 1000000 is outside the vocabulary \[0, ",
    ),
    api_case(
        "SamplingParams regex on an engine without a tokenizer",
        lambda m, p: jf.engine.Engine(m[LM], jf.config.EngineConfig(page_size=4, num_pages=8), eos_id=2).add_request(
            [3, 4], jf.engine.SamplingParams(max_tokens=4, regex="[ab]+")
        ),
        ValueError,
        r"regex needs an engine with a tokenizer and an EOS id",
    ),
    api_case(
        "SamplingParams json_schema and choices both",
        lambda m, p: jf.engine.SamplingParams(json_schema={"type": "object"}, choices=[(5,)]),
        ValueError,
        r"json_schema and choices both hold the output: give one",
    ),
    api_case(
        "SamplingParams presence_penalty out of OpenAI's range",
        lambda m, p: jf.engine.SamplingParams(presence_penalty=3),
        ValueError,
        r"presence_penalty must be in \[-2, 2\], got 3",
    ),
    api_case(
        "SamplingParams logit_bias of a token outside the vocabulary",
        lambda m, p: jf.engine.Engine(m[LM], jf.config.EngineConfig(page_size=4, num_pages=8), eos_id=2).add_request(
            [3, 4], jf.engine.SamplingParams(max_tokens=4, logit_bias={10**6: -100})
        ),
        ValueError,
        r"logit_bias: token id 1000000 is outside the vocabulary \[0, ",
    ),
    api_case(
        "GRPO group of one",
        lambda m, p: jf.config.GRPOConfig(group_size=1),
        ConfigError,
        r"grpo\.group_size: 1 sample per prompt has no group to compare with",
    ),
    api_case(
        "GRPO groups that do not divide the batch",
        lambda m, p: jf.config.Config(
            model=jf.tiny("decoder_only"), train=TrainConfig(batch_size=6), grpo=jf.config.GRPOConfig(group_size=4)
        ),
        ConfigError,
        r"grpo\.group_size: group_size=4 does not divide train\.batch_size=6",
    ),
    api_case(
        "GRPO reward weights of another length",
        lambda m, p: jf.config.GRPOConfig(group_size=2, reward_weights=(1.0, 2.0)),
        ConfigError,
        r"grpo\.reward_weights: 2 weights for 1 rewards",
    ),
    api_case(
        "GRPO reward that is not module:function",
        lambda m, p: jf.config.GRPOConfig(group_size=2, rewards=("exact_match",)),
        ConfigError,
        r"grpo\.rewards: 'exact_match' is not 'module:function'",
    ),
    api_case(
        "GRPO reward module without the function",
        lambda m, p: post_train_rewards().load_callable("jaxformer.post_train.rewards:nope", "grpo.rewards"),
        ValueError,
        r"grpo\.rewards: 'jaxformer\.post_train\.rewards' has no function 'nope'",
    ),
    api_case(
        "GRPO reward that raises",
        lambda m, p: score_with(lambda **kw: 1 / 0),
        ValueError,
        r"reward bad:fn raised ZeroDivisionError: division by zero",
    ),
    api_case(
        "GRPO reward that returns NaN",
        lambda m, p: score_with(lambda completions, **kw: [0.0, float("nan")]),
        ValueError,
        r"reward bad:fn returned nan for sample 1 \(completion 'b'\)",
    ),
    api_case(
        "GRPO reward of the wrong shape",
        lambda m, p: score_with(lambda completions, **kw: [1.0]),
        ValueError,
        r"reward bad:fn returned shape \(1,\), expected one per sample \(2,\)",
    ),
    api_case(
        "GRPO task that raises",
        lambda m, p: grpo_task("os:getcwd")("train", 4, seed=0),
        ValueError,
        r"grpo\.task os:getcwd raised TypeError: .*keyword",
    ),
    api_case(
        "GRPO task of too few records",
        lambda m, p: (
            grpo_task("jaxformer.post_train.tasks:reverse")("train", 4, seed=0)
            and grpo_task(short_task())("train", 4, seed=0)
        ),
        ValueError,
        r"grpo\.task \S+short\.py:task returned 1 records for \('train', 4\): a list of 4$",
    ),
    api_case(
        "GRPO prompt over the context",
        lambda m, p: grpo_prompts([{"prompt": "1" * 20, "answer": "1"}]),
        ValueError,
        r"grpo\.task train record 0 \('1{20}'\): 20 prompt tokens \+ grpo\.max_new_tokens=8 exceed data\.max_len=16",
    ),
    api_case(
        "GRPO prompt outside the characters",
        lambda m, p: grpo_prompts([{"prompt": "1+1=", "answer": "2"}, {"prompt": "one+1=", "answer": "2"}]),
        ValueError,
        r"grpo\.task train record 1 \('one\+1='\): 'o' is not one of the tokenizer's characters",
    ),
    api_case("unknown field", lambda m, p: from_dict({"model": {"w": 1}}), ConfigError, r"model\.w: unknown field"),
    api_case("decode field type", lambda m, p: DecodeConfig(beam_size="4"), ConfigError, r"decode\.beam_size: "),
    # Checkpoint saves that cannot be written: one OSError naming the directory, why, and what is kept.
    api_case(
        "save past a file size limit",
        lambda m, p: save_past_a_file_size_limit(p),
        CheckpointWriteError,
        r"cannot save the checkpoint of step 0 to \S+/limited/checkpoints: a file exceeds the size limit "
        r"\(File too large\); no checkpoint was written yet; raise the limit and rerun the same command$",
    ),
    # Loading saved models.
    api_case(
        "load_model: no directory", lambda m, p: jf.load_model(p["tmp"] + "/nowhere"), FileNotFoundError, r"nowhere"
    ),
    api_case("load_model: empty", lambda m, p: jf.load_model(p["empty"]), FileNotFoundError, r"config\.json"),
    api_case(
        "load_model: garbage config",
        lambda m, p: jf.load_model(p["garbage"]),
        ConfigError,
        r"config\.json is not a jaxformer config \(JSON, line 1",
    ),
    api_case(
        "load_model: a workdir",
        lambda m, p: jf.load_model(p["lm"]),
        FileNotFoundError,
        r"lm is a training workdir: export it first \(jaxformer export --workdir \S+ --out DIR\)",
    ),
]


@pytest.mark.parametrize("call, error, message", API_CASES)
def test_api_refuses_with_a_clear_error(models, places, call, error, message):
    with pytest.raises(error, match=message):
        call(models, places)


def test_export_hf_replaces_an_older_sharded_export_only_when_told(places, tmp_path, capsys):
    """An older export in shards (index + shards) is refused as a target; with --overwrite its files go
    first, so a reader (which prefers the index) gets the new weights, not the old ones."""
    from jaxformer.checkpoint import restore_workdir
    from jaxformer.config import read_config
    from jaxformer.interop import hf

    workdir, out = pathlib.Path(places["lm"]), tmp_path / "hf"
    cfg = read_config(workdir / "config.json")
    stale = jf.build_model(cfg.model, seed=7)
    hf.save_hf(stale, out, max_shard_bytes=2**14)  # an older export, sharded
    assert (out / hf.INDEX).is_file()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert cli.main(["export-hf", "--workdir", str(workdir), str(out)]) == 2
    assert re.fullmatch(r"error: export-hf: \S+hf is not empty \(.*\): .*--overwrite.*\n", capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "a refused export changed the directory"

    assert cli.main(["export-hf", "--workdir", str(workdir), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [hf.CONFIG, hf.WEIGHTS]  # no stale index or shard
    graphdef, state, _ = restore_workdir(cfg, workdir)
    ids = jnp.arange(8, dtype=jnp.int32)[None] % cfg.model.vocab_size
    expected = nnx.merge(graphdef, state.weights)(ids)
    np.testing.assert_allclose(hf.load_hf(out)(ids), expected, atol=1e-5, rtol=1e-5)
    assert not np.allclose(stale(ids), expected, atol=1e-3)  # the old weights would have been told apart


def test_a_data_error_ends_the_process_with_its_line_alone_every_time(tmp_path):
    """A TSV line short of a column, found as the data is prepared (the model built and the checkpoint
    manager open): the process's stderr is that one line, with no thread's traceback after it at the
    interpreter's exit (once 1 run in 3: `fit` now closes what runs in the background before it raises).
    Three runs, each in a process of its own (the exit is what is checked)."""
    rows = ["id\tsrc\ttgt", *(f"{i}\thello world number {i}\thallo welt nummer {i}" for i in range(40))]
    rows.insert(20, "x\tshort line only")
    (tmp_path / "pairs.tsv").write_text("\n".join(rows) + "\n")
    argv = [
        sys.executable, "-m", "jaxformer.cli", "train", "--config", "experiments/translate_en_de.py", "--quiet",
        *shlex.split("--set data.source=files --set data.fields=src,tgt --set data.tokenizer=byte "
                     "--set model.vocab_size=260 --set model.d_model=32 --set model.d_ff=64 "
                     "--set model.num_encoder_layers=1 --set model.num_decoder_layers=1"),
        "--set", f"data.files={tmp_path / 'pairs.tsv'}",
    ]  # fmt: skip
    root = pathlib.Path(__file__).parent.parent
    env = processes.cpu_env(PYTHONPATH=str(root))
    for run in range(3):
        out = processes.run([*argv, "--workdir", str(tmp_path / f"run{run}")], cwd=root, env=env)
        assert out.returncode == 2, out.stderr[-3000:]
        assert out.stderr == f"error: {tmp_path / 'pairs.tsv'}:21: expected 3 tab-separated columns, got 2\n", (
            f"run {run}: {out.stderr[-3000:]}"
        )
