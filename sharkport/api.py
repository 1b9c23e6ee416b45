"""The Python API: `TextGenerator` over a compiled module or the eager recipe, same interface.

    from sharkport import TextGenerator
    gen = TextGenerator.from_gguf("model.gguf")            # import + export + compile once, cached
    gen = TextGenerator.from_files("x.vmfb", "x.irpa", "x.json")
    gen = TextGenerator.eager("model.gguf")                # the PyTorch recipe, no compile
    out = gen.generate("The capital of France is", max_new_tokens=16)
    out.text, out.generations[0].token_ids, out.generations[0].finish_reason
    for event in gen.generate(["a", "b"], stream=True, do_sample=True, seed=0): ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from .errors import SharkportError
from .runtime.generate import GenerateStats, Generation, GenerationRun, TokenEvent
from .runtime.sampling import GenerationConfig

__all__ = ["TextGenerator", "GenerationConfig", "Generation", "PromptOutput", "TokenEvent"]

Prompt = str | list[int] | list[dict[str, Any]]  # text, token ids, or chat messages


@dataclass
class PromptOutput:
    """The generations of one prompt (`num_return_sequences` of them)."""

    prompt: Prompt
    prompt_ids: list[int]
    generations: list[Generation]

    @property
    def text(self) -> str | None:
        """The text of the first generation."""
        return self.generations[0].text


class TextGenerator:
    """Generates text with a Session (compiled module or eager recipe) and a tokenizer.

    Without a tokenizer (an archive without tokenizer metadata) prompts must be token ids and
    generations have `text=None`.

    Thread-safe: calls from several threads share the session's cache pages and take turns on
    the module; a call short of pages waits for other calls' pages (up to
    runtime.generate.PAGE_WAIT_S seconds). `stats` is that of the last call to finish."""

    def __init__(self, session, tokenizer=None):
        self.session, self.tokenizer = session, tokenizer
        self.stats = GenerateStats()  # of the last generate() call

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_files(cls, vmfb: str | os.PathLike, irpa: str | os.PathLike, config: str | os.PathLike,
                   pages: int | None = None, device: str | None = None) -> "TextGenerator":
        """A compiled module, its parameter archive and the service config JSON beside it
        (loading neither torch nor IREE's compiler)."""
        from .archive import ArchiveInfo
        from .runtime.session import IreeSession

        tokenizer = _tokenizer_or_none(ArchiveInfo.load(irpa))  # checks the archive first
        return cls(IreeSession(vmfb, irpa, config, pages=pages, device=device), tokenizer)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  export=None, target: str = "llvm-cpu", pages: int | None = None,
                  device: str | None = None, log=None) -> "TextGenerator":
        """A GGUF (or .irpa) imported, exported and compiled on first use; the artifacts are kept
        in `cache_dir` (default $SHARKPORT_CACHE or ~/.cache/sharkport) under a key of the file's
        path, size and mtime and the export settings, and reused by later calls.
        `export` is an ExportConfig (default: batch sizes 1 and 4, max_seq_len 2048; its
        dequant_in_products follows the target); `target` is export's --target (`llvm-cpu`,
        `cuda:sm_90`, `rocm:gfx942`, ...: docs/devices.md), and `device` defaults to the first
        device of the module's kind."""
        vmfb, irpa, config = build_artifacts(path, cache_dir, export, target, log)
        return cls.from_files(vmfb, irpa, config, pages=pages, device=device)

    @classmethod
    def eager(cls, path: str | os.PathLike, block_seq_stride: int = 32, batch_size: int = 4,
              max_seq_len: int | None = None, pages: int | None = None,
              matvec_kernels: bool = False) -> "TextGenerator":
        """The PyTorch recipe run directly over a GGUF or .irpa (the reference for compiled
        modules). max_seq_len defaults to the model's context length capped at 1024; pages to
        enough for `batch_size` sequences of max_seq_len. `matvec_kernels`: with the export's
        kernel layers, computing in torch what the kernels compute (x quantized to 8 bits for
        quantized weights): the reference for a module exported with them."""
        from .archive import Dataset
        from .export import ExportConfig, service_config
        from .models import ModelConfig, build_model
        from .runtime.eager import EagerSession

        dataset = Dataset.load(path)
        model = build_model(dataset, ModelConfig(block_seq_stride=block_seq_stride))
        if matvec_kernels:
            from .export.kernels import use_kernels

            model = use_kernels(model)
        if max_seq_len is None:
            max_seq_len = max(min(model.context_length, 1024) // block_seq_stride, 1) * block_seq_stride
        if pages is None:
            pages = batch_size * (max_seq_len // block_seq_stride) + 1  # + the scratch page
        config = ExportConfig(bs_prefill=(batch_size,), bs_decode=(batch_size,),
                              block_seq_stride=block_seq_stride, device_block_count=pages,
                              max_seq_len=max_seq_len)
        return cls(EagerSession(model, service_config(model, config)), _tokenizer_or_none(dataset))

    # -- generation ---------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt (see encode_prompt)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate(self, prompts: Prompt | Sequence[Prompt] | None = None,
                 config: GenerationConfig | Mapping[str, Any] | Any | None = None, *, stream: bool = False,
                 chat: bool = False, continuous_batching: bool = True, prompt: Prompt | None = None,
                 sequences: Prompt | Sequence[Prompt] | None = None, generation_config: Any = None,
                 streaming: bool | None = None,
                 **options: Any) -> PromptOutput | list[PromptOutput] | Iterator[TokenEvent]:
        """Continues each prompt. `config` (a GenerationConfig, a dict or a
        `transformers.GenerationConfig`) and keyword options (max_new_tokens, max_length,
        min_new_tokens, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, seed,
        num_return_sequences, stop or stop_strings, stop_token_ids or eos_token_id, output_scores)
        set how; greedy by default. The tokenizer's EOS always stops a generation.
        DeepSparse's names work too: `prompt=` or `sequences=` for the prompts,
        `generation_config=` for `config`, `streaming=` for `stream`.

        Returns a PromptOutput for a single prompt, a list for a list of prompts, or with
        `stream=True` an iterator of TokenEvents as tokens are chosen. `self.stats` holds the
        timings of the run once it has finished."""
        prompts = _one_of("prompts", prompts, prompt=prompt, sequences=sequences)
        config = _one_of("config", config, generation_config=generation_config)
        stream = stream or bool(streaming)
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                              and not isinstance(prompts[0], (str, list)))
        given = [prompts] if single else list(prompts)
        ids = [self.encode(p, chat) for p in given]
        config = GenerationConfig.make(config, **options)
        eos = self.tokenizer.eos_id if self.tokenizer is not None else None
        if eos is not None and eos not in config.stop_token_ids:
            config = dataclasses.replace(config, stop_token_ids=config.stop_token_ids + (eos,))
        self.stats = GenerateStats()
        run = GenerationRun(self.session, ids, config, tokenizer=self.tokenizer,
                            continuous=continuous_batching, stats=self.stats)
        if stream:
            return iter(run)
        outputs = [PromptOutput(p, i, g) for p, i, g in zip(given, ids, run.results())]
        return outputs[0] if single else outputs


