"""Export a recipe's prefill/decode as `prefill_bs{N}` / `decode_bs{N}` with external parameters.

The exporter (exporter.py) needs torch and iree-turbine; it loads on first use, so that
`python -m sharkport.export --help` and flag errors answer at once.
"""

from .abi import ExportConfig, ServiceConfig

_EXPORTER_NAMES = {"export_model", "externalize", "save_export", "service_config", "PARAMETER_SCOPE"}

__all__ = ["ExportConfig", "ServiceConfig", *sorted(_EXPORTER_NAMES)]


def __getattr__(name: str):
    if name in _EXPORTER_NAMES:
        from . import exporter

        return getattr(exporter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
