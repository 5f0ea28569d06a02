"""Golden numbers for RoPE scaling (tests/test_rope_scaling.py): transformers' `ROPE_INIT_FUNCTIONS`
(inverse frequencies and attention factor) for linear, yarn and llama3 cases (needs torch and
transformers 4.57; CI has neither and reads the JSON).

    python scripts/make_rope_golden.py      # rewrites tests/golden/rope_scaling.json

Each case is a head dim, a RoPE base, max_position_embeddings and a `rope_scaling` dict as a
config.json holds it; the file keeps them with transformers' float32 inverse frequencies and factor.
"""

from __future__ import annotations

import json
import pathlib

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "golden" / "rope_scaling.json"
CASES = {  # name: (head dim, base, max_position_embeddings, rope_scaling)
    "linear": (64, 10_000.0, 4096, {"rope_type": "linear", "factor": 8.0}),
    "yarn_qwen": (128, 1_000_000.0, 131_072, {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32_768}),
    # DeepSeek-V3's own: R = 64, factor 40 over 4096 positions, mscale = mscale_all_dim = 1 (factor 1)
    "yarn_deepseek_v3": (64, 10_000.0, 163_840, {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                 "original_max_position_embeddings": 4096}),
    # mscale != mscale_all_dim: an attention factor that is not 1; beta_fast / beta_slow moved
    "yarn_mscales": (16, 10_000.0, 64, {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 2.0,
                                        "mscale": 1.0, "mscale_all_dim": 0.707,
                                        "original_max_position_embeddings": 16}),
    # no mscale: the attention factor 0.1 ln(factor) + 1; original length from max_position_embeddings
    "yarn_plain": (32, 10_000.0, 2048, {"rope_type": "yarn", "factor": 2.0}),
    "llama3": (128, 500_000.0, 131_072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}  # fmt: skip


def main() -> None:
    import transformers
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = {}
    for name, (K, base, longest, scaling) in CASES.items():
        cfg = LlamaConfig(hidden_size=K * 4, num_attention_heads=4, head_dim=K, rope_theta=base,
                          max_position_embeddings=longest, rope_scaling=dict(scaling))  # fmt: skip
        inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
        cases[name] = dict(head_dim=K, rope_theta=base, max_position_embeddings=longest, rope_scaling=scaling,
                           inv_freq=inv_freq.float().tolist(), attention_factor=float(factor))  # fmt: skip
    OUT.write_text(json.dumps({"transformers": transformers.__version__, "cases": cases}, indent=1) + "\n")
    print(f"{OUT}: {len(cases)} cases, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
