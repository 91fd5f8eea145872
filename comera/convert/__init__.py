"""Conversion of existing models: :func:`convert` swaps ``nn.Linear`` and
``nn.Embedding`` for TT layers in place, :func:`to_dense` swaps them back,
and :mod:`.ties` keeps weight ties intact.  Built on :mod:`comera.layers`;
model families add their fix-ups with :func:`register_model_hooks`."""
from comera.convert.replace import convert, converted_layers, register_model_hooks, to_dense

__all__ = ["convert", "to_dense", "converted_layers", "register_model_hooks"]
