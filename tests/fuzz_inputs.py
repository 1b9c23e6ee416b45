"""Fuzzing the files that come after the GGUF reader: an archive's metadata, a service config, a
checkpoint's config.json, and tokenizers (GGUF tokenizer metadata and `tokenizer.json`).

hypothesis mutates valid seeds: a value swapped for an extreme or mistyped one, a number nudged,
a key or list item dropped, added or repeated, a byte of the file flipped. Each case then runs
what a user's command runs on such a file. A case may succeed or raise SharkportError; another
exception, a case past its time limit, running out of the process's memory limit or a crash is a
bug, and so is a wrong answer where a reference exists:
- service config: a config the runner accepts generates the tokens the exported config gives;
- config.json: a config sharkport accepts has the sizes transformers reads from it;
- tokenizers: every id is in the vocabulary and decodes to text.

    python tests/fuzz_inputs.py --target archive --cases 10000 --json result.json

It runs as its own process (a crash ends it, not pytest) under an address-space limit.
tests/test_fuzz.py runs a few hundred cases; tools/fuzz_report.py runs 10,000 of each target and
writes docs/reliability.md.
"""

from __future__ import annotations

import argparse
import collections
import copy
import faulthandler
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_gguf import CaseTimeout, time_limit  # noqa: E402

from sharkport.errors import SharkportError  # noqa: E402

CASE_SECONDS = 10.0  # a case still running after this is a hang
MEMORY_LIMIT = 6 << 30  # address space of the fuzzing process (imports take about 1 GiB)
REPEAT_LIMIT = 100_000
PROMPT = [1, 2, 3]
TEXTS = ["Hello world", "  two  spaces\n\ttab", "ünïcödé 你好 🙂", "<s>special</s><|endoftext|>", "12345", ""]


class WrongAnswer(AssertionError):
    """A case that succeeded with a result its reference disagrees with."""


# --- mutations of a JSON document ---------------------------------------------------------------

# Values a field should never hold, or holds only at its edges.
SPECIAL = [None, True, False, 0, 1, -1, 2, 3, 7, 16, 31, 32, 33, 64, 255, 256, 2**31 - 1, 2**31, 2**32,
           2**53, 2**63, 2**64, 10**12, 10**100, -2**63, 0.0, -0.0, 0.5, 1e-30, 1e300, math.nan,
           math.inf, -math.inf, "", "x", "\x00", "llama", "gpt2", "qwen2", "gemma3", "F32", "Q4_K",
           "float16", "<s>", [], {}, [0], [1, 2], [-1], [[]], {"a": 1}]
