"""backend/core/fault_injection.py: the test-only `fault_injection` setting parses kind:marker items and fires only
for prompts that carry a marker."""

import pytest

from backend.core.config import ConfigError
from backend.core.fault_injection import FaultInjector, InjectedFault


def test_off_by_default():
    faults = FaultInjector("")
    assert not any(faults.markers.values())
    prompts = ["<<FAIL THIS STEP>>", "<<KILL THE ENGINE>>", "step_error", "engine_death"]
    assert faults.before_forward(prompts) is None and faults.before_step(prompts) is None  # nothing fires


def test_each_kind_fires_at_its_own_point_only():
    faults = FaultInjector("step_error:BOOM, engine_death:DIE")
    faults.before_forward(["DIE here", "plain"])  # engine_death does not fire inside the step
    faults.before_step(["BOOM here"])  # nor step_error outside it
    with pytest.raises(InjectedFault, match="injected step_error .*'BOOM'"):
        faults.before_forward(["plain", "a BOOM b"])
    with pytest.raises(InjectedFault, match="injected engine_death"):
        faults.before_step(["xDIEx"])


@pytest.mark.parametrize("spec", ["explode:X", "step_error", "step_error:", "step_error:A,,oops"])
def test_bad_settings_name_the_parameter(spec):
    with pytest.raises(ConfigError, match="parameter 'fault_injection' .*kind:marker"):
        FaultInjector(spec)
