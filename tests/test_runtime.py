"""Runtime guards: the runner checks every input against the exported ranges before a call
(IREE does not check dynamic dimensions), and the generate loop owns pages safely."""

import re

import numpy as np
import pytest

from sharkport.archive import Dataset
from sharkport.errors import SharkportError
from sharkport.export import ExportConfig, service_config
from sharkport.models import ModelConfig, build_model
from sharkport.runtime.generate import PageAllocator, generate
from sharkport.runtime.eager import EagerSession

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STRIDE, PAGES, MAX_SEQ = 16, 8, 64


@pytest.fixture(scope="module")
def session(irpa_of):
    model = build_model(Dataset.load(irpa_of("gqa-untied")), ModelConfig(block_seq_stride=STRIDE))
    config = ExportConfig(bs_prefill=(1, 4), bs_decode=(4,), block_seq_stride=STRIDE,
                          device_block_count=PAGES, max_seq_len=MAX_SEQ)
    return EagerSession(model, service_config(model, config))


def i64(*rows):
    return np.array(rows, np.int64)


def prefill_args(batch=1, blocks=1, lens=None, pages=None):
    tokens = np.ones((batch, blocks * STRIDE), np.int64)
    lens = np.full(batch, 5, np.int64) if lens is None else lens
    pages = np.arange(batch * blocks, dtype=np.int64).reshape(batch, blocks) if pages is None else pages
    return tokens, lens, pages


@pytest.mark.parametrize("args, message", [
    pytest.param(prefill_args(batch=2), "batch size 2 was not exported", id="batch-not-exported"),
    pytest.param(prefill_args(blocks=5), "exceed max_seq_len 64", id="too-long"),
    pytest.param(prefill_args(pages=i64([PAGES])), "page indices in 0..7", id="page-past-cache"),
    pytest.param(prefill_args(pages=i64([-1])), "page indices", id="negative-page"),
    pytest.param(prefill_args(lens=i64(0)), "seq_lens", id="zero-length"),
    pytest.param(prefill_args(lens=i64(17)), "seq_lens", id="length-past-tokens"),
    pytest.param((np.ones((1, 10), np.int64), i64(5), i64([0])), "block_seq_stride", id="ragged-tokens"),
    pytest.param((np.ones((1, 16), np.int32), i64(5), i64([0])), "int64", id="int32-tokens"),
    pytest.param((np.full((1, 16), 256, np.int64), i64(5), i64([0])), "token ids", id="token-past-vocab"),
])
def test_prefill_inputs_are_checked(session, args, message):
    with pytest.raises(SharkportError, match=message):
        session.prefill(*args)


def test_decode_positions_are_checked(session):
    tokens, lens, pages = np.ones((4, 1), np.int64), np.full(4, 5, np.int64), np.zeros((4, 1), np.int64)
    with pytest.raises(SharkportError, match="start_positions must equal seq_lens - 1"):
        session.decode(tokens, lens, lens, pages)
    with pytest.raises(SharkportError, match=r"tokens must be \[batch, 1\]"):
        session.decode(np.ones((4, 2), np.int64), lens, lens - 1, pages)


def test_generate_refuses_prompts_past_max_seq_len(session):
    with pytest.raises(SharkportError, match="exceeds the exported max_seq_len 64"):
        generate(session, [[1] * 60], max_new_tokens=8)


def test_generate_reports_kv_exhaustion_and_keeps_pages(session):
    # 4 prompts of 40 + 8 tokens need 3 pages each; the cache has 8, one of them the scratch
    # page of padding rows. A static group of 4 cannot fit; continuous batching runs 2 at a
    # time and starts the others when pages are freed.
    prompts = [[1] * 40] * 4
    with pytest.raises(SharkportError, match="free pages"):
        generate(session, prompts, max_new_tokens=8, continuous=False)
    assert generate(session, prompts, max_new_tokens=8) == generate(session, prompts[:1], max_new_tokens=8) * 4
    # One sequence longer than the whole cache can never run: an error, not a wait.
    small = EagerSession(session.model, session.config, pages=3)
    with pytest.raises(SharkportError, match="2 free pages but 4 are needed"):
        generate(small, [[1] * 60], max_new_tokens=4)
    assert generate(session, [[1, 2, 3]], max_new_tokens=2)  # the allocator was not left short


def test_generate_zero_new_tokens(session):
    assert generate(session, [[1, 2, 3], [4, 5]], max_new_tokens=0) == [[], []]
    with pytest.raises(SharkportError, match="max_new_tokens"):
        generate(session, [[1]], max_new_tokens=-1)


