"""The adapters deployment targets name: a target's ``adapter`` field -> the object that adapts the
placement and scales to that target's form (see `onnx_qat.insertion.targets`). "Adapter" is the code
object; "form" is the deployment form it produces (the ``ort-cpu`` form), "format" the numeric format
(``int8``/``fp8``/``int4``, chosen by the ``precision`` option).

Targets are data and import nothing of the stages that read them; this module sits above both,
so that `onnx_qat.insertion.ort_cpu` (which uses the inserter's numerics) never meets an import of
itself coming back from `onnx_qat.insertion.targets`.
"""
from __future__ import annotations

from types import MappingProxyType

from .targets import get_target


def _ort_cpu_adapter():
    from .ort_cpu import OrtCpuAdapter

    return OrtCpuAdapter()


#: Adapter factories by the name a `Target` gives in its ``adapter`` field.
ADAPTERS = MappingProxyType({"ort-cpu": _ort_cpu_adapter})


def make_adapter(target):
    """The placement/scale adjustments of ``target`` (a Target or its name), or None when it uses
    the placement as it is."""
    name = get_target(target).adapter
    return None if name is None else ADAPTERS[name]()
