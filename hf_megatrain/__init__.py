"""hf_megatrain: train decoder LLMs larger than the GPU, at full precision, from the HF stack."""

from .core.host_store import InsufficientHostMemoryError
from .core.options import EngineOptions, StepShape
from .core.planner import MemoryPlanError
from .hf.arguments import MegaTrainArguments
from .hf.checkpoint import save_streamed_pretrained
from .hf.families import SUPPORTED_MODEL_TYPES
from .hf.heartbeat import StepHeartbeat
from .hf.loading import frozen_streamed_copy, init_streamed_model, load_streamed_model
from .hf.model import UnsupportedModelError, prepare_streamed_model, streamed_optimizer
from .hf.preemption import SaveOnSigterm
from .hf.trainer import HFMegaTrainer

__version__ = "0.1.0"

#: ``accelerate launch --num_processes N`` (one process per GPU; several nodes too) trains data parallel.
SUPPORTS_MULTI_PROCESS = True

__all__ = [
    "EngineOptions",
    "HFMegaTrainer",
    "InsufficientHostMemoryError",
    "MegaTrainArguments",
    "MemoryPlanError",
    "SUPPORTED_MODEL_TYPES",
    "SaveOnSigterm",
    "StepHeartbeat",
    "UnsupportedModelError",
    "StepShape",
    "frozen_streamed_copy",
    "init_streamed_model",
    "load_streamed_model",
    "prepare_streamed_model",
    "streamed_optimizer",
    "save_streamed_pretrained",
]
