"""The one exception family moerun raises for problems a user can act on.

Every error names the file and, where it applies, the tensor or metadata key at fault.
"""

from __future__ import annotations


class MoerunError(Exception):
    """Base class of every error moerun raises on bad input or misuse."""


class GGUFFormatError(MoerunError):
    """The file is not a readable GGUF file (truncated, wrong magic, absurd header values)."""


class UnsupportedQuantType(MoerunError):
    """A tensor uses a GGML quantization type moerun cannot dequantize."""


class UnsupportedArchitecture(MoerunError):
    """`general.architecture` names an architecture moerun does not implement."""


class MissingTensor(MoerunError):
    """A tensor the architecture needs is absent from the file."""


class MissingKey(MoerunError):
    """A metadata key the architecture needs is absent or has the wrong type."""


class ShapeMismatch(MoerunError):
    """A tensor's shape disagrees with what the metadata implies."""


class ContextOverflow(MoerunError):
    """A forward pass would write past the end of the KV cache (the context size)."""
