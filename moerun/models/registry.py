"""Architecture registry: `general.architecture` value -> ArchSpec."""

from __future__ import annotations

from moerun.errors import UnsupportedArchitecture
from moerun.models import gemma3, llama, olmoe, qwen3, qwen3moe
from moerun.models.spec import ArchSpec

ARCHS: dict[str, ArchSpec] = {m.SPEC.name: m.SPEC for m in (llama, qwen3, qwen3moe, olmoe, gemma3)}


def arch_spec(name: str, *, file: str = "?") -> ArchSpec:
    """The ArchSpec for `name`; UnsupportedArchitecture (naming the file) for any other."""
    try:
        return ARCHS[name]
    except KeyError:
        raise UnsupportedArchitecture(
            f"{file}: architecture '{name}' (general.architecture) is not supported; "
            f"supported: {', '.join(sorted(ARCHS))}"
        ) from None
