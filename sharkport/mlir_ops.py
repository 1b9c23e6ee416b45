"""Turbine custom ops whose bodies sharkport writes as MLIR text (sharkport.kernels.ops,
sharkport.quant.dequant_op)."""

from __future__ import annotations

from typing import Callable

from iree.turbine.runtime.op_reg import KernelBuilder, impl_helper


class _Text(impl_helper.TemplateLoader):
    """A template given as a function returning MLIR text, called only when the function it
    defines is not in the program yet."""

    def __init__(self, text: Callable[[], str]):
        self.text = text

    def load_template(self, kb: KernelBuilder, name: str, **kwargs):
        # Parsed on one thread: MLIR verifies nested ops (a kernel's stream.executable) on worker
        # threads, which deadlock on the GIL that this Python-called parse holds.
        kb.context.enable_multithreading(False)
        try:
            return self._parse_module_asm(kb, self.text())
        finally:
            kb.context.enable_multithreading(True)


def call_mlir_function(kb: KernelBuilder, name: str, text: Callable[[], str]) -> None:
    """Yields the op's results as a call of util.func `name` on its tensor arguments (attributes
    are the text's to use), merging the module `text()` (which defines `name`) into the program
    the first time."""
    func = _Text(text).inline_template_function(kb, "", name)
    kb.yield_results(*impl_helper.call_function(func, *(b for b in kb.arg_bindings if b is not None)))
