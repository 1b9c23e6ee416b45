"""dump_inputs: the .npy files and iree-run-module command lines it prints, run through the
installed iree-run-module, reproduce the runner's logits for the prefill and the first decode step
(on SmolLM2, slow); bad flags are one-line errors."""

import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

from sharkport.api import TextGenerator
from sharkport.tools import dump_inputs

PROMPT = "The capital of France is"


@pytest.mark.slow
def test_commands_reproduce_the_runner(smollm2_compiled, tmp_path, capsys):
    assert shutil.which("iree-run-module"), "iree-run-module is installed with iree-base-runtime"
    vmfb, irpa, config = smollm2_compiled
    out_dir = tmp_path / "dump"
    assert dump_inputs.main(["--vmfb", str(vmfb), "--irpa-file", str(irpa), "--config", str(config),
                             "--prompt", PROMPT, "--output-npy-dir", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    commands = [shlex.split(line) for line in printed.splitlines() if line.startswith("iree-run-module ")]
    assert [c[4] for c in commands] == ["--function=prefill_bs1", "--function=decode_bs1"]
    for command in commands:
        subprocess.run(command, check=True, capture_output=True, timeout=600)

    # The runner: greedy generation of 2 tokens, keeping the logits of each step.
    runner = TextGenerator.from_files(vmfb, irpa, config)
    n = len(runner.encode(PROMPT))
    g = runner.generate(PROMPT, max_new_tokens=2, output_scores=True).generations[0]
    prefill, decode = np.load(out_dir / "prefill" / "logits.npy"), np.load(out_dir / "decode" / "logits.npy")
    assert prefill.shape == (1, 32, 49152) and decode.shape == (1, 1, 49152)
    np.testing.assert_allclose(prefill[0, n - 1], g.logits[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(decode[0, 0], g.logits[1], rtol=0, atol=1e-5)
    assert int(np.load(out_dir / "decode" / "tokens.npy")[0, 0]) == g.token_ids[0]
    np.testing.assert_allclose(prefill, np.load(out_dir / "prefill" / "expected_logits.npy"), rtol=0, atol=1e-5)
    # The decode input cache is the cache after prefill: not the zeros prefill started from.
    assert np.abs(np.load(out_dir / "decode" / "cache_state.npy")).max() > 0
    assert not np.load(out_dir / "prefill" / "cache_state.npy").any()


def run(*args):
    return subprocess.run([sys.executable, "-m", "sharkport.tools.dump_inputs", *args],
                          capture_output=True, text=True, timeout=300)


def test_missing_module_is_a_one_line_error(tmp_path):
    config = tmp_path / "x.json"
    config.write_text("{}")
    proc = run("--irpa-file", str(tmp_path / "x.irpa"), "--config", str(config), "--prompt", "hi",
               "--output-npy-dir", str(tmp_path / "d"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'x.vmfb'}: no such file; pass the "
                                                "compiled module with --vmfb"]
    assert not (tmp_path / "d").exists()