def test_page_allocator_hands_out_every_page_once():
    allocator = PageAllocator(5)
    pages = allocator.alloc(3) + allocator.alloc(2)
    assert sorted(pages) == [0, 1, 2, 3, 4]
    with pytest.raises(SharkportError, match="0 free pages but 1 are needed"):
        allocator.alloc(1)
    allocator.free(pages[:2])
    assert sorted(allocator.alloc(2)) == sorted(pages[:2])


_COUNT_WORKERS = """
import os, sys
from pathlib import Path
from sharkport.runtime.session import IreeSession
IreeSession(*sys.argv[1:4])
names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
print(sum(n.startswith("iree-worker") for n in names), len(os.sched_getaffinity(0)))
"""


@pytest.mark.slow
def test_local_task_gets_a_worker_per_cpu(compiled_of):
    """IREE's own default topology gives this 2-vCPU machine one worker; the runner asks for one
    per CPU the process may use (docs/performance.md: prefill and decode 1.6x to 1.8x faster)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _COUNT_WORKERS, *map(str, compiled_of("gqa-untied"))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    workers, cpus = map(int, proc.stdout.split())
    assert workers == cpus


@pytest.mark.slow
def test_a_model_that_does_not_fit_fails_before_loading(compiled_of, monkeypatch):
    """Where the archive's weights and the KV cache together exceed the memory the system has
    available (MemAvailable), the session refuses to load, naming the archive, the bytes needed
    and the bytes free; with enough available it loads."""
    from sharkport.runtime import session as sessions

    vmfb, irpa, config = compiled_of("gqa-untied")
    service = sessions.ServiceConfig.load(config)
    cache = 8 * service.page_elems * np.dtype(service.kv_cache_dtype).itemsize
    weights = irpa.stat().st_size
    monkeypatch.setattr(sessions, "_available_bytes", lambda: weights + cache // 2)
    with pytest.raises(SharkportError, match=rf"{re.escape(str(irpa))}: the weights \(.* GiB\) and a KV cache of 8 "
                                             r"pages \(.* GiB\) need .* GiB and the system has .* GiB available"):
        sessions.IreeSession(vmfb, irpa, config, pages=8)
    monkeypatch.setattr(sessions, "_available_bytes", lambda: weights + 2 * cache)
    assert sessions.IreeSession(vmfb, irpa, config, pages=8).pages == 8


def test_bad_spin_setting_is_one_clear_error():
    import os
    import subprocess
    import sys

    code = "import iree.runtime as rt\nfrom sharkport.runtime.session import tune_local_task\ntune_local_task(rt)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, SHARKPORT_IREE_SPIN_US="soon"))
    assert proc.returncode != 0 and "SHARKPORT_IREE_SPIN_US='soon'" in proc.stderr


_PREFILL_FAULTS = """
import resource, sys
import numpy as np
from sharkport.runtime.session import IreeSession
session = IreeSession(*sys.argv[1:4], pages=8)
tokens = np.random.default_rng(0).integers(0, 49152, (1, 128), dtype=np.int64)
prefill = lambda: np.array(session.prefill(tokens, np.array([128]), np.arange(4)[None]), copy=True)
prefill()  # the first call allocates whatever it needs
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
logits = [prefill() for _ in range(4)]
np.save(sys.argv[4], logits[-1])
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
"""


@pytest.mark.slow
def test_cpu_sessions_keep_a_calls_transient_buffers_for_the_next(smollm2_compiled, tmp_path):
    """A prefill's activations and the kernels' scratch are transient buffers IREE allocates for
    each call; on a CPU device IREE's default allocator hands out fresh memory each time, whose
    pages fault in again (about 25 thousand faults a 128-token SmolLM2 prefill). The sessions'
    caching allocator (session.CPU_ALLOCATOR) keeps them: repeated prefills fault in under a
    tenth as many pages, and compute the same logits. Each is measured in a fresh process: in a
    long-lived one, what the heap holds from earlier work moves both counts."""
    import os
    import subprocess
    import sys

    def faults_and_logits(caching: str):
        out = tmp_path / f"logits-{caching}.npy"
        proc = subprocess.run([sys.executable, "-c", _PREFILL_FAULTS, *map(str, smollm2_compiled), str(out)],
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, SHARKPORT_IREE_CACHING=caching))
        assert proc.returncode == 0, proc.stderr
        return float(proc.stdout.split()[-1]), np.load(out)

    cached, logits = faults_and_logits("1")
    fresh, want = faults_and_logits("0")
    assert cached < fresh / 10, (cached, fresh)
    np.testing.assert_array_equal(logits, want)
