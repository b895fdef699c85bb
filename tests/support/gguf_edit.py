"""Copy a GGUF file with edits (drop or replace tensors, set or drop keys): makes bad-input files
from good ones through gguf-py's own reader and writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}


def rewrite(src: str | Path, dst: str | Path, *, arch: str | None = None, drop_tensors: tuple[str, ...] = (),
            drop_keys: tuple[str, ...] = (), set_keys: dict[str, tuple[Any, GGUFValueType]] | None = None,
            replace_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None) -> Path:
    """Write `dst` = `src` with the given edits. replace_tensors values: (raw array, type) where a
    quantized array is the uint8 [rows, row_bytes] block data, as `gguf.quants.quantize` returns."""
    r = GGUFReader(src)
    src_arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch or src_arch)
    for key, field in r.fields.items():
        if key in SKIP or key in drop_keys or key.startswith("GGUF."):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), main, sub_type=sub)
    for key, (value, vtype) in (set_keys or {}).items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        data, qtype = (replace_tensors or {}).get(t.name, (t.data, t.tensor_type))
        w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