VALUES = st.one_of(
    st.sampled_from(SPECIAL), st.integers(), st.floats(), st.text(max_size=12),
    st.lists(st.integers(-2, 70), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
# A path into the document: each integer picks a child of the container reached so far.
WALK = st.lists(st.integers(0, 2**16), max_size=4)
NUDGES = ["+1", "-1", "*2", "*0", "neg", "*1000", "/2"]


def json_mutations(text_bytes: bool):
    """One to three mutations; `text_bytes` adds flips of the serialised file's bytes."""
    kinds = [
        st.tuples(st.just("set"), WALK, VALUES),
        st.tuples(st.just("nudge"), WALK, st.sampled_from(NUDGES)),
        st.tuples(st.just("delete"), WALK),
        st.tuples(st.just("add"), WALK, st.text(max_size=8), VALUES),
        st.tuples(st.just("repeat"), WALK, st.integers(1, 1000)),
    ]
    if text_bytes:
        kinds.append(st.tuples(st.just("byte"), st.integers(0, 2**24), st.integers(1, 255)))
    return st.lists(st.one_of(*kinds), min_size=1, max_size=3)


def _locate(doc: Any, walk: list[int]) -> tuple[Any, Any]:
    """(parent, key) of the node `walk` reaches; (None, None) for the document itself."""
    parent, key, node = None, None, doc
    for step in walk:
        if isinstance(node, dict) and node:
            parent, key = node, list(node)[step % len(node)]
        elif isinstance(node, list) and node:
            parent, key = node, step % len(node)
        else:
            break
        node = parent[key]
    return parent, key


def _nudged(value: Any, how: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if how == "/2":
        return value // 2 if isinstance(value, int) else value / 2
    return {"+1": lambda v: v + 1, "-1": lambda v: v - 1, "*2": lambda v: v * 2, "*0": lambda v: v * 0,
            "neg": lambda v: -v, "*1000": lambda v: v * 1000}[how](value)


def mutate(doc: Any, ops) -> tuple[Any, bytes | None]:
    """(the mutated document, its bytes when a byte flip made them differ from json.dumps)."""
    doc = json.loads(json.dumps(doc))
    flips = []
    for kind, *args in ops:
        if kind == "byte":
            flips.append(args)
            continue
        parent, key = _locate(doc, args[0])
        node = doc if parent is None else parent[key]
        if kind == "set":
            node = copy.deepcopy(args[1])  # hypothesis may hand the same object to several mutations
        elif kind == "nudge":
            node = _nudged(node, args[1])
        elif kind == "delete":
            if parent is not None:
                del parent[key]
                continue
            node = None
        elif kind == "add":
            if isinstance(node, dict):
                node[args[1]] = copy.deepcopy(args[2])
            elif isinstance(node, list):
                node.append(copy.deepcopy(args[2]))
        elif kind == "repeat":
            # up to REPEAT_LIMIT items or characters: files past that are a size test, not a case
            if isinstance(node, list) and node:
                node.extend(copy.deepcopy(node[-1]) for _ in range(min(args[1], REPEAT_LIMIT - len(node))))
            elif isinstance(node, str) and node:
                node = node * max(1, min(args[1], REPEAT_LIMIT // len(node)))
        if parent is None:
            doc = node
        else:
            parent[key] = node
    if not flips:
        return doc, None
    data = bytearray(json.dumps(doc).encode())
    for at, mask in flips:
        if data:
            data[at % len(data)] ^= mask
    return doc, bytes(data)


def describe(ops) -> str:
    parts = []
    for kind, *args in ops:
        if kind == "byte":
            parts.append(f"byte @{args[0]} ^= {args[1]}")
        else:
            parts.append(f"{kind} {args[0]} {' '.join(repr(a)[:40] for a in args[1:])}".strip())
    return "; ".join(parts)


# --- targets -------------------------------------------------------------------------------------

@dataclass
class Seed:
    name: str
    doc: Any  # the JSON document the mutations apply to
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Target:
    name: str
    what: str  # a sentence for the report
    seeds: Callable[[Path], list[Seed]]
    run: Callable[[Seed, Any, bytes | None, Path], str]  # → "ok"; raises SharkportError to reject
    text_bytes: bool = True  # whether byte flips of the file apply


def _generate(generator) -> list[int]:
    return generator.generate([PROMPT], max_new_tokens=3, do_sample=False)[0].generations[0].token_ids


def _check_tokenizer(tokenizer, n_vocab: int) -> None:
    """Every id of every text is in the vocabulary and the ids decode to text, whole and streamed."""
    for text in TEXTS:
        ids = tokenizer.encode(text)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < n_vocab]
        if bad:
            raise WrongAnswer(f"{text!r} encodes to ids {bad[:5]} outside the vocabulary of {n_vocab}")
        if not isinstance(tokenizer.decode(ids), str):
            raise WrongAnswer(f"{text!r}: decode did not give text")
        stream = tokenizer.stream_decoder()
        for i in ids:
            stream.add(i)
        stream.flush()


# archive: the metadata of an .irpa; what `check`, `run --eager` and a tokenizer make of it.

def archive_seeds(folder: Path) -> list[Seed]:
    from gguf_seeds import write_seed
    from iree.turbine.aot import ParameterArchive
    from tiny_models import make_hf_recipe

    from sharkport.archive import import_gguf, import_hf
    from sharkport.archive.irpa import METADATA_KEY

    import_gguf(write_seed(folder / "llama.gguf"), folder / "llama.irpa", progress=False)
    for kind in ("qwen2", "gemma3-2l", "gpt2"):
        make_hf_recipe(kind).save_pretrained(folder / kind)
        import_hf(folder / kind, folder / f"{kind}.irpa", progress=False)
    seeds = []
    for name in ("llama", "qwen2", "gemma3-2l", "gpt2"):
        entries = dict(ParameterArchive(folder / f"{name}.irpa").items())
        metadata = json.loads(bytes(entries.pop(METADATA_KEY).raw.file_view))
        tensors = {k: e.as_tensor().clone() for k, e in entries.items() if not k.startswith("__")}
        seeds.append(Seed(name, metadata, {"tensors": tensors}))
    return seeds


def archive_run(seed: Seed, doc: Any, raw: bytes | None, folder: Path) -> str:
    """Writes the archive with turbine's own writer (any metadata bytes at all), then checks it,
    runs it and uses its tokenizer."""
    from iree.turbine.aot import ParameterArchiveBuilder

    from sharkport.api import TextGenerator
    from sharkport.archive.irpa import METADATA_KEY
    from sharkport.check import check_archive

    path = folder / "case.irpa"
    builder = ParameterArchiveBuilder()
    for key, tensor in seed.extra["tensors"].items():
        builder.add_tensor(key, tensor)
    builder.add_blob(METADATA_KEY, raw if raw is not None else json.dumps(doc).encode())
    builder.save(path)
    try:
        check_archive(path)
    except SharkportError:
        pass  # the runner must reject it too, which the next lines check
    generator = TextGenerator.eager(path, block_seq_stride=16, batch_size=1, max_seq_len=32)
    _generate(generator)
    if generator.tokenizer is not None:
        _check_tokenizer(generator.tokenizer, generator.session.config.vocab_size)
    return "ok"


# service-config: the JSON beside a compiled module, run with the module and its archive.

def service_config_seeds(folder: Path) -> list[Seed]:
    from gguf_seeds import write_seed

    from sharkport.api import TextGenerator, build_artifacts
    from sharkport.export.abi import ExportConfig

    export = ExportConfig(bs_prefill=(1, 2), bs_decode=(1, 2), block_seq_stride=16, device_block_count=8,
                          max_seq_len=64)
    vmfb, irpa, config = build_artifacts(write_seed(folder / "llama.gguf"), folder / "cache", export,
                                         log=lambda msg: None)
    expected = _generate(TextGenerator.from_files(vmfb, irpa, config))
    return [Seed("llama", json.loads(config.read_text()), {"vmfb": vmfb, "irpa": irpa, "expected": expected})]


def service_config_run(seed: Seed, doc: Any, raw: bytes | None, folder: Path) -> str:
    from sharkport.api import TextGenerator

    path = folder / "case.json"
    path.write_bytes(raw if raw is not None else json.dumps(doc).encode())
    tokens = _generate(TextGenerator.from_files(seed.extra["vmfb"], seed.extra["irpa"], path))
    if tokens != seed.extra["expected"]:
        raise WrongAnswer(f"generated {tokens}; the exported config generates {seed.extra['expected']}")
    return "ok"


# config-json: a checkpoint folder's config.json, imported and run; its sizes against transformers'.

CONFIG_KINDS = ("mistral", "qwen2", "gemma3-2l", "gpt2")


def config_json_seeds(folder: Path) -> list[Seed]:
    from tiny_models import make_hf_recipe

    seeds = []
    for kind in CONFIG_KINDS:
        make_hf_recipe(kind).save_pretrained(folder / kind)
        seeds.append(Seed(kind, json.loads((folder / kind / "config.json").read_text()), {"dir": folder / kind}))
    return seeds


# Our GGUF hyperparameter → the transformers config attribute that holds the same size.
_HF_SIZES = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
             "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
             "feed_forward_length": "intermediate_size", "vocab_size": "vocab_size"}


def config_json_run(seed: Seed, doc: Any, raw: bytes | None, folder: Path) -> str:
    from sharkport.api import TextGenerator
    from sharkport.archive import Dataset

    case = folder / "case"
    shutil.rmtree(case, ignore_errors=True)
    case.mkdir()
    for f in seed.extra["dir"].iterdir():
        if f.name != "config.json":
            (case / f.name).symlink_to(f)
    (case / "config.json").write_bytes(raw if raw is not None else json.dumps(doc).encode())
    generator = TextGenerator.eager(case, block_seq_stride=16, batch_size=1, max_seq_len=32)
    _generate(generator)
    _compare_with_transformers(case, Dataset.load(case))
    return "ok"


def _compare_with_transformers(case: Path, dataset) -> None:
    """Each size sharkport read equals what transformers reads from the same config.json (when
    transformers reads it at all; it accepts and refuses other things than we do)."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(case)
    except Exception:
        return
    ours = {k.split(".", 1)[1]: v for k, v in dataset.hparams.items() if "." in k}
    ours["vocab_size"] = dataset.metadata["tensors"]["token_embd.weight"]["shape"][0]
    for key, attr in _HF_SIZES.items():
        theirs = getattr(config, attr, None)
        if key in ours and theirs is not None and ours[key] != theirs:
            raise WrongAnswer(f"{key} is {ours[key]}; transformers reads {attr} = {theirs!r}")


# tokenizer: GGUF tokenizer metadata (byte-level BPE, SentencePiece) and a whole tokenizer.json.

def tokenizer_seeds(folder: Path) -> list[Seed]:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from test_tokenizer import _corpus

    tk = HfTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_corpus(400), trainers.BpeTrainer(
        vocab_size=400, show_progress=False, special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tk.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    bpe = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
           "tokenizer.ggml.token_type": [3 if t in ("<|endoftext|>", "<s>") else 1 for t in tokens],
           "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
           "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 0,
           "tokenizer.ggml.add_bos_token": False,
           "tokenizer.chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}{% endfor %}"}
    return [Seed("gguf-bpe", bpe), Seed("gguf-spm", _spm_metadata()),
            Seed("tokenizer.json", json.loads(tk.to_str()), {"config": {"eos_token": "<|endoftext|>"}})]


def _spm_metadata() -> dict[str, Any]:
    """GGUF metadata of a SentencePiece BPE model trained here (byte fallback, one user-defined and
    one control token), as llama.cpp's converter writes it."""
    import io

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    from test_tokenizer import _SP_TO_GGUF_TYPE, _corpus

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus(400)), model_writer=model, model_type="bpe", vocab_size=400,
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        user_defined_symbols=["<tool>"], control_symbols=["<|eot|>"], unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, minloglevel=2)
    proto = pb.ModelProto.FromString(model.getvalue())
    type_name = pb.ModelProto.SentencePiece.Type.Name
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [p.piece for p in proto.pieces],
            "tokenizer.ggml.scores": [p.score for p in proto.pieces],
            "tokenizer.ggml.token_type": [_SP_TO_GGUF_TYPE[type_name(p.type)] for p in proto.pieces],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False}


