"""shortfin's LLM server (`python -m shortfin_apps.llm.server`, SHARK's serving engine) serving
sharkport's SmolLM2 artifacts unchanged: the .vmfb, the .irpa, the service config JSON and the
tokenizer files of `--output-tokenizer-dir`. Several concurrent /generate requests must give
the greedy text of sharkport's own runner on the same prompts (docs/serving.md).

What shortfin 3.9.0 cannot do here, and how the tests deal with it:

* Its request queue holds `max(decode_batch_sizes)` requests; more are answered HTTP 503
  `{"code": "QUEUE_FULL"}`. The session's SmolLM2 export has batch size 1 only, so the default
  test sends its requests concurrently and resends a QUEUE_FULL answer after a short wait
  (bounded): shortfin then serves them one after another.
* Batched serving (several requests in one prefill/decode call) needs batch sizes > 1, i.e. a
  second SmolLM2 export (minutes): `test_batched_concurrent_requests` (marker `extended`).
* On the CPU (`local-task`) device, two prefill calls started in the same scheduler tick can
  deadlock shortfin (a device buffer allocation waits synchronously, holding the GIL, for work
  that only the blocked thread can submit). With prefill batch sizes >= the number of
  simultaneous requests they share one call instead; the extended test exports them so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a café in Zürich,"]
MAX_NEW_TOKENS = 16
SERVER_START_S = 180  # loading the module and parameters takes ~5 s on an idle machine
REQUEST_S = 240  # one request of 16 tokens takes ~5 s alone
QUEUE_RETRY_S = 0.5


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(server: Server, deadline_s: float) -> None:
    """Polls GET /health until it answers 200; fails with the server log if the process exits
    or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if server.proc.poll() is not None:
            pytest.fail(f"shortfin's server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"shortfin's server did not answer /health within {deadline_s} s:\n{server.log_tail()}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it has not exited 20 s later (uvicorn
    waits for requests in flight, and a deadlocked shortfin never finishes them)."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 20)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def start_server(vmfb: Path, irpa: Path, config: Path, tokenizer_dir: Path, log: Path):
    """shortfin's LLM server on a free 127.0.0.1 port, in its own process group; a generator
    for a fixture: yields the ready Server and always stops it."""
    port = _free_port()
    cmd = [sys.executable, "-m", "shortfin_apps.llm.server",
           f"--tokenizer_json={tokenizer_dir / 'tokenizer.json'}",  # tokenizer_config.json beside it
           f"--model_config={config}", f"--vmfb={vmfb}", f"--parameters={irpa}",
           "--device=local-task", "--host=127.0.0.1", f"--port={port}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        _wait_ready(server, SERVER_START_S)
        yield server
    finally:
        _stop(proc)
        assert proc.poll() is not None, "shortfin's server did not stop"


def post_generate(server: Server, prompt: str, deadline: float, stream: bool = False) -> tuple[str, int]:
    """POST /generate with greedy decoding (shortfin: argmax unless top_k/top_p/beams are
    given) and MAX_NEW_TOKENS; resends after QUEUE_FULL until `deadline` (time.monotonic).
    Returns (text, number of QUEUE_FULL answers). With `stream`, the request asks for a
    stream, and the answer is read as server-sent events (`data: ...` parts) or, as shortfin
    3.9.0 answers, one JSON response."""
    body = json.dumps({"text": prompt, "sampling_params": {"max_completion_tokens": MAX_NEW_TOKENS},
                       "stream": stream}).encode()
    rejected = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer to {prompt!r} in time ({rejected} QUEUE_FULL answers)")
        req = urllib.request.Request(server.url + "/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=left) as r:
                raw = r.read().decode()
        except urllib.error.HTTPError as e:
            raw = e.read().decode() or "{}"
        if raw.startswith("data:"):  # server-sent events: the text in parts
            parts = [line[len("data:"):].removeprefix(" ") for line in raw.split("\n") if line.startswith("data:")]
            return "".join(parts), rejected
        answer = json.loads(raw)
        if answer.get("code") == "QUEUE_FULL":
            rejected += 1
            time.sleep(QUEUE_RETRY_S)
            continue
        assert "responses" in answer, answer
        (response,) = answer["responses"]
        assert response["prompt"] == prompt
        return response["responses"][0]["text"], rejected


def generate_concurrently(server: Server, prompts: list[str]) -> tuple[list[str], int]:
    """All prompts at once, one thread each; (texts in prompt order, QUEUE_FULL answers)."""
    deadline = time.monotonic() + REQUEST_S
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(post_generate, server, p, deadline) for p in prompts]
        try:
            results = [f.result(timeout=REQUEST_S + 10) for f in futures]
        except TimeoutError as e:
            pytest.fail(f"shortfin did not answer in {REQUEST_S} s ({e}); server log:\n{server.log_tail()}")
    return [t for t, _ in results], sum(r for _, r in results)


def runner_texts(vmfb: Path, irpa: Path, config: Path, prompts: list[str]) -> list[str]:
    """sharkport's own runner, greedy, on the same artifacts."""
    from sharkport import TextGenerator

    gen = TextGenerator.from_files(vmfb, irpa, config)
    return [gen.generate(p, max_new_tokens=MAX_NEW_TOKENS).text for p in prompts]


def _tokenizer_dir(irpa: Path, folder: Path) -> Path:
    from sharkport.archive import Dataset
    from sharkport.tokenizer import write_hf_tokenizer

    write_hf_tokenizer(Dataset.load(irpa).tokenizer(), folder)  # what --output-tokenizer-dir writes
    return folder


@pytest.fixture(scope="module")
def shortfin_smollm2(smollm2_compiled, tmp_path_factory):
    """shortfin's server over the session's SmolLM2 artifacts (batch size 1)."""
    pytest.importorskip("shortfin_apps.llm.server", reason="shortfin is in the test extra: pip install -e '.[test]'")
    vmfb, irpa, config = smollm2_compiled
    folder = tmp_path_factory.mktemp("shortfin")
    yield from start_server(vmfb, irpa, config, _tokenizer_dir(irpa, folder), folder / "server.log")


def test_concurrent_requests_match_sharkport_runner(shortfin_smollm2, smollm2_compiled):
    texts, rejected = generate_concurrently(shortfin_smollm2, PROMPTS)
    expected = runner_texts(*smollm2_compiled, PROMPTS)
    assert texts == expected
    assert all(texts)
    # Batch size 1: shortfin's queue holds one request, so the others were told QUEUE_FULL and
    # resent (at least one was, as all three were sent while the first was being served).
    assert rejected >= 1


def test_streaming_request_gives_the_same_text(shortfin_smollm2, smollm2_compiled):
    """A request with "stream": true is served, with the greedy text of a plain request."""
    deadline = time.monotonic() + REQUEST_S
    streamed, _ = post_generate(shortfin_smollm2, PROMPTS[0], deadline, stream=True)
    assert streamed == runner_texts(*smollm2_compiled, PROMPTS[:1])[0]
    assert "Traceback" not in shortfin_smollm2.log.read_text()


@pytest.mark.extended
def test_batched_concurrent_requests(smollm2_irpa, tmp_path_factory):
    """A SmolLM2 export with batch sizes 1 and 4: shortfin serves the three requests together
    (one prefill_bs4 call, then decode_bs4 steps for all three) without QUEUE_FULL answers."""
    pytest.importorskip("shortfin_apps.llm.server", reason="shortfin is in the test extra: pip install -e '.[test]'")
    from run_cli import run

    folder = tmp_path_factory.mktemp("shortfin_bs4")
    vmfb, config = folder / "smollm2.vmfb", folder / "smollm2.json"
    run("sharkport.export", "--irpa-file", str(smollm2_irpa), "--bs-prefill", "1,4", "--bs-decode", "1,4",
        "--max-seq-len", "512", "--device-block-count", "16", "--output-mlir", str(folder / "smollm2.mlir"),
        "--output-config", str(config), "--output-vmfb", str(vmfb), "--output-tokenizer-dir", str(folder),
        timeout=3600)
    server = start_server(vmfb, smollm2_irpa, config, folder, folder / "server.log")
    try:
        texts, rejected = generate_concurrently(next(server), PROMPTS)
    finally:
        server.close()  # runs start_server's finally: the server is stopped
    log = (folder / "server.log").read_text()
    assert rejected == 0
    assert texts == runner_texts(vmfb, smollm2_irpa, config, PROMPTS)
    assert "Traceback" not in log
