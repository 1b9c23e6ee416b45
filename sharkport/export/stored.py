"""Export for targets that keep the weights as stored (ExportConfig.dequant_in_products:
llvm-cpu-lean and the GPU presets): `use_stored_products(model)` swaps the model's products for
modules that multiply one row by a Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 matrix in one traced op
dequantizing the weights inside the product (quant.product_op), and compute as the plain module
elsewhere."""

from __future__ import annotations

import torch

from ..layers import Linear
from ..ops import cast, linear
from ..quant import product_op


def use_stored_products(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every Linear (not its subclasses: an expert's weight is a slice) swapped in
    place for a StoredLinear; returns the module, or its replacement."""
    for name, child in list(module.named_children()):
        setattr(module, name, use_stored_products(child))
    return StoredLinear(module) if type(module) is Linear else module


class StoredLinear(torch.nn.Module):
    """x @ w.T (+ bias), one row by a matrix product_op takes in one op."""

    def __init__(self, plain: Linear):
        super().__init__()
        self.weight, self.bias = plain.weight, plain.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not product_op.applies(rows, self.weight):
            return linear(x, self.weight, self.bias)
        y = product_op.product(rows, self.weight).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + cast(self.bias, y.dtype)
