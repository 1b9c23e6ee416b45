"""The generation loop and API: batching (static and continuous) gives every prompt what it gets
alone, streaming gives what non-streaming gives, stop tokens and strings end generations where
they should, and the run CLI streams and prints its stats.

Tiny random llamas run eagerly (quick) and compiled with prefill/decode at batch sizes 1 and 4
(slow). Tiny models carry no tokenizer; the text tests decode their ids (all < 256) with
SmolLM2's tokenizer from its GGUF, which is enough to exercise streaming text and stop strings.
"""

from __future__ import annotations

import numpy as np
import pytest

from sharkport.api import TextGenerator
from sharkport.archive import Dataset
from sharkport.errors import SharkportError
from sharkport.export import ExportConfig, service_config
from sharkport.models import ModelConfig, build_model
from sharkport.runtime.generate import GenerateStats, GenerationRun
from sharkport.runtime.sampling import GenerationConfig
from sharkport.runtime.eager import EagerSession
from sharkport.runtime.session import IreeSession
from tiny_models import TINY_EXPORT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANT = "gqa-untied"
LENGTHS = (1, 34, 67, 100, 133, 166, 200)  # 7 prompts, 1 to 13 pages each
NEW_TOKENS = 12


class Recorder:
    """Wraps a session and records the batch size of every call."""

    def __init__(self, session):
        self.session, self.calls = session, []
        self.config, self.pages = session.config, session.pages

    def prefill(self, tokens, *args):
        self.calls.append(("prefill", tokens.shape[0]))
        return self.session.prefill(tokens, *args)

    def decode(self, tokens, *args):
        self.calls.append(("decode", tokens.shape[0]))
        return self.session.decode(tokens, *args)


def prompts_for(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def eager(irpa_of):
    model = build_model(Dataset.load(irpa_of(VARIANT)), ModelConfig(block_seq_stride=TINY_EXPORT.block_seq_stride))
    return EagerSession(model, service_config(model, TINY_EXPORT))


@pytest.fixture(scope="module")
def compiled(compiled_of):
    vmfb, irpa, config = compiled_of(VARIANT)
    return IreeSession(vmfb, irpa, config)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf):
    return Dataset.load(smollm2_gguf).tokenizer()


def run_tokens(session, prompts, config, continuous=True):
    run = GenerationRun(session, prompts, config, continuous=continuous)
    return [g[0].token_ids for g in run.results()], run.stats


def check_batch_equals_alone(session, continuous: bool) -> None:
    """7 prompts of 1..200 tokens through decode_bs4: each gets the greedy tokens it gets alone
    (at batch size 1). Prompt 0 stops early on a stop token, so with continuous batching a
    waiting prompt takes its row before the others finish, and fewer decode steps are needed."""
    prompts = prompts_for(LENGTHS)
    plain = GenerationConfig(max_new_tokens=NEW_TOKENS)
    first, _ = run_tokens(session, prompts[:1], plain)
    stop = next(t for t in first[0] if t != first[0][0])  # appears first after a step or more
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, stop_token_ids=(stop,))

    alone = []
    for p in prompts:
        recorder = Recorder(session)
        alone += run_tokens(recorder, [p], config)[0]
        assert {bs for _, bs in recorder.calls} == {1}
    recorder = Recorder(session)
    batched, stats = run_tokens(recorder, prompts, config, continuous=continuous)
    assert batched == alone
    assert ("decode", 4) in recorder.calls and ("prefill", 4) in recorder.calls
    assert 1 < len(alone[0]) < NEW_TOKENS and max(len(t) for t in alone) == NEW_TOKENS

    _, static_stats = run_tokens(session, prompts, config, continuous=False)
    if continuous:
        assert stats.decode_steps < static_stats.decode_steps


# ---------------------------------------------------------------------------------------------
# Eager (quick)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("continuous", [pytest.param(True, id="continuous"), pytest.param(False, id="static")])
def test_batch_equals_alone_eager(eager, continuous):
    check_batch_equals_alone(eager, continuous)


@pytest.fixture(scope="module")
def text_generator(eager, smollm2_tokenizer):
    return TextGenerator(eager, smollm2_tokenizer)


def collect_stream(events):
    tokens, texts, finish = {}, {}, {}
    for ev in events:
        key = (ev.prompt_index, ev.sequence_index)
        assert key not in finish, "no event after a sequence's last"
        tokens.setdefault(key, []).append(ev.token_id)
        texts[key] = texts.get(key, "") + (ev.text or "")
        if ev.finish_reason:
            finish[key] = ev.finish_reason
    return tokens, texts, finish


def check_streaming(generator, prompts, **options) -> None:
    outputs = generator.generate(prompts, **options)
    tokens, texts, finish = collect_stream(generator.generate(prompts, stream=True, **options))
    want = {(i, j): g for i, out in enumerate(outputs) for j, g in enumerate(out.generations)}
    assert tokens == {k: g.token_ids for k, g in want.items()}
    assert texts == {k: g.text for k, g in want.items()}
    assert finish == {k: g.finish_reason for k, g in want.items()}


