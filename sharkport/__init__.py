"""sharkport: port LLMs from GGUF and Hugging Face checkpoints to IREE.

`import sharkport` stays cheap: the Python API (TextGenerator, GenerationConfig) loads torch and
IREE only when first used."""

_API_NAMES = {"TextGenerator", "GenerationConfig", "Generation", "PromptOutput", "TokenEvent"}

__all__ = sorted(_API_NAMES)


def __getattr__(name: str):
    if name in _API_NAMES:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
