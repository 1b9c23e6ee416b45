"""Does the compiled module compute what the recipe computes (and what transformers computes)?

Each prompt is continued greedily by the compiled module; then the whole sequence is run through
every backend with the same calls the runner makes (prefill over the prompt, one decode step per
generated token; transformers: one forward pass), and the logits that predict every position are
compared: max abs difference, top-1 agreement, and a verdict against a Tolerance.
`python -m sharkport.tools.verify` prints the comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SharkportError
from .runtime.inputs import decode_inputs, pick_batch_size, prefill_inputs

# --atol's default by the module's KV cache type: a float16 cache rounds K and V, which moves
# decode's logits (SmolLM2 Q4_1 without kernels, 2 prompts and 40 new tokens each: 0.020 against
# transformers, 0.014 against the eager recipe with its own float16 cache; float32: below 1e-4)
ATOL = {"float32": 1e-2, "float16": 5e-2}
# The defaults for a module with the kernels, in standard deviations of the reference's logits at
# each position: 8-bit activations make the arithmetic discontinuous, so summation order alone
# moves a real model's logits by a share of their spread and flips near ties (docs/verify.md).
SIGMAS, DECISIVE = 1.5, 0.25


@dataclass(frozen=True)
class Tolerance:
    """A verdict's bounds on each position's abs logits difference: `atol`, or `sigmas` times the
    standard deviation of the reference's logits there; and the share of positions with the same
    top-1 token, counted where the reference's top two are at least `decisive` sigma apart."""
    atol: float | None = None
    sigmas: float | None = None
    decisive: float = 0.0
    min_top1: float = 0.99

    @classmethod
    def default(cls, kernels: bool, kv_cache_dtype: str, atol: float | None = None, sigmas: float | None = None,
                min_top1: float = 0.99) -> "Tolerance":
        """The given bounds; else a module with the kernels is held to SIGMAS and DECISIVE, one
        without to ATOL by its KV cache type."""
        if atol is not None or sigmas is not None:
            return cls(atol, sigmas, DECISIVE if sigmas is not None else 0.0, min_top1)
        if kernels:
            return cls(sigmas=SIGMAS, decisive=DECISIVE, min_top1=min_top1)
        return cls(atol=ATOL.get(kv_cache_dtype, ATOL["float32"]), min_top1=min_top1)

    def __str__(self) -> str:
        bound = f"atol {self.atol:g}" if self.atol is not None else f"|diff| <= {self.sigmas:g} sigma"
        where = f" where the top two are >= {self.decisive:g} sigma apart" if self.decisive else ""
        return f"{bound}, top-1 agreement >= {self.min_top1:.0%}{where}"


@dataclass(frozen=True)
class Comparison:
    name: str
    positions: int
    max_abs_diff: float
    max_sigmas: float  # the largest abs difference in standard deviations of the reference's logits
    top1_agree: int
    decisive: int  # positions where the reference's top two are `Tolerance.decisive` sigma apart
    decisive_agree: int
    passed: bool

    def row(self) -> str:
        share = self.decisive_agree / max(self.decisive, 1)
        return (f"{self.name:<26} {self.positions:>9} {self.max_abs_diff:>10.3g} {self.max_sigmas:>8.3g} "
                f"{self.top1_agree:>6}/{self.positions:<6} {self.decisive_agree:>6}/{self.decisive:<6} ({share:6.1%})  "
                f"{'PASS' if self.passed else 'FAIL'}")


HEADER = (f"{'comparison':<26} {'positions':>9} {'max |diff|':>10} {'/ sigma':>8} {'top-1 same':>13} "
          f"{'where decisive':>22}  verdict")


def teacher_forced_logits(session, ids: list[int], prompt_len: int) -> np.ndarray:
    """Logits [len(ids) - 1, V] predicting positions 1.. of `ids`: a prefill over the first
    `prompt_len` ids, then a decode step for each later id but the last, at batch size 1 (or the
    smallest exported, padded with rows on a scratch page). For a module exported with
    --prefill-final-logits (whose prefill returns one position) the prompt is one id and the rest
    is decoded, so every position is still checked. The session's cache needs
    ceil(len(ids) / stride) + 1 pages."""
    c = session.config
    stride = c.block_seq_stride
    scratch, pages = 0, list(range(1, math.ceil(len(ids) / stride) + 1))
    if pages[-1] >= session.pages:
        raise SharkportError(f"{len(ids)} tokens need {len(pages) + 1} cache pages; the session has {session.pages}")
    bs = pick_batch_size(c.prefill_batch_sizes, 1, "prefill")
    prefill = session.prefill(*prefill_inputs([ids[:prompt_len]], [pages], bs, stride, scratch))
    if prefill.shape[1] == 1 and prompt_len > 1:  # final logits only: prefill one id instead
        return teacher_forced_logits(session, ids, 1)
    rows = [prefill[0, :prompt_len]]
    bs = pick_batch_size(c.decode_batch_sizes, 1, "decode")
    for pos in range(prompt_len, len(ids) - 1):
        rows.append(session.decode(*decode_inputs([ids[pos]], [pos], [pages], bs, stride, scratch))[0])
    return np.concatenate(rows).astype(np.float32)


def hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids], dtype=torch.int64)).logits[0, :-1].float().numpy()


def compare(name: str, got: list[np.ndarray], want: list[np.ndarray], tol: Tolerance) -> Comparison:
    """`got` against the reference `want`, [positions, V] logits per prompt."""
    got, want = np.concatenate(got), np.concatenate(want)
    diff = np.abs(got - want).max(-1)
    sigma = want.std(-1)
    sigmas = np.divide(diff, sigma, out=np.where(diff > 0, np.inf, 0.0), where=sigma > 0)
    top2 = np.sort(want, -1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] >= tol.decisive * sigma
    agree = got.argmax(-1) == want.argmax(-1)
    within = (diff <= tol.atol).all() if tol.atol is not None else (sigmas <= tol.sigmas).all()
    passed = bool(within and (agree & decisive).sum() >= tol.min_top1 * decisive.sum())
    return Comparison(name, len(diff), float(diff.max()), float(sigmas.max()), int(agree.sum()),
                      int(decisive.sum()), int((agree & decisive).sum()), passed)


def verify(compiled, eager, prompts: list[list[int]], max_new_tokens: int, hf_model=None,
           tol: Tolerance = Tolerance(atol=ATOL["float32"]), log=print) -> list[Comparison]:
    """Compares the sessions (and a transformers model) on each prompt plus its compiled greedy
    continuation. Returns one Comparison per pair of backends, the second of each the reference."""
    from .runtime.generate import GenerationRun
    from .runtime.sampling import GenerationConfig

    run = GenerationRun(compiled, prompts, GenerationConfig(max_new_tokens=max_new_tokens))
    sequences = [p + g[0].token_ids for p, g in zip(prompts, run.results())]
    logits: dict[str, list[np.ndarray]] = {"compiled": [], "eager": [], "transformers": []}
    for i, (prompt, ids) in enumerate(zip(prompts, sequences)):
        log(f"prompt {i}: {len(prompt)} tokens + {len(ids) - len(prompt)} generated by the compiled module")
        logits["compiled"].append(teacher_forced_logits(compiled, ids, len(prompt)))
        logits["eager"].append(teacher_forced_logits(eager, ids, len(prompt)))
        if hf_model is not None:
            logits["transformers"].append(hf_logits(hf_model, ids))
    pairs = [("compiled", "eager")]
    if hf_model is not None:
        pairs += [("compiled", "transformers"), ("eager", "transformers")]
    return [compare(f"{a} vs {b}", logits[a], logits[b], tol) for a, b in pairs]


