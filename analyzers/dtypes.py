"""Bytes per element of a tensor's dtype, by every name the inputs give it: Kineto's c10
scalar-type names ("float", "c10::BFloat16", "long int"), the process group's records'
("Float", "BFloat16"), torch's ("float32", "bfloat16") and nccl-tests' and rccl-tests'
("half", "bf16", "f8e4m3").

Neutral: the trace analysis and the nccl-tests parser read it; it imports nothing of diag.
"""

from __future__ import annotations

# Lower case, without the "c10::" of the scalar types.
_ELEMENT_BYTES = {
    "bool": 1, "byte": 1, "char": 1, "signed char": 1, "unsigned char": 1, "int8": 1, "uint8": 1,
    "short": 2, "int16": 2, "half": 2, "float16": 2, "bfloat16": 2, "bf16": 2,
    "int": 4, "int32": 4, "uint32": 4, "float": 4, "float32": 4,
    "long": 8, "long int": 8, "int64": 8, "uint64": 8, "double": 8, "float64": 8,
    "complex<float>": 8, "complex<double>": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "f8e4m3": 1, "f8e5m2": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


def element_bytes(name) -> int | None:
    """Bytes per element of the dtype `name` (any spelling above, any case), or None."""
    size = _ELEMENT_BYTES.get(name)  # most names come spelled as the table holds them
    if size is not None or not isinstance(name, str):
        return size
    return _ELEMENT_BYTES.get(name.lower().removeprefix("c10::"))
