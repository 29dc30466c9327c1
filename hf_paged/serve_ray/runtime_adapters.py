"""LoRA adapters loaded while serving (vLLM's ``/v1/load_lora_adapter``), kept in the Ray cluster's key-value store
under a key of the deployment (`ReplicaSpec.runtime_adapters_key`), so that a replica Serve starts later (one
replacing another, or autoscaling) loads them too and every replica serves the same names."""

from __future__ import annotations

import json
import logging

from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

logger = logging.getLogger(__name__)
RUNTIME_UPDATES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # vLLM's


def recorded(key: str) -> dict[str, str]:
    """The adapters loaded at run time: ``{name: path}``."""
    stored = _internal_kv_get(key.encode())
    return {} if stored is None else json.loads(stored)


def record_update(key: str, path: str, body: bytes) -> None:
    """Note an update this replica made (the JSON ``body`` of a load or unload at ``path``, `RUNTIME_UPDATES`);
    each replica notes it alike, and an update the ingress undoes on the others is undone here too."""
    update, adapters = json.loads(body), recorded(key)
    if path == "/v1/load_lora_adapter":
        adapters[update["lora_name"]] = update["lora_path"]
    else:
        adapters.pop(update["lora_name"], None)
    _internal_kv_put(key.encode(), json.dumps(adapters).encode(), overwrite=True)


def load_recorded(key: str, models) -> None:
    """Load on a new replica (its `ServedModels`) what the others loaded at run time; one that fails is logged."""
    for name, path in recorded(key).items():
        try:
            models.add(name, path, replace=True)
        except ValueError as err:
            logger.error("LoRA adapter %r, loaded at run time on the other replicas, could not load here: %s", name,
                         err)
