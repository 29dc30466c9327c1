"""`ServedModels`: the names a request's ``model`` may take, as vLLM's: the served model's, and each LoRA adapter's
(``--lora-modules``, or ``/v1/load_lora_adapter`` where ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` allows it)."""

from __future__ import annotations

import json
import os
import threading
import time

from pydantic import BaseModel, ConfigDict

from ..generation import ContinuousBatchGenerator, InvalidParameter
from ..lora import LoRARequest
from .protocol import APIError

RUNTIME_LORA_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """vLLM's ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING``: whether adapters may be loaded and unloaded over HTTP."""
    return os.environ.get(RUNTIME_LORA_VARIABLE, "").strip().lower() in ("1", "true")


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """vLLM's ``--lora-modules`` entry: ``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``, as
    ``(name, path, base model name)``; ``ValueError`` otherwise."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as err:
            raise ValueError(f"{text!r} is not JSON: {err}") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("name"), str) or \
                not isinstance(fields.get("path"), str) or set(fields) - {"name", "path", "base_model_name"}:
            raise ValueError(f"{text!r}: the JSON form is {{\"name\": ..., \"path\": ..., \"base_model_name\": ...}}")
        return fields["name"], fields["path"], fields.get("base_model_name")
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"{text!r} is neither name=path nor a JSON object")
    return name, path, None


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace the adapter of that name (its running requests finish under it)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name decides


class ServedModels:
    """The served model's names (vLLM's ``--served-model-name``: one or several, the first its main one) and the LoRA
    adapters served under their own names (each a `LoRARequest` the generator has loaded)."""

    def __init__(self, base_names: str | list[str], generator: ContinuousBatchGenerator):
        self.base_names = [base_names] if isinstance(base_names, str) else list(base_names)
        self.base_name = self.base_names[0]
        self.generator = generator
        self.created = int(time.time())
        self._loras: dict[str, LoRARequest] = {}  # replaced, never changed, so readers need no lock
        self._lock = threading.Lock()  # one change at a time; never held while an adapter is read
        self._last_id = 0  # ids are never reused: an unloaded adapter's requests may still run

    def add(self, name: str, path: str, base_model_name: str | None = None, replace: bool = False) -> LoRARequest:
        """Load the adapter at ``path`` under ``name`` (``replace``: in place of the adapter of that name), listed
        with ``base_model_name`` (default: the served model's) as its parent: `InvalidParameter` (``lora_name`` or
        ``lora_path``) for an empty or taken name or an adapter that does not fit; nothing changes then."""
        with self._lock:
            if not name or name in self.base_names or (name in self._loras and not replace):
                raise InvalidParameter("lora_name", f"the model name {name!r} is taken already" if name else
                                       "a LoRA adapter's name must not be empty")
            self._last_id += 1
            lora = LoRARequest(name, self._last_id, path, base_model_name or self.base_name)
        try:
            self.generator.add_lora(lora)
        except ValueError as err:
            raise InvalidParameter("lora_path", str(err)) from err
        with self._lock:
            if name in self._loras and not replace:  # loaded meanwhile by another call: this load is dropped
                self.generator.remove_lora(lora.lora_int_id)
                raise InvalidParameter("lora_name", f"the model name {name!r} is taken already")
            replaced = self._loras.get(name)
            self._loras = {**self._loras, name: lora}
        if replaced is not None:
            self.generator.remove_lora(replaced.lora_int_id)
        return lora

    def remove(self, name: str) -> None:
        with self._lock:
            lora = self._loras.get(name)
            if lora is None:
                raise APIError(404, f"no LoRA adapter is named {name!r}", param="lora_name", code="model_not_found")
            self._loras = {key: value for key, value in self._loras.items() if key != name}
        self.generator.remove_lora(lora.lora_int_id)

    def lora(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None or empty: the base model, as vLLM's); a 404 for a name not
        served."""
        if not model or model in self.base_names:
            return None
        lora = self._loras.get(model)
        if lora is None:
            served = ", ".join(repr(name) for name in [*self.base_names, *self._loras])
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", param="model",
                           code="model_not_found")
        return lora

    def name(self, model: str | None) -> str:
        """The name an answer gives its model: the adapter's, or the served model's (the one asked for, as vLLM's)."""
        lora = self.lora(model)
        if lora is not None:
            return lora.lora_name
        return model if model in self.base_names else self.base_name

    def cards(self, max_model_len: int) -> list[dict]:
        """``/v1/models``' entries, as vLLM's: the served model under each of its names (``root``: its path), then
        each adapter (``root``: its path, ``parent``: its base model)."""
        root = getattr(self.generator.model, "name_or_path", None) or self.base_name
        base = {"id": self.base_name, "object": "model", "created": self.created, "owned_by": "hf_paged",
                "root": root, "parent": None, "max_model_len": max_model_len}
        return [{**base, "id": name} for name in self.base_names] + [
            {**base, "id": lora.lora_name, "root": lora.lora_path, "parent": lora.base_model_name}
            for lora in self._loras.values()]
