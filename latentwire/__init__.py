"""LatentWire: a byte encoder and adapters feeding soft tokens to two frozen LLMs (train.py trains it)."""

import logging

# transformers imports torchao wherever it is installed (its quantizers, when modeling_utils loads),
# and torchao's import logs a warning for each CUDA extension a CPU build cannot load (or that
# TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 skips) and for each enum it registers with torch's pytree
# (deprecated in torch 2.13). The float8 readers (latentwire.fp8) use neither, so these lines stay
# off every run's stderr; other warnings pass.
logging.getLogger("torchao").addFilter(
    lambda record: not record.getMessage().startswith(("Failed to load", "Skipping import of cpp extensions"))
)
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "is an Enum subclass" not in record.getMessage())
