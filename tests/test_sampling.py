"""Host-side sampling: the logits processors against transformers' own, the draws against the
distribution they come from, and sampled generation on a tiny model (seeds repeat, top-k and
top-p leave the candidates they should, temperature → 0 is greedy)."""

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from sharkport.api import TextGenerator
from sharkport.errors import SharkportError
from sharkport.runtime.sampling import (GenerationConfig, choose, process_logits, repetition_penalty,
                                        softmax, top_k_filter, top_p_filter)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 1000


def random_logits(seed: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(V) * scale).astype(np.float32)


def previous_ids(seed: int) -> list[int]:
    return np.random.default_rng(seed + 100).integers(0, V, 40).tolist()  # with repeats


def hf_apply(processors, ids: list[int], logits: np.ndarray) -> np.ndarray:
    return LogitsProcessorList(processors)(torch.tensor([ids]), torch.from_numpy(logits)[None].clone())[0].numpy()


def assert_same_scores(ours: np.ndarray, theirs: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs))
    finite = np.isfinite(theirs)
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# Processors against transformers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [pytest.param(1.3, id="discourage"), pytest.param(0.7, id="encourage")])
@pytest.mark.parametrize("seed", [0, 1])
def test_repetition_penalty_matches_transformers(penalty, seed):
    logits, ids = random_logits(seed), previous_ids(seed)
    ours = repetition_penalty(logits, ids, penalty)
    assert_same_scores(ours, hf_apply([RepetitionPenaltyLogitsProcessor(penalty)], ids, logits))
    assert not np.array_equal(ours, logits)


@pytest.mark.parametrize("k", [1, 5, 50, V, V + 10])
def test_top_k_matches_transformers(k):
    logits = random_logits(2)
    ours = top_k_filter(logits, k)
    assert_same_scores(ours, hf_apply([TopKLogitsWarper(k)], [0], logits))
    assert np.isfinite(ours).sum() == min(k, V)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [pytest.param(1.0, id="flat"), pytest.param(5.0, id="peaked")])
def test_top_p_matches_transformers(p, scale):
    logits = random_logits(3, scale)
    assert_same_scores(top_p_filter(logits, p), hf_apply([TopPLogitsWarper(p)], [0], logits))


@pytest.mark.parametrize("options", [
    pytest.param(dict(temperature=0.7), id="temperature"),
    pytest.param(dict(temperature=1.5, top_k=20), id="temperature-top_k"),
    pytest.param(dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2), id="temperature-top_p-penalty"),
    pytest.param(dict(temperature=0.6, top_k=40, top_p=0.8, repetition_penalty=1.1), id="all"),
])
def test_processor_chain_matches_transformers(options):
    """process_logits applies what transformers' generate() would, in the same order."""
    config = GenerationConfig(do_sample=True, **options)
    processors = []
    if config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    processors.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        processors.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1.0:
        processors.append(TopPLogitsWarper(config.top_p))
    for seed in range(3):
        logits, ids = random_logits(seed), previous_ids(seed)
        assert_same_scores(process_logits(logits, ids, config), hf_apply(processors, ids, logits))


def test_draws_follow_the_processed_distribution():
    """20k draws from top-k-filtered scores: each candidate's frequency within 4 standard
    errors of its softmax probability, and nothing drawn outside the candidates."""
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=6)
    scores = process_logits(random_logits(4, scale=1.0), [], config)
    rng = np.random.default_rng(0)
    n = 20_000
    counts = np.bincount([choose(scores, config, rng) for _ in range(n)], minlength=V)
    probs = softmax(scores.astype(np.float64))
    assert counts[probs == 0].sum() == 0
    se = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(counts / n - probs) <= 4 * se + 1e-12)


def test_greedy_choice_is_argmax_whatever_the_rng():
    scores = random_logits(5)
    for seed in range(3):
        assert choose(scores, GenerationConfig(), np.random.default_rng(seed)) == int(np.argmax(scores))


# ---------------------------------------------------------------------------------------------
# GenerationConfig
# ---------------------------------------------------------------------------------------------

def test_config_from_dict_and_kwargs():
    config = GenerationConfig.make({"do_sample": True, "top_k": 5, "stop": ["\n"]}, top_k=7, seed=3)
    assert (config.do_sample, config.top_k, config.seed, config.stop) == (True, 7, 3, ("\n",))
    assert GenerationConfig.make(config, max_new_tokens=4).top_k == 7
    assert GenerationConfig.make() == GenerationConfig()  # greedy by default
    assert not GenerationConfig().sampling and not GenerationConfig(do_sample=True, temperature=0).sampling


