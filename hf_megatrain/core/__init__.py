"""Systems core: host store, streaming engine, host optimizer. No ``transformers`` imports."""

from .host_store import HostStore, InsufficientHostMemoryError, LayerStore
from .optimizer import HostAdamW
from .streamed_layer import StreamedLayer
from .streaming import StreamingEngine

__all__ = [
    "HostAdamW",
    "HostStore",
    "InsufficientHostMemoryError",
    "LayerStore",
    "StreamedLayer",
    "StreamingEngine",
]
