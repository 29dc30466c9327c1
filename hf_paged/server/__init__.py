"""An OpenAI-compatible HTTP server over `ContinuousBatchGenerator` (needs the ``server`` extra).

``create_app(generator, served_model_name, api_key=None, limits=None, options=None, lora_modules=())`` returns a
FastAPI app; run it with uvicorn, or use ``hf-paged serve``.
"""

from .app import create_app
from ..engine_loop import EngineDead, EngineError, EngineLoop, EngineOverloaded, RequestStream
from .limits import ServerLimits
from .options import ServingOptions
from .metrics import ServerMetrics
from .protocol import APIError

__all__ = ["APIError", "EngineDead", "EngineError", "EngineLoop", "EngineOverloaded", "RequestStream",
           "ServerLimits", "ServerMetrics", "ServingOptions", "create_app"]