@pytest.mark.parametrize("options, message", [
    pytest.param(dict(top_kk=3), "unknown option.*top_kk", id="unknown-key"),
    pytest.param(dict(top_p=0.0), "top_p", id="top_p-zero"),
    pytest.param(dict(temperature=-1.0), "temperature", id="negative-temperature"),
    pytest.param(dict(max_new_tokens=-1), "max_new_tokens", id="negative-length"),
    pytest.param(dict(num_return_sequences=2), "needs do_sample", id="greedy-many"),
    pytest.param(dict(stop=[""]), "stop strings", id="empty-stop"),
])
def test_config_rejects_bad_values(options, message):
    with pytest.raises(SharkportError, match=message):
        GenerationConfig.make(**options)


# ---------------------------------------------------------------------------------------------
# Sampled generation on a tiny model (eager)
# ---------------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 200, 3], [9] * 20, list(range(40, 75))]


@pytest.fixture(scope="module")
def generator(irpa_of):
    return TextGenerator.eager(irpa_of("mha-untied"), block_seq_stride=16, batch_size=4, max_seq_len=128)


def tokens_of(outputs) -> list[list[int]]:
    return [g.token_ids for out in outputs for g in out.generations]


def test_fixed_seed_repeats(generator):
    options = dict(max_new_tokens=12, do_sample=True, temperature=1.2, top_k=50, num_return_sequences=2)
    first = tokens_of(generator.generate(PROMPTS, seed=7, **options))
    assert tokens_of(generator.generate(PROMPTS, seed=7, **options)) == first
    assert tokens_of(generator.generate(PROMPTS, seed=8, **options)) != first
    assert first[0] != first[1]  # two samples of one prompt draw differently
    # Each sequence has its own generator: alone it draws what it drew in the batch.
    assert tokens_of(generator.generate(PROMPTS[:1], seed=7, **options)) == first[0:2]


def test_top_k_leaves_at_most_k_candidates(generator):
    outputs = generator.generate(PROMPTS, max_new_tokens=10, do_sample=True, top_k=3, seed=0,
                                 output_scores=True)
    for out in outputs:
        g = out.generations[0]
        assert len(g.scores) == len(g.token_ids) == 10
        for token, scores, logits in zip(g.token_ids, g.scores, g.logits):
            finite = np.isfinite(scores)
            assert finite.sum() <= 3 and finite[token]
            assert set(np.flatnonzero(finite)) == set(np.argsort(logits)[-3:].tolist())


@pytest.mark.parametrize("p", [0.3, 0.8])
def test_top_p_leaves_the_smallest_set_over_p(generator, p):
    outputs = generator.generate(PROMPTS, max_new_tokens=10, do_sample=True, top_p=p, temperature=0.5,
                                 seed=1, output_scores=True)
    for out in outputs:
        g = out.generations[0]
        for token, scores, logits in zip(g.token_ids, g.scores, g.logits):
            probs = softmax(logits.astype(np.float64) / 0.5)
            kept = np.isfinite(scores)
            assert kept[token]
            assert probs[kept].sum() >= p - 1e-6
            # Every kept token is likelier than every dropped one, and dropping the least likely
            # kept token would leave less than p: the set is the smallest over p.
            assert kept.all() or probs[kept].min() >= probs[~kept].max()
            assert probs[kept].sum() - probs[kept].min() < p + 1e-6


def test_temperature_to_zero_is_greedy(generator):
    greedy = tokens_of(generator.generate(PROMPTS, max_new_tokens=10))
    assert tokens_of(generator.generate(PROMPTS, max_new_tokens=10, do_sample=True, temperature=0.0)) == greedy
    assert tokens_of(generator.generate(PROMPTS, max_new_tokens=10, do_sample=True, temperature=1e-4,
                                        seed=3)) == greedy
    assert tokens_of(generator.generate(PROMPTS, max_new_tokens=10, do_sample=True, temperature=1.0,
                                        seed=3)) != greedy


def test_repetition_penalty_changes_greedy_choice_as_transformers_would(generator):
    """With a penalty, each greedy token is the argmax of transformers' penalized logits."""
    outputs = generator.generate(PROMPTS, max_new_tokens=10, repetition_penalty=1.5, output_scores=True)
    assert tokens_of(outputs) != tokens_of(generator.generate(PROMPTS, max_new_tokens=10))
    for prompt, out in zip(PROMPTS, outputs):
        g = out.generations[0]
        seq = list(prompt)
        for token, logits in zip(g.token_ids, g.logits):
            penalized = hf_apply([RepetitionPenaltyLogitsProcessor(1.5)], seq, logits)
            assert token == int(np.argmax(penalized))
            seq.append(token)
