"""Run configuration (docs/configuration.md), one job per module:

- schema.py: the sections, one dataclass each (a docstring per field), and each section's `check()`
  of its own ranges; a field that takes one of a set of words is a `Literal[...]`;
- fields.py: what a field's annotation allows: the type check, `--set` conversion, the Literal rule;
- load.py: Python recipes (`--config PATH[:FUNCTION]`), `--set a.b=value` overrides, the command line;
- validate.py: start-up validation, keeping the rules that span sections;
- resolve.py: the auto values (engine start limit, eager mode) resolved once the machine is known;
- engine_args.py: which `rollout.engine_args` names vLLM accepts.

`python -m molt.config --config configs/demo.py [--set ...]` prints the resolved config. Recipes and
the rest of Molt import from here: `from molt.config import MoltConfig`.
"""

from molt.config.fields import field_type_errors
from molt.config.load import apply_override, build_arg_parser, load_config, main
from molt.config.resolve import (checkpoint_bytes, count_engines_per_node, engine_start_limit_seconds,
                                 engine_start_seconds, resolve_enforce_eager)
from molt.config.schema import (DEFAULT_GPU_ENGINE_MEMORY_FRACTION, DEFAULT_KV_CACHE_GIGABYTES, GROUP_ESTIMATORS,
                                AgentConfig, AlgorithmConfig, CheckpointConfig, ConfigError, ConfigSection,
                                DataConfig, EvalConfig, LayoutConfig, MetricsConfig, ModelConfig, MoltConfig,
                                PayloadConfig, RefitConfig, RolloutConfig, SFTConfig, TrainConfig, failing,
                                parse_activation_checkpointing, raise_config_errors)
from molt.config.validate import check_cpu_offload, check_device_options, config_warnings, validate_config
