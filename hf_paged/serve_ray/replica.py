"""`EngineReplica`: one `ContinuousBatchGenerator` behind the `create_app` server, as a Ray Serve deployment.

The ingress hands it raw HTTP requests (`HTTPRequest`); it runs each through its own app in-process, so every
replica answers exactly as ``hf-paged serve`` does, API key check, errors and metrics included.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from ray import serve

from ..generation import EngineConfig
from ..server.limits import ServerLimits
from ..server.options import ServingOptions
from ..server.asgi import HTTPRequest, HTTPResponseStart, call_app
from .runtime_adapters import RUNTIME_UPDATES, load_recorded, record_update

REPLICA_HEADER = b"x-hf-paged-replica"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # serve's


class _ReplicaLog(logging.StreamHandler):
    """The handler `ReplicaSpec.configure_logging` adds."""


@dataclass
class ReplicaSpec:
    """What every replica loads and serves; it is pickled to each replica."""

    model: str  # a local model directory, the same path on every node
    served_model_name: str | tuple[str, ...]  # or several names, as `create_app`'s
    dtype: str = "auto"
    api_key: str | tuple[str, ...] | None = None  # the key, or any of several
    engine: EngineConfig = field(default_factory=EngineConfig)
    options: ServingOptions = field(default_factory=ServingOptions)  # `create_app`'s: how answers look
    device: str = "auto"  # `loading.resolve_device`'s: the replica's GPU when it has one
    limits: ServerLimits = field(default_factory=ServerLimits)  # each replica's (the ingress checks the body's too)
    allowed_origins: tuple[str, ...] = ("*",)  # CORS, as `create_app`'s
    trust_remote_code: bool = False  # `loading.load_model`'s
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()  # `create_app`'s: (name, path, base model name)
    log_level: str = "info"  # of hf_paged's log records (requests' with --enable-log-requests), as serve's
    # Where the adapters loaded at run time are recorded (`runtime_adapters`): one key per deployment.
    runtime_adapters_key: str = field(default_factory=lambda: f"hf_paged/runtime_adapters/{uuid.uuid4().hex}")

    def configure_logging(self) -> None:
        """hf_paged's records of this process at ``log_level``, written to stderr (which Ray keeps in the replica's
        log and shows the driver), as ``serve`` writes them; once, however often called."""
        logger = logging.getLogger("hf_paged")
        logger.setLevel(self.log_level.upper())
        if not any(isinstance(handler, _ReplicaLog) for handler in logger.handlers):
            handler = _ReplicaLog()
            handler.setFormatter(logging.Formatter(LOG_FORMAT))
            logger.addHandler(handler)
            logger.propagate = False  # not twice, where Ray's handlers take the root's records

    def load(self):
        """The replica's generator (call on the replica)."""
        from ..generation import ContinuousBatchGenerator
        from ..loading import load_model, resolve_device

        model, tokenizer = load_model(self.model, dtype=self.dtype, device=resolve_device(self.device),
                                      trust_remote_code=self.trust_remote_code)
        return ContinuousBatchGenerator(model, tokenizer, self.engine)


@serve.deployment(name="Engine")
class EngineReplica:
    def __init__(self, spec: ReplicaSpec):
        from ..server import create_app

        spec.configure_logging()
        self.generator = spec.load()
        self.app = create_app(self.generator, spec.served_model_name, api_key=spec.api_key, limits=spec.limits,
                              allowed_origins=list(spec.allowed_origins), options=spec.options,
                              lora_modules=spec.lora_modules)
        self.runtime_adapters_key = spec.runtime_adapters_key
        load_recorded(spec.runtime_adapters_key, self.app.state.serving.models)
        self.app.state.engine.start()
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def __call__(self, request: HTTPRequest, prefix: list[bytes] | None = None, replica: str | None = None,
                       control: bool = False) -> AsyncIterator[HTTPResponseStart | bytes]:
        """The app's answer in pieces, its header naming this replica; ``prefix`` (the prompt's block hashes),
        ``replica`` (the one asked for) and ``control`` (a call that runs no model) are for the router."""
        async for piece in call_app(self.app, request):
            if isinstance(piece, HTTPResponseStart):
                piece.headers.append((REPLICA_HEADER, self.replica.encode()))
                if piece.status == 200 and request.method == "POST" and request.path in RUNTIME_UPDATES:
                    await asyncio.to_thread(record_update, self.runtime_adapters_key, request.path, request.body)
            yield piece

    def check_health(self) -> None:
        """Serve replaces a replica whose check raises: one whose engine stopped for good (plain ``serve`` exits 1
        then, for its supervisor to restart it)."""
        if not self.app.state.engine.healthy:
            raise RuntimeError("the engine stopped after an unrecoverable error")

    async def metrics(self, replica: str | None = None, control: bool = False) -> tuple[str, str]:
        """``(replica id, Prometheus text of this replica's server)``; ``replica`` picks the replica, ``control``
        lets it through however busy (router)."""
        return self.replica, generate_latest(self.app.state.metrics.registry).decode()

    def __del__(self):
        if hasattr(self, "app"):  # Serve's graceful shutdown; requests still in flight fail
            self.app.state.engine.stop(timeout=5.0)
