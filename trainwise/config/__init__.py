"""The run's description: model, training, data, tokenizer and parallel settings.

One set of dataclasses, read by the planner and the trainer alike. A run is saved as TOML with one
section per dataclass (`[model]`, `[train]`, ...) and can be changed from the command line with
`--set section.key=value`. Unknown keys and bad values raise `TrainwiseError` naming the key and the
closest valid one.
"""

from trainwise.config.model import (
                                  ACTIVATIONS,
                                  ATTENTIONS,
                                  GATINGS,
                                  NORMS,
                                  POSITIONS,
                                  ROPE_SCALINGS,
                                  ModelConfig,
                                  default_ffn_hidden,
)
from trainwise.config.run import (
                                  CHECKPOINTING,
                                  COMPILE,
                                  FSDP_STRATEGIES,
                                  OPTIMIZERS,
                                  PRECISIONS,
                                  RESUME_POLICIES,
                                  SECTIONS,
                                  STRATEGIES,
                                  STRATEGY_OF_STAGE,
                                  ZERO_STAGE,
                                  DataConfig,
                                  LogConfig,
                                  ParallelConfig,
                                  RunConfig,
                                  SourceConfig,
                                  TokenizerConfig,
                                  TrainConfig,
                                  check_op_checkpointing,
)
from trainwise.config.toml import (
                                  apply_overrides,
                                  config_from_dict,
                                  config_to_dict,
                                  load_config,
                                  save_config,
                                  section_from_dict,
                                  to_toml,
)

__all__ = ["ACTIVATIONS", "ATTENTIONS", "CHECKPOINTING", "COMPILE", "FSDP_STRATEGIES", "GATINGS", "NORMS", "OPTIMIZERS",
           "POSITIONS", "PRECISIONS", "RESUME_POLICIES", "ROPE_SCALINGS", "SECTIONS", "STRATEGIES", "STRATEGY_OF_STAGE",
           "ZERO_STAGE", "DataConfig", "LogConfig", "ModelConfig", "ParallelConfig", "RunConfig", "SourceConfig",
           "TokenizerConfig", "TrainConfig", "apply_overrides",
           "check_op_checkpointing", "config_from_dict", "config_to_dict",
           "default_ffn_hidden", "load_config", "save_config", "section_from_dict", "to_toml"]