def _one_of(name: str, value: Any, **aliases: Any) -> Any:
    """The argument given under `name` or under one of its other names; giving two is an error."""
    given = {k: v for k, v in {name: value, **aliases}.items() if v is not None}
    if len(given) > 1:
        raise SharkportError(f"{' and '.join(given)} name the same argument; give one")
    if not given and name == "prompts":
        raise SharkportError("no prompt given: pass prompts (or prompt= / sequences=)")
    return next(iter(given.values()), None)


def encode_prompt(tokenizer, prompt: Prompt, chat: bool = False) -> list[int]:
    """Token ids of a prompt: ids pass through; text is encoded (with the tokenizer's chat
    template first when `chat`, or when the prompt is a list of messages)."""
    if isinstance(prompt, list) and not prompt:
        raise SharkportError("a prompt is empty: give text, token ids or chat messages")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if tokenizer is None:
        raise SharkportError("this model has no tokenizer in its archive: give prompts as token ids")
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8, as Python decodes them from argv
            raise SharkportError(f"prompt {prompt!r} is not valid UTF-8 text") from None
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS if any
    if not isinstance(prompt, str):
        raise SharkportError(f"a prompt is text, token ids or chat messages, got {type(prompt).__name__}")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise SharkportError(f"prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
    return ids


def _tokenizer_or_none(dataset):
    """The archive's tokenizer, None if it carries none; broken tokenizer metadata is an error."""
    return dataset.tokenizer() if dataset.has_tokenizer else None


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("SHARKPORT_CACHE") or Path.home() / ".cache" / "sharkport")


def build_artifacts(path: str | os.PathLike, cache_dir=None, export=None, target: str = "llvm-cpu",
                    log=None) -> tuple[Path, Path, Path]:
    """(vmfb, irpa, config json) for a GGUF or .irpa, made once and cached (see from_gguf)."""
    from .compile import resolve_target
    from .export.abi import ExportConfig

    source = Path(path)
    if not source.is_file():
        raise SharkportError(f"{source}: no such file; give a .gguf or .irpa model file")
    export = dataclasses.replace(export or ExportConfig(bs_prefill=(1, 4), bs_decode=(1, 4), max_seq_len=2048),
                                 dequant_in_products=resolve_target(target).as_stored)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    st = source.stat()
    key = json.dumps({"path": str(source.resolve()), "size": st.st_size, "mtime": st.st_mtime_ns,
                      "export": dataclasses.asdict(export), "target": target}, sort_keys=True)
    folder = _cache_root(cache_dir) / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    irpa = source if source.suffix == ".irpa" else folder / "model.irpa"
    mlir, config, vmfb = folder / "model.mlir", folder / "model.json", folder / "model.vmfb"
    if not irpa.exists():
        from .archive import import_gguf

        log(f"importing {source} → {irpa}")
        import_gguf(source, irpa)
    if not (config.exists() and vmfb.exists()):
        from .archive import Dataset
        from .compile import compile_mlir
        from .export import export_model, save_export

        log(f"exporting {irpa.name} (prefill {list(export.bs_prefill)}, decode {list(export.bs_decode)})")
        output, service = export_model(Dataset.load(irpa), export)
        save_export(output, service, mlir, config)
        log(f"compiling for {target} → {vmfb}")
        compile_mlir(mlir, vmfb, target)
        mlir.unlink()  # large, and not needed to run
    else:
        log(f"reusing {folder}")
    return vmfb, irpa, config
