"""`build_app`: the Ray Serve application (an `Ingress` in front of N `EngineReplica`s), and `serve_forever`, what
``hf-paged serve-ray`` runs."""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from .ingress import Ingress
from .replica import EngineReplica, ReplicaSpec
from .router import CONTROL_SLOTS, PrefixAffinityRouter

logger = logging.getLogger(__name__)
APP_NAME = "hf_paged"


@dataclass
class ServeRayConfig:
    """How many replicas, what each reserves, and how requests are routed.

    With ``min_replicas``/``max_replicas`` Serve scales the replicas between them, aiming at
    ``target_ongoing_requests`` requests in flight per replica (``num_replicas`` is then the initial count).
    """

    replica: ReplicaSpec
    num_replicas: int | None = None  # default: 1, or min_replicas
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: int = 32
    max_ongoing_requests: int = 256  # per replica; more wait in the router, which keeps balancing them
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    prefix_affinity: bool = True  # False: the less loaded of two random replicas, always
    max_imbalance: int = 8
    # A replica that is scaled down (or replaced) finishes its requests for up to this long (Serve's default, 20 s,
    # cut long streams off).
    graceful_shutdown_timeout_s: float = 300.0

    def __post_init__(self):
        if self.num_replicas is None:
            self.num_replicas = max(1, self.min_replicas or 0)
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("min_replicas and max_replicas go together (autoscaling between them)")
        if self.max_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.max_replicas is not None and not self.min_replicas <= self.num_replicas <= self.max_replicas:
            raise ValueError(f"num_replicas ({self.num_replicas}) must lie between min_replicas and max_replicas")
        for name in ("target_ongoing_requests", "max_ongoing_requests"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("replica_cpus", "replica_gpus", "graceful_shutdown_timeout_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def scaling(self) -> dict:
        """The engine deployment's replica count or autoscaling options, and how long a replica scaled down has."""
        drain = {"graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s}
        if self.max_replicas is None:
            return {"num_replicas": self.num_replicas, **drain}
        return {"num_replicas": "auto", **drain, "autoscaling_config": {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "initial_replicas": self.num_replicas, "target_ongoing_requests": self.target_ongoing_requests}}


def build_app(config: ServeRayConfig):
    """The bound application: ``serve.run(build_app(config), name=APP_NAME, route_prefix="/")``."""
    router = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,
        request_router_kwargs={"max_imbalance": config.max_imbalance,
                               "max_ongoing_requests": config.max_ongoing_requests},
    )
    engine = EngineReplica.options(
        **config.scaling(), max_ongoing_requests=config.max_ongoing_requests + CONTROL_SLOTS,
        request_router_config=router,
        ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus},
    ).bind(config.replica)
    return ingress(engine, config)


def ingress(engine, config: ServeRayConfig):
    """The bound ingress in front of ``engine`` (a bound deployment, or a handle to one in another app)."""
    capacity = (config.max_ongoing_requests + CONTROL_SLOTS) * (config.max_replicas or config.num_replicas) + 16
    return Ingress.options(max_ongoing_requests=capacity, ray_actor_options={"num_cpus": 0}).bind(
        engine, config.replica.model, config.replica.engine.block_size, config.prefix_affinity,
        api_key=config.replica.api_key, limits=config.replica.limits, cors=bool(config.replica.allowed_origins),
        trust_remote_code=config.replica.trust_remote_code,
        content_format=config.replica.options.chat_template_content_format,
        adapters=tuple(name for name, _, _ in config.replica.lora_modules),
        max_ongoing_requests=config.max_ongoing_requests)


def serve_forever(config: ServeRayConfig, address: str | None, host: str, port: int) -> None:
    """Deploy on the Ray cluster at ``address`` (None: a local one) and serve until interrupted."""
    ray.init(address=address, ignore_reinit_error=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # after ray.init, which sets its own: clean up below
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        logger.info("serving %r on http://%s:%d/v1 from %d replica(s)", config.replica.served_model_name, host,
                    port, config.num_replicas)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        if address is None:
            serve.shutdown()
            ray.shutdown()
