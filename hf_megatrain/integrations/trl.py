"""TRL: ``MegaSFTTrainer`` is TRL's ``SFTTrainer`` on a streamed model (``pip install trl``).

``MegaSFTTrainer(MegaTrainerMixin, SFTTrainer)``: SFTTrainer tokenizes the dataset, picks its
collator, wraps the model with LoRA from ``peft_config`` and computes the loss with its fused
LM head; the mixin streams the final model's decoder layers from host RAM and runs the host
AdamW, as in :class:`hf_megatrain.HFMegaTrainer`. ``MegaSFTConfig`` is ``SFTConfig`` plus the
``megatrain_*`` knobs of :class:`hf_megatrain.MegaTrainArguments`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import TrainingArguments

from ..hf.arguments import MegaTrainArguments
from ..hf.trainer import MegaTrainerMixin

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as e:  # an optional dependency: say how to get it
    raise ImportError(
        f"hf_megatrain.integrations.trl needs TRL: `pip install trl` (importing it failed: {e})"
    ) from e


@dataclass
class MegaSFTConfig(SFTConfig, MegaTrainArguments):
    """``SFTConfig`` with the ``megatrain_*`` fields of :class:`MegaTrainArguments`.

    SFTConfig comes first so its defaults of the shared ``TrainingArguments`` fields win (as with
    a plain ``SFTConfig``); every field keeps its ``help`` metadata for ``HfArgumentParser``.
    """


class MegaSFTTrainer(MegaTrainerMixin, SFTTrainer):
    """TRL ``SFTTrainer`` whose model's decoder layers stream from host RAM.

    Takes SFTTrainer's arguments. ``args`` may be a :class:`MegaSFTConfig`, an ``SFTConfig`` (the
    engine knobs keep their defaults) or any ``TrainingArguments`` (converted to
    ``MegaSFTConfig``, keeping its ``megatrain_*`` values). The model is streamed once SFTTrainer
    has built the final one, i.e. after it added the adapters from ``peft_config``: the frozen
    base then streams from frozen host stores and the adapters stay resident and trainable.
    """

    # SFTTrainer may still replace the model (PEFT wrapping, a model name to load, new chat-
    # template tokens resizing the embeddings): stream the one it hands to Trainer.__init__.
    _megatrain_prepare_late = True

    def __init__(self, model: Any, args: TrainingArguments | None = None, *a, **kw) -> None:
        if isinstance(args, TrainingArguments) and not isinstance(args, SFTConfig):
            # SFTTrainer would rebuild a plain SFTConfig from it and drop the megatrain_* knobs.
            values = args.to_dict()
            values["hub_token"] = args.hub_token  # to_dict hides it
            args = MegaSFTConfig(**values)
        super().__init__(model, args, *a, **kw)

    def _megatrain_default_args(self, model: Any) -> TrainingArguments:
        # SFTTrainer's own default (output dir "<model name>-SFT"), with the engine knobs.
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "")
        return MegaSFTConfig(f"{(name or 'model').split('/')[-1]}-SFT")


__all__ = ["MegaSFTConfig", "MegaSFTTrainer"]
