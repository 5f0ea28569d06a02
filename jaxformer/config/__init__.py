"""Typed, frozen, validated configs.

Every config is a frozen dataclass whose `__post_init__` checks its fields, so a
wrong value fails with the field named before anything is built or compiled.

Every name of the modules below is importable from `jaxformer.config` itself (`from jaxformer.config
import Config, ModelConfig, load_experiment`); each module holds one concern:

- `base`: ConfigError, `require`, each field's value checked against its annotation, "did you mean"
- `architecture`: the model section (ModelConfig), its mixture of experts (MoEConfig) and latent attention (MLAConfig)
- `rope`: RoPE scaling (RopeScalingConfig, `model.rope_scaling`: linear, yarn, llama3) and yarn_mscale
- `presets`: the published shapes (paper_base, paper_big, bert_base, gpt2_small, bart_base, t5_small,
  t5_v1_1_small, llama, tiny, PRESETS)
- `sections`: the run's other sections (TrainConfig, DataConfig, CheckpointConfig, DecodeConfig, MeshConfig)
- `lora`: the LoRA section (LoRAConfig) and its check against the model (check_lora_fits)
- `preference`: the preference-tuning section (PreferenceConfig: the DPO family's loss and constants)
- `run`: the run's Config and what its sections ask of one another (ring_blocks_unfit), SECTIONS
- `files`: experiment files and saved config.json (load_experiment, read_config, from_dict)
- `grpo`: the GRPO section (GRPOConfig) and what it asks of the run (check_grpo)
- `engine`: the inference engine's paged cache and scheduler (EngineConfig)
- `serve`: the HTTP server's section (ServeConfig), apart from the run's Config
- `overrides`: `--set section.field=value` (field_hint, parse_overrides, with_values, apply_overrides,
  apply_section_overrides)
"""

from jaxformer.config.architecture import MODES, MLAConfig, ModelConfig, MoEConfig
from jaxformer.config.base import ConfigError, check_field_types, did_you_mean, require
from jaxformer.config.engine import EngineConfig
from jaxformer.config.files import call_file, from_dict, load_experiment, read_config
from jaxformer.config.grpo import GRPOConfig, check_grpo
from jaxformer.config.lora import (
    LORA_MODEL_TARGETS,
    LORA_STACKS,
    LORA_TARGETS,
    MODE_STACKS,
    LoRAConfig,
    check_lora_fits,
)
from jaxformer.config.overrides import (
    apply_overrides,
    apply_section_overrides,
    field_hint,
    parse_overrides,
    with_values,
)
from jaxformer.config.preference import PREFERENCE_LOSSES, PreferenceConfig
from jaxformer.config.presets import (
    PRESETS,
    bart_base,
    bert_base,
    gpt2_small,
    llama,
    paper_base,
    paper_big,
    t5_small,
    t5_v1_1_small,
    tiny,
)
from jaxformer.config.rope import RopeScalingConfig, yarn_mscale
from jaxformer.config.run import SECTIONS, SPLASH_TILE, Config, ring_blocks_unfit
from jaxformer.config.sections import (
    SYNTHETIC,
    CheckpointConfig,
    DataConfig,
    DecodeConfig,
    MeshConfig,
    TrainConfig,
)
from jaxformer.config.serve import ServeConfig

__all__ = [
    "LORA_MODEL_TARGETS",
    "LORA_STACKS",
    "LORA_TARGETS",
    "MODES",
    "MODE_STACKS",
    "PREFERENCE_LOSSES",
    "PRESETS",
    "SECTIONS",
    "SPLASH_TILE",
    "SYNTHETIC",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DecodeConfig",
    "EngineConfig",
    "GRPOConfig",
    "LoRAConfig",
    "MLAConfig",
    "MeshConfig",
    "MoEConfig",
    "ModelConfig",
    "PreferenceConfig",
    "RopeScalingConfig",
    "ServeConfig",
    "TrainConfig",
    "apply_overrides",
    "apply_section_overrides",
    "bart_base",
    "bert_base",
    "call_file",
    "check_field_types",
    "check_grpo",
    "check_lora_fits",
    "did_you_mean",
    "field_hint",
    "from_dict",
    "gpt2_small",
    "llama",
    "load_experiment",
    "paper_base",
    "paper_big",
    "parse_overrides",
    "read_config",
    "require",
    "ring_blocks_unfit",
    "t5_small",
    "t5_v1_1_small",
    "tiny",
    "with_values",
    "yarn_mscale",
]
