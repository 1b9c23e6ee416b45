"""The environment the suite runs in is the tested set pinned in constraints.txt (tools/pins.py)."""

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "pins.py"


def _pins_module():
    spec = importlib.util.spec_from_file_location("pins", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_installed_packages_are_the_pinned_ones():
    pins = _pins_module()
    problems = pins.differences(pins.read_pins(), pins.installed_set())
    assert not problems, ("the environment is not the tested set; install with "
                          "`pip install -c constraints.txt -e '.[test]'`:\n" + "\n".join(problems))


def test_constraints_pin_pyproject_exact_pins_alike():
    """torch and the IREE set are pinned in pyproject.toml too: both files must say the same."""
    pins = _pins_module()
    pinned = pins.read_pins()
    for name in ("torch", "iree-base-compiler", "iree-base-runtime", "iree-turbine", "shortfin"):
        assert pinned[name] == pins._pyproject_pin(name), name
