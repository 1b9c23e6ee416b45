"""Registered datasets (sharkport.datasets, `--hf-dataset`) fetched through huggingface_hub from a
real HTTP server on 127.0.0.1 that serves a tiny model in the hub's file-download layout
(`/{repo_id}/resolve/{revision}/{filename}` with the ETag / X-Repo-Commit / Content-Length
headers huggingface_hub reads). HF_ENDPOINT is read when huggingface_hub is imported, so every
fetch runs in a subprocess with the environment set; HF_HOME is a temporary folder.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import yaml

from sharkport import datasets
from sharkport.datasets import __main__ as datasets_cli

REPO_GGUF = "tiny-org/tiny-llama-gguf"
REPO_HF = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
HF_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


class HubServer:
    """Serves `files` ({repo_id: {filename: bytes}}) at the hub's resolve URLs, for REVISION
    only, and counts the requests per (method, path)."""

    def __init__(self, files: dict[str, dict[str, bytes]]):
        self.files = files
        self.requests: Counter[tuple[str, str]] = Counter()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool):
                server.requests[self.command, self.path] += 1
                data = server.lookup(self.path)
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("X-Repo-Commit", REVISION)
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def lookup(self, path: str) -> bytes | None:
        for repo_id, files in self.files.items():
            prefix = f"/{repo_id}/resolve/{REVISION}/"
            if path.startswith(prefix):
                return files.get(path[len(prefix):])
        return None

    def gets(self) -> int:
        return sum(n for (method, _), n in self.requests.items() if method == "GET")

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """A tiny llama (vocabulary 320) saved by transformers, with a byte-level BPE tokenizer.json
    of 320 tokens trained here, and the same weights as a GGUF."""
    from tiny_models import TinySpec, make_tiny_llama_with_bpe

    root = tmp_path_factory.mktemp("dataset_model")
    return make_tiny_llama_with_bpe(TinySpec("dataset", kv_heads=2, tied=True, vocab_size=320, seed=9), root)


@pytest.fixture
def hub(tiny_hf_model, tmp_path):
    """(server, environment for subprocesses, registry file). The registry names two datasets:
    the GGUF (alias tiny-gguf-alias) and the safetensors folder."""
    files = {
        REPO_GGUF: {"model.gguf": tiny_hf_model.gguf_path.read_bytes()},
        REPO_HF: {f: (tiny_hf_model.hf_dir / f).read_bytes() for f in HF_FILES},
    }
    registry = tmp_path / "datasets.yaml"
    registry.write_text(yaml.safe_dump({
        "tiny-gguf": {"repo_id": REPO_GGUF, "revision": REVISION, "files": {"gguf": "model.gguf"},
                      "aliases": ["tiny-gguf-alias"]},
        "tiny-hf": {"repo_id": REPO_HF, "revision": REVISION,
                    "files": {"config": "config.json", "safetensors": ["model.safetensors"],
                              "tokenizer": ["tokenizer.json", "tokenizer_config.json"]}},
    }))
    server = HubServer(files)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "hf_home"), SHARKPORT_DATASETS=str(registry),
               SHARKPORT_CACHE=str(tmp_path / "sharkport_cache"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5", OMP_NUM_THREADS="1")
    yield server, env, registry
    server.stop()


def run(env: dict[str, str], *args: str, offline: bool = False) -> subprocess.CompletedProcess:
    env = dict(env, HF_HUB_OFFLINE="1") if offline else env
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=600)


def test_fetch_downloads_then_uses_the_cache_then_works_offline(hub, tiny_hf_model, tmp_path):
    server, env, _ = hub
    first = run(env, "sharkport.datasets", "fetch", "tiny-hf")
    assert first.returncode == 0, first.stderr
    # every file came over HTTP, once, into the standard cache layout under HF_HOME
    assert server.gets() == len(HF_FILES)
    snapshot = tmp_path / "hf_home" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / REVISION
    for f in HF_FILES:
        assert (snapshot / f).read_bytes() == (tiny_hf_model.hf_dir / f).read_bytes(), f
    assert f"model: {snapshot}" in first.stdout

    second = run(env, "sharkport.datasets", "fetch", "tiny-hf")
    assert second.returncode == 0, second.stderr
    assert server.gets() == len(HF_FILES)  # no new download

    assert run(env, "sharkport.datasets", "fetch", "tiny-gguf-alias").returncode == 0
    assert server.gets() == len(HF_FILES) + 1
    server.stop()

    # server gone, offline: the tools work from the cache
    from sharkport.archive import Dataset

    out = tmp_path / "from_cache.irpa"
    r = run(env, "sharkport.tools.import_hf", "--hf-dataset", "tiny-hf", "--output-irpa", str(out), offline=True)
    assert r.returncode == 0, r.stderr
    r = run(env, "sharkport.tools.dump_gguf", "--hf-dataset", "tiny-gguf", "--json", offline=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["metadata"]["llama.vocab_size"] == 320
    r = run(env, "sharkport.tools.generate", "--hf-dataset", "tiny-hf", "--prompt", "the student",
            "--max-new-tokens", "4", "--block-seq-stride", "16", offline=True)
    assert r.returncode == 0, r.stderr
    assert "the student" in r.stdout

    # run --hf-dataset: an archive imported once from the cache into SHARKPORT_CACHE, then reused
    script = "from sharkport.datasets import dataset_archive; print(dataset_archive('tiny-hf', progress=False))"
    first_irpa = subprocess.run([sys.executable, "-c", script], env=dict(env, HF_HUB_OFFLINE="1"),
                                capture_output=True, text=True, timeout=300)
    assert first_irpa.returncode == 0, first_irpa.stderr
    irpa = Path(first_irpa.stdout.strip())
    assert irpa.parent == tmp_path / "sharkport_cache" and "importing tiny-hf" in first_irpa.stderr
    again = subprocess.run([sys.executable, "-c", script], env=dict(env, HF_HUB_OFFLINE="1"),
                           capture_output=True, text=True, timeout=300)
    assert Path(again.stdout.strip()) == irpa and "importing" not in again.stderr
    assert Dataset.load(irpa).metadata["tensors"] == Dataset.load(out).metadata["tensors"]
    r = run(env, "sharkport.run", "--help")
    assert "--hf-dataset" in r.stdout

    # the archive imported from the cache is the same model as the one imported from the folder
    cached, direct = Dataset.load(out), Dataset.load(tiny_hf_model.hf_dir)
    assert cached.metadata["tensors"] == direct.metadata["tensors"]
    assert cached.tokenizer().encode("the student") == direct.tokenizer().encode("the student")


def test_fetch_into_local_dir(hub, tiny_hf_model, tmp_path):
    server, env, _ = hub
    local = tmp_path / "local"
    r = run(env, "sharkport.datasets", "fetch", "tiny-gguf", "--local-dir", str(local))
    assert r.returncode == 0, r.stderr
    assert (local / "model.gguf").read_bytes() == tiny_hf_model.gguf_path.read_bytes()
    assert server.gets() == 1


def test_offline_without_cache_is_one_line_error(hub):
    server, env, _ = hub
    r = run(env, "sharkport.datasets", "fetch", "tiny-hf", offline=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "not in the Hugging Face cache" in r.stderr
    assert server.gets() == 0


def test_unknown_dataset_lists_known_ones(hub):
    _, env, _ = hub
    r = run(env, "sharkport.tools.import_hf", "--hf-dataset", "nope", "--output-irpa", "x.irpa")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "unknown dataset 'nope'" in r.stderr and "tiny-gguf" in r.stderr and "tiny-hf" in r.stderr


def test_dump_gguf_of_a_safetensors_dataset_says_what_to_use(hub):
    _, env, _ = hub
    r = run(env, "sharkport.tools.dump_gguf", "--hf-dataset", "tiny-hf")
    assert r.returncode == 2 and "import_hf --hf-dataset tiny-hf" in r.stderr


def test_list_shows_every_dataset(hub, capsys, monkeypatch):
    _, _, registry = hub
    monkeypatch.setenv("SHARKPORT_DATASETS", str(registry))
    assert datasets_cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "tiny-gguf" in out and "tiny-gguf-alias" in out and REPO_HF in out and REVISION in out


def test_repository_registry_is_valid():
    """The packaged datasets.yaml parses, names what the project promises, and every
    entry has a gguf or a config + safetensors pair."""
    registry = datasets.load_registry(Path(datasets.__file__).parent / "datasets.yaml")
    names = {d.name for d in registry.values()}
    for expected in ("open_llama_3b_v2_f16_gguf", "open_llama_3b_v2_q8_0_gguf", "open_llama_3b_v2_q4_1_gguf",
                     "mistral_7b_q4_k_m_gguf", "mistral_7b_q8_0_gguf", "mixtral_8x7b_q8_0_gguf",
                     "tinyllama_1_1b_chat", "smollm2_135m_instruct"):
        assert expected in names
    assert any(n.startswith("llama3_8b") for n in names)
    assert registry["smollm2"].pinned and registry["tinyllama"].pinned


@pytest.mark.parametrize("entry,message", [
    pytest.param({"repo_id": "a/b", "revision": "main"}, "needs files", id="no-files"),
    pytest.param({"repo_id": "a/b", "revision": "main", "files": {"weights": "x"}}, "unknown file kind", id="bad-kind"),
    pytest.param({"repo_id": "a/b", "revision": "main", "files": {"config": "config.json"}},
                 "needs a gguf file", id="no-weights"),
])
def test_malformed_registry_names_the_entry(tmp_path, entry, message):
    path = tmp_path / "datasets.yaml"
    path.write_text(yaml.safe_dump({"broken": entry}))
    with pytest.raises(datasets.SharkportError, match=f"dataset 'broken'.*{message}"):
        datasets.load_registry(path)
