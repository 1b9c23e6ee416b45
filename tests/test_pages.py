"""Cache pages at run time: page 0 is an ordinary page (the exported program gives it no special
meaning), and a request that cannot get pages fails with a clear error without touching the
cache that other, running sequences hold."""

import numpy as np
import pytest

from sharkport.archive import Dataset
from sharkport.errors import SharkportError
from sharkport.export import ExportConfig, service_config
from sharkport.models import ModelConfig, build_model
from sharkport.runtime.generate import GenerationRun
from sharkport.runtime.sampling import GenerationConfig
from sharkport.runtime.eager import EagerSession

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STRIDE, PAGES = 16, 8


@pytest.fixture(scope="module")
def model(irpa_of):
    return build_model(Dataset.load(irpa_of("gqa-untied")), ModelConfig(block_seq_stride=STRIDE))


def new_session(model, pages=PAGES):
    config = ExportConfig(bs_prefill=(1, 2), bs_decode=(1, 2), block_seq_stride=STRIDE,
                          device_block_count=pages, max_seq_len=64)
    return EagerSession(model, service_config(model, config))


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


def _prefill_then_decode(session, prompt, pages):
    """Prefill `prompt` into `pages`, then decode its greedy next token: (prefill logits of the
    last prompt position, decode logits)."""
    n = len(prompt)
    tokens = np.zeros((1, len(pages) * STRIDE), np.int64)
    tokens[0, :n] = prompt
    ids = np.array([pages], np.int64)
    logits = session.prefill(tokens, np.array([n], np.int64), ids)[0, n - 1]
    nxt = np.array([[int(logits.argmax())]], np.int64)
    step = session.decode(nxt, np.array([n + 1], np.int64), np.array([n], np.int64), ids)[0, 0]
    return logits, step


def test_page_zero_is_an_ordinary_page(model):
    """The same prompt in pages [0, 1] and in pages [5, 6] gives the same logits, and leaves the
    same K/V in those pages."""
    prompt = _prompt(20)
    low, high = new_session(model), new_session(model)
    low_out = _prefill_then_decode(low, prompt, [0, 1])
    high_out = _prefill_then_decode(high, prompt, [5, 6])
    for a, b in zip(low_out, high_out):
        np.testing.assert_array_equal(a, b)
    low_cache, high_cache = low.cache_to_host(), high.cache_to_host()
    np.testing.assert_array_equal(low_cache[[0, 1]], high_cache[[5, 6]])
    assert np.abs(low_cache[0]).sum() > 0  # something was written to page 0
    assert not high_cache[0].any() and not low_cache[5].any()  # and nothing elsewhere


def test_page_zero_next_to_other_rows_in_a_batch(model):
    """Row 0 on page 0 and row 1 on page 3 of one batch each get what they get alone."""
    a, b = _prompt(9, seed=1), _prompt(14, seed=2)
    session = new_session(model)
    tokens = np.zeros((2, STRIDE), np.int64)
    tokens[0, :9], tokens[1, :14] = a, b
    batch = session.prefill(tokens, np.array([9, 14], np.int64), np.array([[0], [3]], np.int64))
    for row, (prompt, page) in enumerate(((a, 0), (b, 3))):
        alone = new_session(model)
        t = np.zeros((1, STRIDE), np.int64)
        t[0, :len(prompt)] = prompt
        expected = alone.prefill(t, np.array([len(prompt)], np.int64), np.array([[page]], np.int64))
        np.testing.assert_allclose(batch[row, :len(prompt)], expected[0, :len(prompt)], rtol=1e-5, atol=1e-5)


def test_out_of_pages_is_an_error_that_leaves_running_sequences_alone(model):
    """A runs (holding its pages); B needs more pages than are free and fails at once with the
    KV exhaustion error, before any call; the cache is byte for byte as before; A then finishes
    with exactly the tokens it gets alone."""
    config = GenerationConfig(max_new_tokens=12)
    prompt_a = _prompt(30, seed=3)
    alone = GenerationRun(new_session(model), [prompt_a], config).results()[0][0].token_ids

    session = new_session(model)
    run_a = GenerationRun(session, [prompt_a], config)
    events = iter(run_a)
    for _ in range(3):  # A is prefilled and two decode steps in: it holds 3 pages + the scratch page
        next(events)
    before = session.cache_to_host()
    with pytest.raises(SharkportError, match=r"the KV cache has \d+ free pages but \d+ are needed"):
        GenerationRun(session, [_prompt(50, seed=4)], config).results()  # needs 4 of the 4 free, plus scratch
    np.testing.assert_array_equal(session.cache_to_host(), before)
    for _ in events:
        pass
    assert run_a.results()[0][0].token_ids == alone
    # Everything was given back: a request for every page but the scratch one now runs.
    assert GenerationRun(session, [_prompt(50, seed=4)], config).results()