def tokenizer_run(seed: Seed, doc: Any, raw: bytes | None, folder: Path) -> str:
    from sharkport.tokenizer import Tokenizer, tokenizer_metadata_from_hf

    if seed.name == "tokenizer.json":
        text = (raw if raw is not None else json.dumps(doc).encode()).decode("utf-8", "replace")
        metadata = tokenizer_metadata_from_hf({"tokenizer.json": text, "tokenizer_config.json": seed.extra["config"]},
                                              "case")
    else:
        metadata = doc
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    _check_tokenizer(tokenizer, tokenizer.vocab_size)
    if tokenizer.chat_template is not None:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    return "ok"


TARGETS = {t.name: t for t in (
    Target("archive", "the metadata of an .irpa (hyperparameters, tensor layouts, tokenizer) of a llama "
           "with every block type, a qwen2, a two-layer gemma3 and a gpt2; each case is checked with "
           "`check_archive`, then built and run by the eager runner (3 tokens), and its tokenizer encodes "
           "and decodes six texts", archive_seeds, archive_run),
    Target("service-config", "the service config JSON beside a compiled one-layer llama (batch sizes 1 "
           "and 2); each case loads module, archive and config in the runner and generates 3 tokens, which "
           "must be the tokens of the exported config", service_config_seeds, service_config_run),
    Target("config-json", "the config.json of Mistral, Qwen2, two-layer Gemma-3 and GPT-2 checkpoints "
           "(transformers' own, random weights); each case is read, built and run by the eager runner "
           "(3 tokens), and every size it read must equal what transformers reads",
           config_json_seeds, config_json_run),
    Target("tokenizer", "GGUF tokenizer metadata of a byte-level BPE and a SentencePiece model (400 tokens "
           "each, trained here) and a whole tokenizer.json; each case builds the tokenizer, encodes and "
           "decodes six texts (whole and streamed; every id must be in the vocabulary) and renders the "
           "chat template", tokenizer_seeds, tokenizer_run),
)}


