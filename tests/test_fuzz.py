"""Fuzzed inputs: every mutation of a valid GGUF file (tests/fuzz_gguf.py), archive metadata,
service config, config.json or tokenizer (tests/fuzz_inputs.py) ends in success or
SharkportError; never another exception, a hang, a crash or a wrong answer."""

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from fuzz_gguf import apply, describe, make_seeds, mutations, run_case

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HERE = Path(__file__).parent
with tempfile.TemporaryDirectory(prefix="fuzz-seeds-") as _folder:  # the seeds keep their bytes
    SEEDS = make_seeds(Path(_folder))
DATA = {s.name: s.data for s in SEEDS}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=mutations(SEEDS))
def test_mutated_gguf_is_read_or_rejected(workdir, case):
    name, ops = case
    data = apply(DATA[name], ops)
    # SharkportError is caught inside run_case; any other exception (or CaseTimeout) fails here,
    # and hypothesis shrinks the mutations to the smallest that still fail.
    outcome, _ = run_case(data, workdir)
    assert outcome in ("ok", "rejected-on-read", "rejected-on-import"), f"{name}: {describe(ops)}"


def _fuzz_in_a_child(tmp_path, script: str, *args: str):
    """The result of tests/`script` run as a separate process, so that a crash fails the test
    instead of ending pytest; the child names the case it was running."""
    result, progress = tmp_path / "result.json", tmp_path / "case.txt"
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args, "--json", str(result), "--progress-file", str(progress)],
        capture_output=True, text=True, timeout=3600)
    if proc.returncode < 0:
        pytest.fail(f"the fuzz process died of {signal.Signals(-proc.returncode).name} in case "
                    f"{progress.read_text() if progress.exists() else '?'}\n{proc.stderr[-3000:]}")
    assert result.exists(), proc.stderr[-3000:]
    return proc, json.loads(result.read_text())


@pytest.mark.slow
@pytest.mark.extended  # ~3 min; the quick suite runs 300 cases of the same harness
def test_ten_thousand_mutations_in_a_child_process(tmp_path):
    proc, summary = _fuzz_in_a_child(tmp_path, "fuzz_gguf.py", "--cases", "10000")
    assert summary["bugs"] == [], json.dumps(summary["bugs"], indent=2)
    assert proc.returncode == 0
    assert summary["cases"] >= 10000
    assert set(summary["outcomes"]) <= {"ok", "rejected-on-read", "rejected-on-import"}
    assert summary["outcomes"].get("ok", 0) > 0 and summary["outcomes"].get("rejected-on-read", 0) > 0


@pytest.mark.parametrize("cases", [
    pytest.param(250, id="quick"),
    pytest.param(10000, id="ten-thousand", marks=[pytest.mark.slow, pytest.mark.extended]),  # ~10 min
])
def test_archives_configs_and_tokenizers_are_read_or_rejected(tmp_path, cases):
    """tests/fuzz_inputs.py: mutated archive metadata, service configs, config.json files and
    tokenizers each end in success or SharkportError within the time and address-space limits,
    and an accepted case gives what its reference gives (the exported config's tokens,
    transformers' sizes, ids inside the vocabulary)."""
    proc, results = _fuzz_in_a_child(tmp_path, "fuzz_inputs.py", "--cases", str(cases))
    assert [r["target"] for r in results] == ["archive", "service-config", "config-json", "tokenizer"]
    for r in results:
        assert r["bugs"] == [], json.dumps(r["bugs"], indent=2)
        assert r["cases"] >= cases and set(r["outcomes"]) == {"ok", "rejected"}, (r["target"], r["outcomes"])
    assert proc.returncode == 0
