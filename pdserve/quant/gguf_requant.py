"""A GGUF file with its decoder projections re-encoded in another GGUF block type (Q8_0, Q4_0, ...).

What llama.cpp's `llama-quantize --allow-requantize` does, written with the `gguf` package's own
codecs (`gguf.quants.dequantize` / `quantize`, the reference implementations of llama.cpp's formats),
so that a format the registry's file does not ship in (SmolLM2's is Q4_1) can be measured as a user
would get it: a GGUF whose packed codes pdserve serves as they are (`pdserve.quant.gguf_packed`).

Only the projections change (attention q/k/v/output, MLP gate/up/down); the embedding, the norms and
every metadata key are copied byte for byte. Re-encoding goes through fp32: codes of the new type
are exactly what `gguf.quants.quantize` makes of the source's dequantized values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# The llama block's projection tensors, as GGUF names them (blk.N.<suffix>.weight).
PROJECTION_SUFFIXES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class RequantError(ValueError):
    """The source cannot be re-encoded as asked (one line, for the command line)."""


def is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in PROJECTION_SUFFIXES and parts[3] == "weight"


def quant_type(name: str):
    """GGMLQuantizationType of a name such as "Q8_0" (case-insensitive)."""
    import gguf

    try:
        return gguf.GGMLQuantizationType[name.upper()]
    except KeyError:
        known = ", ".join(t.name for t in gguf.GGMLQuantizationType)
        raise RequantError(f"unknown GGUF type {name!r} (known: {known})") from None


def requantize_gguf(src: str | Path, dst: str | Path, type_name: str) -> Path:
    """Writes `dst`: `src` with every projection re-encoded as `type_name`; returns dst."""
    import gguf

    qtype = quant_type(type_name)
    reader = gguf.GGUFReader(src)
    if not any(is_projection(t.name) for t in reader.tensors):
        raise RequantError(f"{src}: no llama-block projection tensors (blk.N.attn_q.weight, ...) to re-encode")
    tensors = [(t.name, _encoded(t, qtype) if is_projection(t.name) else (t.data, t.tensor_type))
               for t in reader.tensors]
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents(), endianess=reader.endianess)
    _copy_metadata(reader, writer)
    for name, (data, ttype) in tensors:
        # byte-shaped codes: the writer derives the values' shape from the type (quant_shape_from_byte_shape)
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, (data, _) in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(dst)


def _copy_metadata(reader, writer) -> None:
    import gguf

    for field in reader.fields.values():
        # GGUF.* are the header's own fields; the writer adds general.architecture itself.
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)


def _encoded(tensor, qtype) -> tuple[np.ndarray, object]:
    """(codes of `qtype`, qtype) of one projection, through its fp32 values [rows, cols]."""
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # [rows, cols]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if values.shape[-1] % block:
        raise RequantError(f"{tensor.name}: rows of {values.shape[-1]} values do not split into {qtype.name} "
                           f"blocks of {block}")
    return gguf.quants.quantize(values, qtype), qtype

