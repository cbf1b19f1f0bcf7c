"""The check package keeps one place where rules are registered: every ``rule_*`` function of its
rule-family modules (``onnx_qat/check/rules_*.py``) is in :data:`onnx_qat.check.RULES` (or is the
``ort-cpu`` replacement in :data:`onnx_qat.check.ORT_CPU_RULES`), and nothing else runs."""
import importlib
import inspect
import pkgutil

from onnx_qat.check import ORT_CPU_RULES, RULES


def _rule_modules():
    package = importlib.import_module("onnx_qat.check")
    names = [m.name for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("rules_")]
    return [importlib.import_module(f"onnx_qat.check.{name}") for name in names]


def test_every_rule_function_is_registered_once_in_the_rule_table():
    modules = _rule_modules()
    assert len(modules) >= 4
    defined = {fn for module in modules for name, fn in vars(module).items()
               if name.startswith("rule_") and inspect.isfunction(fn) and fn.__module__ == module.__name__}
    registered = [fn for _, _, _, fn in RULES if fn.__module__.startswith("onnx_qat.check.")]
    replacements = [fn for fn, _ in ORT_CPU_RULES.values() if fn is not None]
    assert len(registered) == len(set(registered))
    assert defined == set(registered) | set(replacements)


def test_rule_modules_do_not_import_each_other():
    """A family reads the shared index and report, never another family's rules."""
    for module in _rule_modules():
        others = {m.__name__ for m in _rule_modules()} - {module.__name__}
        source = inspect.getsource(module)
        assert [o for o in others if f"from .{o.rsplit('.', 1)[1]} import" in source] == []
