"""The LoRA adapters an engine serves: loaded by name (the `lora_modules` file at start, or at run time), looked
up by the requests that name them, counted while requests use them, refused past the configured limits.

Callers' threads look adapters up and load or unload them while the engine thread runs steps, so every change
happens under one lock; an adapter in use by a request in flight cannot be unloaded (its rows would lose their
weights mid-generation)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from backend.core.config import ConfigError, EngineConfig
from backend.model.lora import AdapterError, LoraAdapter, load_adapter
from backend.protocol.values import InvalidRequest

log = logging.getLogger(__name__)


class Adapters:
    def __init__(self, config: EngineConfig, hf_model, fused: bool):
        self.enabled = config.enable_lora
        self.max_rank = config.max_lora_rank
        self.max_loaded = config.max_cpu_loras
        self._model = hf_model
        self._fused = fused
        self._lock = threading.Lock()
        self._loaded: dict[str, LoraAdapter] = {}
        self._users: dict[int, int] = {}  # adapter uid -> requests in flight
        # TensorRT-LLM's lora_task_id: adapters numbered from 1 in the order they were loaded (the listing's order
        # first, as vllm_backend numbers them), a number never given to another adapter
        self._task_ids: dict[str, int] = {}
        self._next_task_id = 1
        if config.lora_modules:
            self._load_listed(Path(config.lora_modules))

    def _load_listed(self, path: Path) -> None:
        try:
            listed = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"parameter 'lora_modules': cannot read {path} ({exc})") from None
        if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
            raise ConfigError(f"parameter 'lora_modules': {path} must hold a JSON object of adapter names to folders")
        for name, folder in listed.items():
            try:
                self.load(name, str(path.parent / Path(folder).expanduser()))
            except AdapterError as exc:
                raise ConfigError(f"parameter 'lora_modules': {exc}") from None

    def names(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def describe(self) -> list[dict]:
        """Each loaded adapter: name, folder, rank."""
        with self._lock:
            return [
                {"name": a.name, "path": a.path, "rank": a.rank, "task_id": self._task_ids[a.name]}
                for a in self._loaded.values()
            ]

    def name_of_task(self, task_id: int) -> str:
        """The adapter TensorRT-LLM's `lora_task_id` names; InvalidRequest where none has it."""
        if not self.enabled:
            raise InvalidRequest(f"lora_task_id {task_id}: LoRA feature is not enabled.")
        with self._lock:
            for name, number in self._task_ids.items():
                if number == task_id:
                    return name
            loaded = ", ".join(f"{number} ({name})" for name, number in self._task_ids.items())
        raise InvalidRequest(f"lora_task_id {task_id} names no loaded adapter; loaded: {loaded or 'none'}")

    def load(self, name: str, folder: str) -> LoraAdapter:
        """Load the PEFT adapter in `folder` as `name`; AdapterError says why not."""
        if not self.enabled:
            raise AdapterError("LoRA adapters are not enabled (enable_lora: false)")
        if not self._fused:
            raise AdapterError(
                "LoRA adapters need the fused forward: a Llama-family model (llama, mistral, qwen2, qwen3)"
            )
        if not name or not isinstance(name, str):
            raise AdapterError("an adapter needs a non-empty name")
        with self._lock:
            if name in self._loaded:
                raise AdapterError(f"the adapter {name!r} has already been loaded")
            if len(self._loaded) >= self.max_loaded:
                raise AdapterError(
                    f"{len(self._loaded)} adapters are loaded, the most max_cpu_loras allows: unload one first"
                )
        adapter = load_adapter(name, folder, self._model, self.max_rank)  # outside the lock: reads files
        with self._lock:
            if name in self._loaded:
                raise AdapterError(f"the adapter {name!r} has already been loaded")
            self._loaded[name] = adapter
            self._task_ids[name] = self._next_task_id
            self._next_task_id += 1
        log.info(
            "LoRA adapter %s loaded from %s (rank %d, %d projections)",
            name,
            folder,
            adapter.rank,
            len(adapter.projections),
        )
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            adapter = self._loaded.get(name)
            if adapter is None:
                raise AdapterError(f"the adapter {name!r} cannot be found; loaded: {sorted(self._loaded)}")
            if self._users.get(adapter.uid):
                raise AdapterError(
                    f"the adapter {name!r} is in use by {self._users[adapter.uid]} request(s) in flight; unload it "
                    "once they finish"
                )
            del self._loaded[name]
            del self._task_ids[name]
        log.info("LoRA adapter %s unloaded", name)

    def check(self, name: str) -> None:
        """InvalidRequest (vllm_backend's wording) where LoRA is off or no adapter `name` is loaded."""
        with self._lock:
            self._find(name)

    def acquire(self, name: str) -> LoraAdapter:
        """The adapter a request names, counted as in use until `release` (`check`'s errors)."""
        with self._lock:
            adapter = self._find(name)
            self._users[adapter.uid] = self._users.get(adapter.uid, 0) + 1
            return adapter

    def _find(self, name: str) -> LoraAdapter:
        if not self.enabled:
            raise InvalidRequest("LoRA feature is not enabled.")
        adapter = self._loaded.get(name)
        if adapter is None:
            raise InvalidRequest(f"LoRA {name} is not supported, we currently support {list(self._loaded)}")
        return adapter

    def in_use(self, adapter: LoraAdapter) -> int:
        with self._lock:
            return self._users.get(adapter.uid, 0)

    def release(self, adapter: LoraAdapter) -> None:
        with self._lock:
            left = self._users.get(adapter.uid, 0) - 1
            if left > 0:
                self._users[adapter.uid] = left
            else:
                self._users.pop(adapter.uid, None)
