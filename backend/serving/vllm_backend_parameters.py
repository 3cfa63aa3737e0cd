"""vllm_backend's own config.pbtxt parameters, taken under their names so that its model configs load here:

- `ENABLE_VLLM_HEALTH_CHECK`: whether the model unloads itself once its engine has stopped, so that its ready
  endpoint says not ready (vllm_backend checks its engine's health before each batch of requests and then unloads
  the model; this engine's loop reports its own death at once). Default true here (vllm_backend's is false): a
  stopped engine never recovers, and a model that stays READY while refusing every request keeps a load balancer
  sending to it. `false` keeps the model loaded, refusing every request as `unavailable`.
- `REPORT_CUSTOM_METRICS`: whether the `vllm:` metric names are exported (`metric_names` "vllm"); true adds them
  where `metric_names` leaves them out, false takes them out. Our own `llm_` metrics are always exported.

Pure: the model glue (model_repository/llm/1/model.py) calls `split` before EngineConfig.from_parameters, which
refuses every other unknown parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

HEALTH_CHECK = "ENABLE_VLLM_HEALTH_CHECK"
CUSTOM_METRICS = "REPORT_CUSTOM_METRICS"
NAMES = (HEALTH_CHECK, CUSTOM_METRICS)
_DEFAULT_METRIC_NAMES = "vllm,tensorrt_llm"  # EngineConfig.metric_names' default


class ParameterError(ValueError):
    """A bad value of one of these parameters; the message names it and what is allowed."""


@dataclass(frozen=True)
class VllmBackendSettings:
    unload_on_engine_death: bool = True


def _flag(name: str, raw: str) -> bool:
    value = str(raw).strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ParameterError(f"parameter {name!r} must be true or false, got {raw!r}")


def split(parameters: dict[str, str]) -> tuple[dict[str, str], VllmBackendSettings]:
    """The engine's parameters (vllm_backend's taken out, REPORT_CUSTOM_METRICS folded into `metric_names`) and
    what the model glue does with the rest."""
    engine = {k: v for k, v in parameters.items() if k not in NAMES}
    unload = _flag(HEALTH_CHECK, parameters[HEALTH_CHECK]) if HEALTH_CHECK in parameters else True
    if CUSTOM_METRICS in parameters:
        report = _flag(CUSTOM_METRICS, parameters[CUSTOM_METRICS])
        names = [n.strip() for n in engine.get("metric_names", _DEFAULT_METRIC_NAMES).split(",") if n.strip()]
        names = [n for n in names if n not in ("none", "vllm")]
        names = (["vllm"] if report else []) + names
        engine["metric_names"] = ",".join(names) or "none"
    return engine, VllmBackendSettings(unload_on_engine_death=unload)
