"""The forms deployment targets name: a target's ``form`` field -> the object that adapts placement
and scales to it (see :mod:`onnx_qat.insertion.targets`).

Targets are data and import nothing of the stages that read them; this module sits above both,
so that :mod:`onnx_qat.insertion.ort_cpu` (which uses the inserter's numerics) never meets an import of
itself coming back from :mod:`onnx_qat.insertion.targets`.
"""
from __future__ import annotations

from types import MappingProxyType

from .targets import get_target


def _ort_cpu_form():
    from .ort_cpu import OrtCpuForm

    return OrtCpuForm()


#: Form factories by the name a :class:`~onnx_qat.insertion.targets.Target` gives in its ``form`` field.
FORMS = MappingProxyType({"ort-cpu": _ort_cpu_form})


def make_form(target):
    """The placement/scale adjustments of ``target`` (a Target or its name), or None when it uses
    the placement as it is."""
    name = get_target(target).form
    return None if name is None else FORMS[name]()
