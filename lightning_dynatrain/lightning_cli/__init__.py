"""The demo's command line and config schema: ``DynaTrainCLI`` (LightningCLI), ``GPTFamilyModule``,
``check_config`` and the old flags' mapping. ``examples/train_gpt.py`` is ``main()``.

Importing this package imports Lightning but not megatron-core: ``main`` first names the third-party
warnings megatron-core prints at import (``warning_filters``), then imports the model.
"""

from lightning_dynatrain.lightning_cli.checks import ConfigError, check_config
from lightning_dynatrain.lightning_cli.cli import DynaTrainCLI, main
from lightning_dynatrain.lightning_cli.legacy import FLAGS, FlagError, from_flags

__all__ = ["FLAGS", "ConfigError", "DynaTrainCLI", "FlagError", "check_config", "from_flags", "main"]
