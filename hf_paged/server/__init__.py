"""An OpenAI-compatible HTTP server over `ContinuousBatchGenerator` (needs the ``server`` extra).

``create_app(generator, served_model_name, api_key=None)`` returns a FastAPI app; run it with uvicorn, or use
``hf-paged serve``.
"""

from .app import APIError, create_app
from .engine import EngineError, EngineLoop, RequestStream
from .metrics import ServerMetrics

__all__ = ["APIError", "EngineError", "EngineLoop", "RequestStream", "ServerMetrics", "create_app"]