def load_transformers(gguf_file: Path | None = None, model_dir: Path | None = None):
    """A float32 transformers model of a GGUF file or a Hugging Face checkpoint folder."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise SharkportError("--gguf-file/--model-dir need transformers: pip install transformers") from None
    if gguf_file:
        if not gguf_file.is_file():
            raise SharkportError(f"{gguf_file}: no such file")
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                     dtype=torch.float32)
    else:
        if not (model_dir / "config.json").is_file():
            raise SharkportError(f"{model_dir}: no config.json; give a save_pretrained directory")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def quantize_linear_inputs(model, per_256: Sequence[str] = (), linear: type | None = None) -> list:
    """Makes every linear layer of a model (nn.Linear, as transformers' are, or the `linear`
    type) multiply its input as the kernels multiply x by quantized weights: quantized to Q8_0 per
    block of 32 and dequantized, by gguf.quants; the modules named in `per_256` (their weights are
    K-quants) per 256 values as llama.cpp's Q8_K (kernels.quantized_x). Returns the hooks."""
    import torch
    from gguf import GGMLQuantizationType, quants

    from .kernels import X_PER_256, quantized_x

    def q8_0(module, args):
        x = args[0]
        rows = x.detach().float().reshape(-1, x.shape[-1]).numpy()
        seen = quants.dequantize(quants.quantize(rows, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        return (torch.from_numpy(seen).reshape(x.shape).to(x.dtype), *args[1:])

    def q8_k(module, args):
        return (quantized_x(args[0].detach().float(), X_PER_256[0]).to(args[0].dtype), *args[1:])

    return [m.register_forward_pre_hook(q8_k if name in per_256 else q8_0) for name, m in model.named_modules()
            if isinstance(m, linear or torch.nn.Linear)]


def linear_inputs_per_256(dataset) -> list[str] | None:
    """transformers' names of the linear layers whose inputs the kernels quantize per 256 values
    (their weights are K-quants: quantize_linear_inputs' `per_256`), where the kernels multiply x
    quantized to 8 bits by every matrix of the archive (each has a quantized type a kernel reads);
    None where some matrix is not so multiplied, or a K-quant one has no transformers name."""
    from .formats.names import gguf_to_hf_name
    from .kernels import FLOAT_KINDS, X_PER_256, kernel_type

    tied = "output.weight" not in dataset.theta
    matrices = {name: w for name, w in dataset.theta.items() if len(w.shape) == 2
                and not (name == "token_embd.weight" and not tied)}
    if any(kernel_type(w) in (None, *FLOAT_KINDS) for w in matrices.values()):
        return None
    names = []
    for name, w in matrices.items():
        if kernel_type(w) not in X_PER_256:
            continue
        if name == "token_embd.weight":  # tied: the output projection multiplies by it
            names.append("lm_head")
            continue
        try:
            names.append(gguf_to_hf_name(name, dataset.architecture).removesuffix(".weight"))
        except SharkportError:
            return None
    return names


def verify_files(vmfb: Path, irpa: Path, config_path: Path, prompts: Sequence[str] = (),
                 token_ids: Sequence[str] = (), max_new_tokens: int = 8, gguf_file: Path | None = None,
                 model_dir: Path | None = None, atol: float | None = None, sigmas: float | None = None,
                 min_top1: float = 0.99, device: str | None = None, log=print,
                 hf_model=None) -> tuple[list[Comparison], Tolerance]:
    """`verify` on a compiled module and the eager recipe of the archive it was exported from
    (and transformers reading `gguf_file` or `model_dir`, or `hf_model`, a transformers model
    already loaded: the hooks this adds to it are removed before returning). `token_ids` are prompts as
    comma-separated ids, `prompts` texts for the archive's tokenizer. Returns the comparisons
    and the Tolerance they were held to (Tolerance.default for the module and the bounds given).

    A module exported with the x86-64 kernels multiplies x quantized to 8 bits by quantized
    weights; the eager recipe then runs with the kernel layers, computing as they do, and
    transformers' linear layers take their inputs so quantized (quantize_linear_inputs) where the
    kernels read every matrix of the archive."""
    import torch

    from .api import encode_prompt
    from .archive import Dataset
    from .export.abi import ServiceConfig
    from .export.kernels import use_kernels
    from .kernels import referenced_by
    from .models import ModelConfig, build_model
    from .runtime.eager import EagerSession
    from .runtime.session import IreeSession

    if not config_path.is_file():
        raise SharkportError(f"{config_path}: no such file; pass the JSON written by --output-config")
    config = ServiceConfig.load(config_path)
    dataset = Dataset.load(irpa)
    ids = []
    for text in token_ids:
        try:
            ids.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise SharkportError(f"--token-ids takes comma-separated integers, got {text!r}") from None
    if prompts:
        tokenizer = dataset.tokenizer()
        ids += [encode_prompt(tokenizer, p) for p in prompts]
    longest = max(len(p) for p in ids) + max_new_tokens
    pages = max(math.ceil(longest / config.block_seq_stride) + 1, 2)
    compiled = IreeSession(vmfb, irpa, config, pages=pages, device=device)
    model = build_model(dataset, ModelConfig(block_seq_stride=config.block_seq_stride,
                                             kv_cache_dtype=getattr(torch, config.kv_cache_dtype)))
    if gguf_file or model_dir:
        hf_model = load_transformers(gguf_file, model_dir)
    kernels = bool(referenced_by(vmfb))
    tol = Tolerance.default(kernels, config.kv_cache_dtype, atol, sigmas, min_top1)
    hooks = []
    if kernels:
        model = use_kernels(model)
        note = f"{vmfb}: exported with the x86-64 kernels (x quantized to 8 bits for quantized weights); the eager " \
               "recipe computes as they do"
        per_256 = linear_inputs_per_256(dataset)
        if hf_model is not None and per_256 is not None:
            hooks = quantize_linear_inputs(hf_model, per_256)
            note += ", and so do transformers' linear layers"
        elif hf_model is not None:
            note += "; transformers multiplies in float32 (so its logits differ by the 8-bit activations)"
        log(note)
    eager = EagerSession(model, config, pages=pages)
    try:
        return verify(compiled, eager, ids, max_new_tokens, hf_model, tol, log), tol
    finally:
        for hook in hooks:
            hook.remove()