@pytest.mark.parametrize("options", [
    pytest.param(dict(max_new_tokens=10), id="greedy"),
    pytest.param(dict(max_new_tokens=10, do_sample=True, top_k=20, seed=4, num_return_sequences=2), id="sampled"),
    pytest.param(dict(max_new_tokens=16, stop=["a", "e "]), id="stop-strings"),
])
def test_streaming_equals_non_streaming(text_generator, options):
    check_streaming(text_generator, prompts_for((3, 40, 17, 9, 60), seed=1), **options)


def test_stop_string_cuts_the_text(text_generator):
    prompt = prompts_for((12,), seed=2)[0]
    full = text_generator.generate(prompt, max_new_tokens=20)
    g = full.generations[0]
    stop = g.text[len(g.text) // 2:][:3]  # a string that first appears mid-text
    cut = g.text.index(stop)
    out = text_generator.generate(prompt, max_new_tokens=20, stop=[stop]).generations[0]
    assert out.finish_reason == "stop" and out.text == g.text[:cut]
    n = len(out.token_ids)
    assert out.token_ids == g.token_ids[:n]  # up to the token that completed the stop string
    tok = text_generator.tokenizer
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])


def test_stop_token_ends_the_generation(eager):
    prompt = prompts_for((12,), seed=3)
    full, _ = run_tokens(eager, prompt, GenerationConfig(max_new_tokens=12))
    stop = full[0][4]
    run = GenerationRun(eager, prompt, GenerationConfig(max_new_tokens=12, stop_token_ids=(stop,)))
    g = run.results()[0][0]
    assert g.token_ids == full[0][:full[0].index(stop) + 1] and g.finish_reason == "stop"
    assert GenerationRun(eager, prompt, GenerationConfig(max_new_tokens=12)).results()[0][0].finish_reason == "length"


def test_timings_and_stats(eager):
    stats = GenerateStats()
    run = GenerationRun(eager, prompts_for((5, 9)), GenerationConfig(max_new_tokens=6), stats=stats)
    gens = [g[0] for g in run.results()]
    assert stats.generated_tokens == 12 and stats.decode_tokens == 10 and stats.prefill_tokens == 14
    assert 0 < stats.first_token_s <= min(g.time_to_first_token_s for g in gens)
    assert all(g.time_to_first_token_s < g.latency_s <= stats.total_s for g in gens)
    summary = stats.summary()
    for needle in ("prefill:", "time to first token", "tokens/s", "ms per output token"):
        assert needle in summary


@pytest.mark.parametrize("prompts, options, message", [
    pytest.param([[1] * 250], dict(max_new_tokens=10), "exceeds the exported max_seq_len 256", id="too-long"),
    pytest.param([[]], dict(), "prompt 0 is empty", id="empty"),
    pytest.param([[1]], dict(stop=["x"]), "stop strings need a tokenizer", id="stop-no-tokenizer"),
])
def test_bad_requests_are_clear_errors(eager, prompts, options, message):
    with pytest.raises(SharkportError, match=message):
        GenerationRun(eager, prompts, GenerationConfig(**options))


@pytest.mark.parametrize("prompt, message", [
    pytest.param([], "a prompt is empty", id="empty-list"),
    pytest.param("caf\udce9", "not valid UTF-8", id="invalid-utf8"),
])
def test_bad_prompts_are_clear_errors(text_generator, prompt, message):
    with pytest.raises(SharkportError, match=message):
        text_generator.generate([prompt], max_new_tokens=2)


@pytest.mark.parametrize("pages, message", [(0, "--pages 0"), (-5, "--pages -5"), (10**9, "GiB available")])
def test_bad_page_counts_are_clear_errors(eager, pages, message):
    with pytest.raises(SharkportError, match=message):
        EagerSession(eager.model, eager.config, pages=pages)


def test_text_prompt_needs_a_tokenizer(eager):
    with pytest.raises(SharkportError, match="no tokenizer"):
        TextGenerator(eager).generate("hello")


def test_stream_closed_early_frees_pages(eager):
    run = GenerationRun(eager, prompts_for((30, 30, 30)), GenerationConfig(max_new_tokens=20))
    events = iter(run)
    next(events)
    events.close()
    # A static group of 4 x 13 pages + the scratch page needs 53 of the 64 pages: it starts only
    # if the closed run's 13 pages came back.
    assert GenerationRun(eager, [[1] * 200] * 4, GenerationConfig(max_new_tokens=8), continuous=False).results()


