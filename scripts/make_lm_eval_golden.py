"""Golden files for tests/test_evaluation.py: lm-evaluation-harness's own `hf` model (PyTorch) on a tiny
random GPT-2 and a tiny random T5, on a multiple-choice task (shakespeare_cloze) and a generation task
(instruct_exact), 8 examples each; the test runs the model `jaxformer` on the same weights and checks
each example's log-likelihoods (and is-greedy flags) and generated text against these.

Writes tests/golden/lm_eval/{gpt2,t5}/: the model directory (config, safetensors, a byte-level BPE
tokenizer of 320 pieces trained on the shipped tasks' text) and `samples.json` (each example's answers
and the metrics). Deterministic (fixed seeds). Needs torch, transformers and lm-eval's hf extra, which
CI does not install; in an environment of their own (the CPU build of torch, pinned):

    python3 -m venv /tmp/venv-golden && /tmp/venv-golden/bin/pip install torch==2.13.0 \
        "transformers>=4.57,<4.58" "lm-eval[hf]>=0.4.13,<0.5" "huggingface-hub<1.0"
    /tmp/venv-golden/bin/python scripts/make_lm_eval_golden.py [gpt2] [t5]
"""

import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TASKS_DIR = ROOT / "jaxformer" / "evaluation" / "tasks"
OUT = ROOT / "tests" / "golden" / "lm_eval"
TASKS = ["shakespeare_cloze", "instruct_exact"]
LIMIT = 8
MAX_LENGTH = 128  # the models' context (GPT-2's n_positions; told to the hf model for T5, which has none)


def task_texts() -> list[str]:
    """The shipped tasks' text: what the tokenizer is trained on, so the tasks tokenize into real pieces."""
    texts = []
    for path in sorted(TASKS_DIR.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            texts += [
                v if isinstance(v, str) else " ".join(v) for v in json.loads(line).values() if not isinstance(v, int)
            ]
    return texts


def tokenizer(specials: list[str], post_eos: str | None):
    """A byte-level BPE of 320 pieces (specials first), wrapped as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(task_texts(), trainer)
    if post_eos is not None:  # T5's template: </s> after a text encoded with special tokens
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {post_eos}", special_tokens=[(post_eos, tok.token_to_id(post_eos))]
        )
    return tok


def make_gpt2(out: pathlib.Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = tokenizer(["<|endoftext|>"], None)
    eos = tok.token_to_id("<|endoftext|>")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    torch.manual_seed(0)
    # initializer_range 0.3 (not 0.02): peaked distributions, so greedy choices do not hang on rounding
    cfg = GPT2Config(
        vocab_size=tok.get_vocab_size(), n_positions=MAX_LENGTH, n_embd=16, n_layer=2, n_head=2,
        bos_token_id=eos, eos_token_id=eos, initializer_range=0.3,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)


def make_t5(out: pathlib.Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

    tok = tokenizer(["<pad>", "</s>", "<unk>"], "</s>")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )
    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=tok.get_vocab_size(), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=32, n_positions=MAX_LENGTH,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, initializer_factor=3.0, tie_word_embeddings=False,
    )  # fmt: skip
    model = T5ForConditionalGeneration(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)


def harness_samples(model_dir: pathlib.Path, backend: str) -> dict:
    """The hf model's answers per task and example, and its metrics."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=[str(TASKS_DIR)], include_defaults=False)
    results = evaluator.simple_evaluate(
        model="hf",
        model_args={
            "pretrained": str(model_dir), "backend": backend, "dtype": "float32", "device": "cpu",
            "max_length": MAX_LENGTH,
        },
        tasks=TASKS, limit=LIMIT, batch_size=1, task_manager=manager, log_samples=True, bootstrap_iters=0,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )  # fmt: skip
    out = {"metrics": {}, "samples": {}}
    for task in TASKS:
        metrics = results["results"][task]
        out["metrics"][task] = {k: v for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
        out["samples"][task] = [{"doc_id": s["doc_id"], "resps": s["resps"]} for s in results["samples"][task]]
    return out


def main(names: list[str]) -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    makers = {"gpt2": (make_gpt2, "causal"), "t5": (make_t5, "seq2seq")}
    for name in names or list(makers):
        make, backend = makers[name]
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        make(out)
        samples = harness_samples(out, backend)
        (out / "samples.json").write_text(json.dumps(samples, indent=1) + "\n")
        print(name, json.dumps(samples["metrics"]))


if __name__ == "__main__":
    main(sys.argv[1:])