# --- the run ---------------------------------------------------------------------------------------

def fuzz(target: Target, cases: int, folder: Path, progress_file: Path | None = None) -> dict:
    (folder / "seeds").mkdir()
    seeds = target.seeds(folder / "seeds")
    by_name = {s.name: s for s in seeds}
    strategy = st.tuples(st.sampled_from([s.name for s in seeds]), json_mutations(target.text_bytes))
    outcomes: collections.Counter[str] = collections.Counter()
    messages: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    bugs: list[dict] = []
    slowest = 0.0
    t_start = time.perf_counter()
    work = folder / "case"
    work.mkdir()

    @settings(max_examples=cases, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(case):
        nonlocal slowest
        name, ops = case
        seed = by_name[name]
        if progress_file is not None:  # the case a crash happened in, for the parent to report
            progress_file.write_text(f"{name}: {describe(ops)}\n")
        t0 = time.perf_counter()
        try:
            doc, raw = mutate(seed.doc, ops)
            with time_limit(CASE_SECONDS):
                outcome = target.run(seed, doc, raw, work)
        except SharkportError as e:
            outcome = "rejected"
            kind = _message_kind(str(e))
            messages[kind] += 1
            examples.setdefault(kind, _without_path(str(e)))
        except CaseTimeout:
            outcome = "timeout"
            bugs.append({"seed": name, "mutations": describe(ops), "ops": ops, "error": "timeout"})
        except Exception as e:  # noqa: BLE001 - every other exception is what the fuzzing looks for
            outcome = "wrong-answer" if isinstance(e, WrongAnswer) else f"other-exception:{type(e).__name__}"
            bugs.append({"seed": name, "mutations": describe(ops), "ops": ops,
                         "error": traceback.format_exc(limit=6)})
        slowest = max(slowest, time.perf_counter() - t0)
        outcomes[outcome] += 1

    one()
    return {
        "target": target.name,
        "what": target.what,
        "cases": sum(outcomes.values()),
        "seconds": round(time.perf_counter() - t_start, 1),
        "slowest_case_s": round(slowest, 3),
        "case_time_limit_s": CASE_SECONDS,
        "memory_limit_bytes": MEMORY_LIMIT,
        "seeds": [s.name for s in seeds],
        "outcomes": dict(outcomes.most_common()),
        "messages": dict(messages.most_common(12)),
        "message_examples": {k: examples[k] for k, _ in messages.most_common(12)},
        "bugs": bugs[:20],
    }


def _without_path(message: str) -> str:
    """A message without the case file's name in front (it names a temporary folder)."""
    return message.split(": ", 1)[-1] if message.startswith(("/", "case")) else message


def _message_kind(message: str) -> str:
    """A SharkportError's message without the file name, numbers and quoted values: its kind."""
    import re

    text = re.sub(r"'[^']*(?:'|\.\.\.)|\"[^\"]*(?:\"|\.\.\.)|\[[^\]]*\]|\([^)]*\)|\b-?\d[\d.e+-]*\b", "…",
                  _without_path(message))
    return " ".join(text.split())[:90]


def replay(results: Path) -> None:
    """Runs the bugs of a --json result again, in this process, with their tracebacks."""
    for result in json.loads(results.read_text()):
        target = TARGETS[result["target"]]
        bugs = result["bugs"]
        if not bugs:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "seeds").mkdir()
            (Path(tmp) / "case").mkdir()
            seeds = {s.name: s for s in target.seeds(Path(tmp) / "seeds")}
            for bug in bugs:
                print(f"--- {target.name} {bug['seed']}: {bug['mutations']}")
                doc, raw = mutate(seeds[bug["seed"]].doc, bug["ops"])
                try:
                    print(target.run(seeds[bug["seed"]], doc, raw, Path(tmp) / "case"))
                except SharkportError as e:
                    print("rejected:", e)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    parser.add_argument("--cases", type=int, default=10000, help="cases per target")
    parser.add_argument("--json", type=Path, help="write the results (a list, one per target) here")
    parser.add_argument("--progress-file", type=Path, help="holds the case being run")
    parser.add_argument("--replay", type=Path, help="run the bugs of this --json result again, with tracebacks")
    args = parser.parse_args(argv)
    if args.replay:
        replay(args.replay)
        return 0
    faulthandler.enable()  # a crash prints where it happened
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    os.environ.setdefault("SHARKPORT_HUGE_PAGES", "0")
    import torch

    torch.set_num_threads(1)
    results = []
    for name in TARGETS if args.target == "all" else [args.target]:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(fuzz(TARGETS[name], args.cases, Path(tmp), args.progress_file))
        print(f"{name}: {results[-1]['cases']} cases in {results[-1]['seconds']} s, "
              f"{results[-1]['outcomes']}", file=sys.stderr)
    text = json.dumps(results, indent=2)
    args.json.write_text(text) if args.json else print(text)
    return 1 if any(r["bugs"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
