"""Test-only fault injection: the `fault_injection` engine parameter makes the engine fail on purpose, so
that tests can check how the server survives a failing step or a dead engine thread through the real
server. Never set it in production.

The setting is a comma-separated list of `kind:marker`; a fault fires for every request whose prompt
contains `marker`:

    step_error:MARKER    the engine step that schedules such a request raises before its forward pass
                         (as a failing kernel would): that step's requests get an error, the others go on
    engine_death:MARKER  the engine thread dies at the start of the next step after such a request is
                         admitted (as a bug outside the guarded forward pass would)
"""

from __future__ import annotations

from collections.abc import Iterable

from backend.core.config import ConfigError

KINDS = ("step_error", "engine_death")


class InjectedFault(RuntimeError):
    """Raised on purpose by a test-only fault."""


class FaultInjector:
    def __init__(self, spec: str = ""):
        self.markers: dict[str, list[str]] = {kind: [] for kind in KINDS}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, marker = item.partition(":")
            if kind not in KINDS or not marker:
                raise ConfigError(
                    f"parameter 'fault_injection' (test only) takes comma-separated kind:marker items with kind "
                    f"in {list(KINDS)}, got {item!r}"
                )
            self.markers[kind].append(marker)

    def _fire(self, kind: str, prompts: Iterable[str]) -> None:
        for prompt in prompts:
            for marker in self.markers[kind]:
                if marker in prompt:
                    raise InjectedFault(f"injected {kind} (fault_injection marker {marker!r})")

    def before_forward(self, prompts: Iterable[str]) -> None:
        """Inside a step, with the step's prompts: `step_error` fires here."""
        if self.markers["step_error"]:
            self._fire("step_error", prompts)

    def before_step(self, prompts: Iterable[str]) -> None:
        """Outside the step's guard, with every admitted prompt: `engine_death` fires here."""
        if self.markers["engine_death"]:
            self._fire("engine_death", prompts)
