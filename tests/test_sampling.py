"""Host-side sampling: the logits processors against transformers' own, the draws against the
distribution they come from, and sampled generation on a tiny model (seeds repeat, top-k and
top-p leave the candidates they should, temperature → 0 is greedy)."""

import numpy as np
import pytest
import torch
import transformers
from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from sharkport.api import TextGenerator
from sharkport.errors import SharkportError
from sharkport.runtime.sampling import (GenerationConfig, choose, min_p_filter, process_logits,
                                        repetition_penalty, softmax, top_k_filter, top_p_filter)

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


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("scale", [pytest.param(1.0, id="flat"), pytest.param(5.0, id="peaked")])
def test_min_p_matches_transformers(min_p, scale):
    logits = random_logits(6, scale)
    ours = min_p_filter(logits, min_p)
    assert_same_scores(ours, hf_apply([MinPLogitsWarper(min_p)], [0], logits))
    assert 1 <= np.isfinite(ours).sum() < V


@pytest.mark.parametrize("generated", [0, 2, 3, 5])
def test_min_new_tokens_matches_transformers(generated):
    """The stop tokens are held off while fewer than min_new_tokens tokens are generated."""
    logits, prompt = random_logits(7), previous_ids(7)
    stop = [int(np.argmax(logits)), 3]
    config = GenerationConfig(min_new_tokens=3, stop_token_ids=stop)
    ids = prompt + list(range(generated))
    theirs = hf_apply([MinNewTokensLengthLogitsProcessor(len(prompt), 3, stop)], ids, logits)
    assert_same_scores(process_logits(logits, ids, config, generated=generated), theirs)


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


def test_transformers_config_means_what_it_means_to_transformers():
    """A transformers.GenerationConfig: unset fields take transformers' defaults (top_k 50,
    max_length 20), and the chain is transformers' own processors in their order."""
    theirs_config = transformers.GenerationConfig(do_sample=True, temperature=0.8, top_p=0.95, min_p=0.05,
                                                  repetition_penalty=1.2, min_new_tokens=2, eos_token_id=[7, 9])
    config = GenerationConfig.make(theirs_config)
    assert (config.top_k, config.max_length, config.max_new_tokens) == (50, 20, None)
    assert config.stop_token_ids == (7, 9) and config.new_tokens(15) == 5
    for seed in range(3):
        logits, prompt = random_logits(seed), previous_ids(seed)
        logits[[7, 9]] = logits.max() + 1  # the stop tokens would win
        processors = [RepetitionPenaltyLogitsProcessor(1.2), MinNewTokensLengthLogitsProcessor(len(prompt), 2, [7, 9]),
                      TemperatureLogitsWarper(0.8), TopKLogitsWarper(50), TopPLogitsWarper(0.95), MinPLogitsWarper(0.05)]
        for generated in (1, 2):
            ids = prompt + [11] * generated
            assert_same_scores(process_logits(logits, ids, config, generated=generated),
                               hf_apply(processors, ids, logits))


def test_transformers_config_without_our_equivalent_is_an_error():
    with pytest.raises(SharkportError, match="num_beams=4"):
        GenerationConfig.make(transformers.GenerationConfig(num_beams=4))
    assert GenerationConfig.make(transformers.GenerationConfig(num_beams=1, pad_token_id=0)).max_length == 20


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
    # transformers' names, and max_length alone bounding prompt + new tokens
    config = GenerationConfig.make({"eos_token_id": 2, "stop_strings": "###"}, max_length=40)
    assert (config.stop_token_ids, config.stop, config.max_new_tokens) == ((2,), ("###",), None)
    assert (config.new_tokens(10), config.new_tokens(45)) == (30, 0)
    assert GenerationConfig.make(max_length=40, max_new_tokens=5).new_tokens(10) == 5  # as in transformers


@pytest.mark.parametrize("options, message", [
    pytest.param(dict(top_kk=3), "unknown option.*top_kk", id="unknown-key"),
    pytest.param(dict(top_p=0.0), "top_p", id="top_p-zero"),
    pytest.param(dict(temperature=-1.0), "temperature", id="negative-temperature"),
    pytest.param(dict(max_new_tokens=-1), "max_new_tokens", id="negative-length"),
    pytest.param(dict(num_return_sequences=2), "needs do_sample", id="greedy-many"),
    pytest.param(dict(stop=[""]), "stop strings", id="empty-stop"),
    pytest.param(dict(max_new_tokens=2.5), "whole number", id="fractional-length"),
    pytest.param(dict(min_p=1.5), "min_p", id="min_p-over-one"),
    pytest.param(dict(stop=["a"], stop_strings=["b"]), "give one", id="alias-twice"),
    pytest.param(dict(max_new_tokens=None), "max_new_tokens or max_length", id="no-length"),
    pytest.param(dict(seed=-1), "seed must be", id="negative-seed"),
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


def test_transformers_config_gives_transformers_tokens(generator, tiny):
    """Greedy generate() with a transformers.GenerationConfig (max_length, min_new_tokens,
    eos_token_id, repetition_penalty) gives the tokens transformers' own generate() gives."""
    hf, prompt = tiny["mha-untied"].hf, PROMPTS[0]
    base = dict(max_length=len(prompt) + 12, repetition_penalty=1.3, do_sample=False, pad_token_id=0)

    def hf_generate(**options):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                          generation_config=transformers.GenerationConfig(**base, **options))
        return out[0, len(prompt):].tolist()

    free = hf_generate()
    eos = free[1]  # reached at the second step: min_new_tokens=4 must hold it off
    for options in (dict(), dict(eos_token_id=eos), dict(eos_token_id=eos, min_new_tokens=4)):
        theirs = hf_generate(**options)
        ours = generator.generate([prompt], transformers.GenerationConfig(**base, **options))[0]
        assert ours.generations[0].token_ids == theirs, options
    assert len(hf_generate(eos_token_id=eos)) == 2


def test_deepsparse_argument_names(generator):
    reference = tokens_of(generator.generate(PROMPTS, max_new_tokens=4))
    assert tokens_of(generator.generate(sequences=PROMPTS, generation_config={"max_new_tokens": 4})) == reference
    assert generator.generate(prompt=PROMPTS[1], max_new_tokens=4).generations[0].token_ids == reference[1]
    events = list(generator.generate(sequences=PROMPTS, max_new_tokens=4, streaming=True))
    assert len(events) == 4 * len(PROMPTS)
    with pytest.raises(SharkportError, match="give one"):
        generator.generate(PROMPTS, prompt=PROMPTS[0])
    with pytest.raises(SharkportError, match="give one"):
        generator.generate(PROMPTS, {"max_new_tokens": 2}, generation_config={"max_new_tokens": 3})


def test_max_length_bounds_prompt_and_new_tokens(generator):
    greedy = tokens_of(generator.generate(PROMPTS, max_new_tokens=30))
    outputs = generator.generate(PROMPTS, max_length=30)
    for prompt, out, full in zip(PROMPTS, outputs, greedy):
        new = max(30 - len(prompt), 0)
        assert out.generations[0].token_ids == full[:new] and out.generations[0].finish_reason == "length"