def test_interleaved_runs_share_the_cache_safely(eager):
    """Two streams on one session, consumed in turns, each get what they get alone: they hold
    different pages of the session's cache."""
    a, b = prompts_for((20, 50), seed=5), prompts_for((7, 33, 90), seed=6)
    config = GenerationConfig(max_new_tokens=10)
    alone = [run_tokens(eager, p, config)[0] for p in (a, b)]
    runs = [GenerationRun(eager, p, config) for p in (a, b)]
    streams = [iter(r) for r in runs]
    active = list(streams)
    while active:
        for it in list(active):
            if next(it, None) is None:
                active.remove(it)
    assert [[g[0].token_ids for g in r.results()] for r in runs] == alone


# ---------------------------------------------------------------------------------------------
# Compiled (slow)
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("continuous", [pytest.param(True, id="continuous"), pytest.param(False, id="static")])
def test_batch_equals_alone_compiled(compiled, continuous):
    check_batch_equals_alone(compiled, continuous)


@pytest.mark.slow
def test_streaming_equals_non_streaming_compiled(compiled, smollm2_tokenizer):
    check_streaming(TextGenerator(compiled, smollm2_tokenizer), prompts_for((3, 40, 17, 9, 60), seed=1),
                    max_new_tokens=10, do_sample=True, top_p=0.9, seed=0, stop=["e "])


@pytest.mark.slow
def test_from_gguf_builds_once_and_reuses(tiny, compiled, tmp_path):
    # Batch size 1 only, to keep the compile short; rows are independent, so the tokens equal
    # those of the bs 1/4 module.
    export = ExportConfig(bs_prefill=(1,), bs_decode=(1,), block_seq_stride=16, device_block_count=8,
                          max_seq_len=64)
    logs: list[str] = []
    first = TextGenerator.from_gguf(tiny[VARIANT].gguf_path, cache_dir=tmp_path, export=export, log=logs.append)
    assert any(m.startswith("compiling") for m in logs)
    built = sorted(p.name for p in next(tmp_path.iterdir()).iterdir())
    assert built == ["model.irpa", "model.json", "model.vmfb"]
    logs.clear()
    again = TextGenerator.from_gguf(tiny[VARIANT].gguf_path, cache_dir=tmp_path, export=export, log=logs.append)
    assert logs == [f"reusing {next(tmp_path.iterdir())}"]
    prompts = prompts_for((5, 20))
    want, _ = run_tokens(compiled, prompts, GenerationConfig(max_new_tokens=8))
    for gen in (first, again):
        assert [out.generations[0].token_ids for out in gen.generate(prompts, max_new_tokens=8)] == want


# ---------------------------------------------------------------------------------------------
# SmolLM2: chat template and the run CLI (slow)
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_chat_prompt_is_transformers_template(smollm2_tokenizer, smollm2_hf):
    _, hf_tok = smollm2_hf
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    generator = TextGenerator(None, smollm2_tokenizer)
    assert generator.encode(messages) == hf_tok(want, add_special_tokens=False).input_ids
    user_only = hf_tok.apply_chat_template(messages[1:], add_generation_prompt=True, tokenize=False)
    assert generator.encode("Name three colors.", chat=True) == hf_tok(user_only, add_special_tokens=False).input_ids


@pytest.mark.slow
def test_run_cli_streams_what_it_prints(smollm2_compiled, capsys):
    from sharkport import run

    vmfb, irpa, config = smollm2_compiled
    argv = ["--vmfb", str(vmfb), "--irpa-file", str(irpa), "--config", str(config),
            "--prompt", "The capital of France is", "--max-new-tokens", "8"]
    assert run.main(argv) == 0
    printed = capsys.readouterr()
    assert run.main(argv + ["--stream"]) == 0
    streamed = capsys.readouterr()
    header, text = printed.out.split("\n", 1)  # the text may span lines
    assert header == "--- prompt 0: 'The capital of France is' (finish: length)"
    assert text.startswith("The capital of France is") and len(text) > len("The capital of France is\n")
    assert streamed.out == text + "--- finish: length\n"
    for needle in ("prefill:", "time to first token", "tokens/s", "ms per output token"):
        assert needle in printed.err and needle in streamed.err


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    pytest.param(["--device", "bogus://0"], b"--device bogus://0", id="device"),
    pytest.param(["--pages", "0"], b"--pages 0", id="pages-0"),
    pytest.param(["--prompt", b"caf\xe9"], b"not valid UTF-8", id="invalid-utf8"),
    pytest.param(["--seed", "-1", "--do-sample"], b"seed must be", id="seed"),
])
def test_run_cli_bad_arguments_are_one_line(smollm2_compiled, extra, message):
    import subprocess
    import sys

    vmfb, irpa, config = smollm2_compiled
    argv = [sys.executable, "-m", "sharkport.run", "--vmfb", str(vmfb), "--irpa-file", str(irpa),
            "--config", str(config), "--prompt", "hi", "--max-new-tokens", "2", *extra]
    proc = subprocess.run(argv, capture_output=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
