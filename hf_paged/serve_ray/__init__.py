"""hf_paged on Ray Serve: the OpenAI-compatible server from N engine replicas, on one machine or a Ray cluster,
with prefix-cache-aware routing and autoscaling (needs the ``ray`` extra).

``hf-paged serve-ray [MODEL] --num-replicas N`` runs it; in Python, ``serve.run(build_app(ServeRayConfig(...)))``.
"""

from .app import APP_NAME, ServeRayConfig, build_app, ingress, serve_forever
from .replica import ReplicaSpec
from .registry import router_of
from .router import PrefixAffinityRouter, RoutingStats

__all__ = ["APP_NAME", "PrefixAffinityRouter", "ReplicaSpec", "RoutingStats", "ServeRayConfig", "build_app",
           "ingress", "router_of", "serve_forever"]
