"""NonFiniteGuard: one clear line when quantization-aware training diverges.

A QAT model's ``fit`` adds a [`NonFiniteGuard`][tf_bridge.guard.NonFiniteGuard] to its callbacks by default.
The model [`tf_bridge.quantize_model`][] returns is a [`QATFunctional`][tf_bridge.guard.QATFunctional] or a
[`QATSequential`][tf_bridge.guard.QATSequential]: the Keras classes with ``fit`` extended by that one step,
registered serializable, so a saved and reloaded QAT model keeps the guard. Overriding ``fit`` is the
Keras 3 hook that stays on whatever training loop ``fit`` runs (``train_step``,
distribution, ``jit_compile``); a callback list Keras builds itself cannot be extended.

The guard:

* after every training batch, reads the loss Keras reports (no extra computation). When it is
  NaN or Inf, it looks for the weights that are not finite and raises
  `onnx_qat.errors.TrainingError` with one line naming the first layer (in model order)
  and its variables; training stops.
* at the end of every epoch, checks every weight once (a diverged weight whose loss is still
  finite is caught there), and logs one warning line naming the activation quantizers whose
  calibrated range was degenerate and re-seeded from a training batch (see
  `tf_bridge.quantizers`).

Turning it off: pass ``NonFiniteGuard(enabled=False)`` among ``fit``'s callbacks (a guard
given by the caller replaces the default one); a ``keras.callbacks.CallbackList`` passed as
``callbacks`` is used as given.
"""
from __future__ import annotations

import logging
import math

import keras
from keras.src.models.functional import Functional

from onnx_qat.errors import TrainingError

from .finite import describe_nonfinite, nonfinite_weights

logger = logging.getLogger(__name__)

_SHOWN = 5


def _reseeded_quantizers(model):
    from .describe import iter_quantizer_layers
    from .quantizers import RESEEDED, ActivationQuantizer

    return [path for path, q in iter_quantizer_layers(model)
            if isinstance(q, ActivationQuantizer) and q.built and float(q.initialized.numpy()) == RESEEDED]


class NonFiniteGuard(keras.callbacks.Callback):
    """Stop ``fit`` with one `onnx_qat.errors.TrainingError` line naming the layer whose
    weights became NaN or Inf; report re-seeded activation ranges once per quantizer.

    Args:
        enabled: False makes the guard do nothing (pass it to ``fit`` to switch the default
            guard of a QAT model off).
    """

    def __init__(self, enabled: bool = True):
        super().__init__()
        self.enabled = bool(enabled)
        self._epoch = 0
        self._reported = set()

    def on_epoch_begin(self, epoch, logs=None):
        """Remember the epoch for the message."""
        self._epoch = int(epoch)

    def on_train_batch_end(self, batch, logs=None):
        """Raise TrainingError when the reported loss is NaN or Inf."""
        if not self.enabled or not logs or "loss" not in logs:
            return
        loss = float(logs["loss"])
        if not math.isfinite(loss):
            self._fail(f"loss became {loss} at epoch {self._epoch + 1}, batch {int(batch) + 1}")

    def on_epoch_end(self, epoch, logs=None):
        """Check every weight once; log the activation ranges re-seeded during the epoch."""
        if not self.enabled:
            return
        if nonfinite_weights(self.model):
            self._fail(f"weights became NaN or Inf during epoch {int(epoch) + 1}")
        fresh = [p for p in _reseeded_quantizers(self.model) if p not in self._reported]
        if fresh:
            self._reported.update(fresh)
            shown = ", ".join(fresh[:_SHOWN]) + (f" and {len(fresh) - _SHOWN} more"
                                                 if len(fresh) > _SHOWN else "")
            logger.warning("tf_bridge: %d activation range(s) clipped most of a training batch and were "
                           "re-seeded from it (see docs/qat-numerics.md): %s", len(fresh), shown)

    def _fail(self, what: str):
        found = nonfinite_weights(self.model)
        if found:
            where = describe_nonfinite(found)
        else:
            where = "every weight is still finite (the forward pass overflowed: check the inputs' scale)"
        raise TrainingError(f"tf_bridge: training of '{self.model.name}' diverged: {what}; {where}; "
                            "train the float model with the same settings to see whether it diverges too, "
                            "then lower the learning rate")


def with_guard(callbacks):
    """``callbacks`` with a [`NonFiniteGuard`][tf_bridge.guard.NonFiniteGuard] added unless it holds one (a
    new list; a ``CallbackList`` is returned unchanged)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    callbacks = list(callbacks or ())
    if not any(isinstance(c, NonFiniteGuard) for c in callbacks):
        callbacks.append(NonFiniteGuard())
    return callbacks


_CALLBACKS_POSITION = 5  # x, y, batch_size, epochs, verbose, callbacks


class _GuardedFit:
    """Mixin: ``fit`` adds a [`NonFiniteGuard`][tf_bridge.guard.NonFiniteGuard] unless the caller gives
    one."""

    def fit(self, *args, **kwargs):
        """``keras.Model.fit`` with a [`NonFiniteGuard`][tf_bridge.guard.NonFiniteGuard] among the callbacks
        (see the module docstring to turn it off)."""
        args = list(args)
        if len(args) > _CALLBACKS_POSITION:
            args[_CALLBACKS_POSITION] = with_guard(args[_CALLBACKS_POSITION])
        else:
            kwargs["callbacks"] = with_guard(kwargs.get("callbacks"))
        return super().fit(*args, **kwargs)


@keras.saving.register_keras_serializable(package="tf_bridge")
class QATFunctional(_GuardedFit, Functional):
    """A Functional QAT model: ``keras.Model`` whose ``fit`` adds a
    [`NonFiniteGuard`][tf_bridge.guard.NonFiniteGuard]."""


@keras.saving.register_keras_serializable(package="tf_bridge")
class QATSequential(_GuardedFit, keras.Sequential):
    """A Sequential QAT model: ``keras.Sequential`` whose ``fit`` adds a
    [`NonFiniteGuard`][tf_bridge.guard.NonFiniteGuard]."""


def _rebuilt(model, functional_class, sequential_class):
    if isinstance(model, keras.Sequential):
        new = sequential_class(list(model._layers), name=model.name, trainable=model.trainable)
    else:
        new = functional_class(model._inputs_struct, model._outputs_struct, name=model.name,
                               trainable=model.trainable)
    if model.compiled:
        new.compile_from_config(model.get_compile_config())
    return new


def guarded(model):
    """The same layers and graph as ``model`` (Functional or Sequential) in a model whose ``fit``
    adds a [`NonFiniteGuard`][tf_bridge.guard.NonFiniteGuard]; ``model`` itself is not changed."""
    if isinstance(model, (QATFunctional, QATSequential)):
        return model
    return _rebuilt(model, QATFunctional, QATSequential)


def unguarded(model):
    """The same layers and graph as a guarded model in a plain ``keras.Model`` / ``keras.Sequential``."""
    if not isinstance(model, (QATFunctional, QATSequential)):
        return model
    return _rebuilt(model, Functional, keras.Sequential)
