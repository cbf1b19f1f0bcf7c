"""Models and data for the benchmarks.

* `resnet50` — a Keras ``ResNet50`` with random weights, exported with tf2onnx (built in a child
  process, so TensorFlow never loads into the measuring process). Random weights alone give a network
  whose activations, and quantization errors, grow without bound from block to block, which says
  nothing about a trained model; so the batch-normalization statistics are set from one batch of the
  benchmark data (every channel normalized, as after training) and the last batch normalization of
  each residual branch is scaled by 0.2 (residual branches start small, as in trained ResNets).
* `tiny_cnn` — a small float CNN (Conv/Relu/MaxPool/residual Add/GlobalAveragePool/Gemm) built
  with ``onnx.helper`` for ``--quick`` runs.
* `residual_net` — a synthetic residual net of a given node count for the rewrite benchmark.
* `detector` — a YOLOv8n-shaped one-stage detector (63 Convs with SiLU, C2f blocks with residual
  Adds and Concats, SPPF, an FPN/PAN neck with Resize, three decoupled heads) with random weights whose
  activations stay in range (each Conv's output channels normalised on a batch of the benchmark images,
  as batch normalization after training leaves them), for the sensitivity benchmark.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

RESNET_INPUT = "input"


def images(num: int, size: int, *, seed: int, channels_last: bool = True, channels: int = 3) -> np.ndarray:
    """``num`` random float32 images with values in [0, 255] (NHWC, or NCHW)."""
    shape = (num, size, size, channels) if channels_last else (num, channels, size, size)
    return np.random.default_rng(seed).uniform(0, 255, shape).astype(np.float32)


def resnet50(path: Path, size: int, *, seed: int = 0) -> Path:
    """Write the Keras ResNet50 (``size`` x ``size`` x 3 input, logits output) as ONNX to ``path``."""
    from .measure import python_module, run_process

    path = Path(path)
    if not path.exists():
        run_process(python_module("tools.bench.models", "resnet50", "--size", str(size), "--seed", str(seed),
                                  "--out", str(path)))
    return path


def _export_resnet50(out: Path, size: int, seed: int) -> None:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf
    import tf2onnx

    from onnx_qat.io.models import save_model

    model = build_keras_resnet50(size, seed)
    spec = (tf.TensorSpec((None, size, size, 3), tf.float32, name=RESNET_INPUT),)
    proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=17)
    save_model(proto, out)
    del keras


def build_keras_resnet50(size: int, seed: int = 0):
    """The Keras ResNet50 of `resnet50` (random weights, conditioned batch normalization)."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=1000,
                                        classifier_activation=None)
    bns = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    momenta = [bn.momentum for bn in bns]
    for bn in bns:
        bn.momentum = 0.0  # one training-mode call sets the moving statistics to this batch's
    model(images(16, size, seed=seed + 1000), training=True)
    for bn, momentum in zip(bns, momenta):
        bn.momentum = momentum
        if bn.name.endswith("_3_bn"):
            bn.gamma.assign(bn.gamma.numpy() * 0.2)
    return model


def tiny_cnn(seed: int = 0, size: int = 16):
    """A small float CNN with a dynamic batch: input ``input`` [N, 16, size, size] -> logits [N, 10]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def conv(x, cin, cout, name, k=3):
        w = (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"{name}.w"))
        bias = (rng.standard_normal(cout) * 0.1).astype(np.float32)
        inits.append(numpy_helper.from_array(bias, f"{name}.b"))
        nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}_out"], name=name,
                                      pads=[k // 2] * 4, kernel_shape=[k, k]))
        return f"{name}_out"

    def relu(x, name):
        nodes.append(helper.make_node("Relu", [x], [f"{name}_out"], name=name))
        return f"{name}_out"

    y = relu(conv("input", 16, 32, "stem"), "stem_relu")
    nodes.append(helper.make_node("MaxPool", [y], ["pool_out"], name="pool", kernel_shape=[2, 2],
                                  strides=[2, 2]))
    z = relu(conv("pool_out", 32, 32, "b1"), "b1_relu")
    z = conv(z, 32, 32, "b2")
    nodes.append(helper.make_node("Add", [z, "pool_out"], ["add_out"], name="add"))
    y = relu("add_out", "out_relu")
    nodes.append(helper.make_node("GlobalAveragePool", [y], ["gap_out"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap_out"], ["flat_out"], name="flat"))
    inits.append(numpy_helper.from_array((rng.standard_normal((10, 32)) * 0.3).astype(np.float32), "fc.w"))
    inits.append(numpy_helper.from_array(np.zeros(10, np.float32), "fc.b"))
    nodes.append(helper.make_node("Gemm", ["flat_out", "fc.w", "fc.b"], ["logits"], name="fc", transB=1))
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 16, size, size])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])]
    graph = helper.make_graph(nodes, "tiny_cnn", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def residual_net(nodes: int, channels: int = 16, seed: int = 0, weight_std: float = 0.25):
    """A synthetic residual net of about ``nodes`` nodes: blocks of Conv -> Relu -> Conv -> Add (the block
    input as the skip), each Conv with its own 1x1 weight (normal, standard deviation ``weight_std``)
    and bias; input ``input`` [1, C, 4, 4]. With the default weights the activations grow without
    bound over thousands of blocks (fine for rewriting from given scales); calibration needs
    ``weight_std`` of about 0.04 (each block then adds ~0.03% to the variance).

    Returns ``(model, scale table)`` with an amax for every activation the TensorRT placement quantizes.
    """
    from onnx import TensorProto, helper, numpy_helper

    from onnx_qat.scales import ScaleTable

    rng = np.random.default_rng(seed)
    inits, graph_nodes, x, acts = [], [], "input", {"input": 4.0}
    for i in range(max(1, nodes // 4)):
        for tag in ("a", "b"):
            w = (rng.standard_normal((channels, channels, 1, 1)) * weight_std).astype(np.float32)
            inits.append(numpy_helper.from_array(w, f"w{i}{tag}"))
            inits.append(numpy_helper.from_array(np.zeros(channels, np.float32), f"b{i}{tag}"))
        graph_nodes += [helper.make_node("Conv", [x, f"w{i}a", f"b{i}a"], [f"c{i}"], name=f"conv{i}"),
                        helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"),
                        helper.make_node("Conv", [f"r{i}", f"w{i}b", f"b{i}b"], [f"d{i}"], name=f"conv{i}b"),
                        helper.make_node("Add", [f"d{i}", x], [f"o{i}"], name=f"add{i}")]
        acts[f"r{i}"] = 2.0
        acts[f"o{i}"] = 4.0
        x = f"o{i}"
    shape = [1, channels, 4, 4]
    graph = helper.make_graph(graph_nodes, "residual_net",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    acts.pop(x)  # the graph output is never quantized
    return model, ScaleTable(acts, producer="tools.bench.models.residual_net")


class _Net:
    """A tiny graph writer for `detector` (Conv+SiLU with normalised outputs)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.count = [], [], 0

    def node(self, op, inputs, **attrs):
        from onnx import helper

        self.count += 1
        name = f"{op.lower()}_{self.count}"
        outputs = attrs.pop("outputs", 1)
        outs = [f"{name}_out{i}" if outputs > 1 else f"{name}_out" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=name, **attrs))
        return outs if outputs > 1 else outs[0]

    def const(self, array, tag="c"):
        from onnx import numpy_helper

        self.count += 1
        name = f"{tag}_{self.count}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def conv(self, x, cin, cout, k=1, s=1, act=True):
        w = (self.rng.standard_normal((cout, cin, k, k)) * np.sqrt(1.0 / (cin * k * k))).astype(np.float32)
        y = self.node("Conv", [x, self.const(w, "w"), self.const(np.zeros(cout, np.float32), "b")],
                      kernel_shape=[k, k], strides=[s, s], pads=[k // 2] * 4)
        return self.node("Mul", [y, self.node("Sigmoid", [y])]) if act else y

    def c2f(self, x, cin, cout, n, shortcut=True):
        half = cout // 2
        y = self.conv(x, cin, cout)
        a, b = self.node("Split", [y, self.const(np.array([half, half], np.int64), "split")], axis=1,
                         outputs=2)
        parts, last = [a, b], b
        for _ in range(n):
            z = self.conv(self.conv(last, half, half, 3), half, half, 3)
            last = self.node("Add", [last, z]) if shortcut else z
            parts.append(last)
        return self.conv(self.node("Concat", parts, axis=1), half * (2 + n), cout)

    def up(self, x):
        scales = self.const(np.array([1, 1, 2, 2], np.float32), "scales")
        return self.node("Resize", [x, "", scales], mode="nearest")


def detector(size: int = 320, *, seed: int = 0, classes: int = 80, calib: "np.ndarray | None" = None):
    """A YOLOv8n-shaped detector: ``images`` [N, 3, size, size] -> ``output`` [N, 64 + classes, anchors].

    With ``calib`` (NCHW images in [0, 255]) every Conv's weights and bias are rescaled so its output
    channels have zero mean and unit variance on those images (what trained batch norms do);
    otherwise random weights give activations that shrink or grow from layer to layer.
    """
    import onnx
    from onnx import TensorProto, helper

    n = _Net(seed)
    x = n.node("Mul", ["images", n.const(np.array(1 / 255.0, np.float32), "norm")])
    x = n.conv(n.conv(x, 3, 16, 3, 2), 16, 32, 3, 2)
    x = n.c2f(x, 32, 32, 1)
    p3 = n.c2f(n.conv(x, 32, 64, 3, 2), 64, 64, 2)
    p4 = n.c2f(n.conv(p3, 64, 128, 3, 2), 128, 128, 2)
    p5 = n.c2f(n.conv(p4, 128, 256, 3, 2), 256, 256, 1)
    y = n.conv(p5, 256, 128)
    pools = [y]
    for _ in range(3):
        pools.append(n.node("MaxPool", [pools[-1]], kernel_shape=[5, 5], pads=[2, 2, 2, 2]))
    p5 = n.conv(n.node("Concat", pools, axis=1), 512, 256)
    h4 = n.c2f(n.node("Concat", [n.up(p5), p4], axis=1), 384, 128, 1, shortcut=False)
    h3 = n.c2f(n.node("Concat", [n.up(h4), p3], axis=1), 192, 64, 1, shortcut=False)
    h4 = n.c2f(n.node("Concat", [n.conv(h3, 64, 64, 3, 2), h4], axis=1), 192, 128, 1, shortcut=False)
    h5 = n.c2f(n.node("Concat", [n.conv(h4, 128, 128, 3, 2), p5], axis=1), 384, 256, 1, shortcut=False)
    heads = []
    for feat, ch in ((h3, 64), (h4, 128), (h5, 256)):
        box = n.conv(n.conv(n.conv(feat, ch, 64, 3), 64, 64, 3), 64, 64, act=False)
        cls = n.conv(n.conv(n.conv(feat, ch, 80, 3), 80, 80, 3), 80, classes, act=False)
        both = n.node("Concat", [box, cls], axis=1)
        heads.append(n.node("Reshape", [both, n.const(np.array([0, 64 + classes, -1], np.int64), "shape")]))
    n.nodes.append(helper.make_node("Concat", heads, ["output"], name="head_concat", axis=2))
    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, size, size])
    output = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 64 + classes, "A"])
    graph = helper.make_graph(n.nodes, "detector", [images], [output], n.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if calib is not None:
        _normalise_convs(model, calib)
    onnx.checker.check_model(model)
    return model


def _normalise_convs(model, calib: np.ndarray) -> None:
    """Rescale each Conv (in graph order) so its output channels are standardised on ``calib``."""
    import onnxruntime as ort
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    convs = [node for node in model.graph.node if node.op_type == "Conv"]
    for node in convs:
        probe = type(model)()
        probe.CopyFrom(model)
        del probe.graph.output[:]
        probe.graph.output.add(name=node.output[0])
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        y = session.run(None, {"images": calib})[0]
        mean, std = y.mean(axis=(0, 2, 3)), y.std(axis=(0, 2, 3)) + 1e-3
        w = numpy_helper.to_array(inits[node.input[1]]) / std[:, None, None, None]
        b = (numpy_helper.to_array(inits[node.input[2]]) - mean) / std
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(w.astype(np.float32), node.input[1]))
        inits[node.input[2]].CopyFrom(numpy_helper.from_array(b.astype(np.float32), node.input[2]))


#: ``keras.applications`` models `keras_app` exports (``weights=None``).
KERAS_APPS = ("ResNet50", "MobileNetV2", "EfficientNetB0", "ConvNeXtTiny")


def keras_app(name: str, path: Path, size: int, *, seed: int = 0) -> Path:
    """Write ``keras.applications.<name>(weights=None)`` (``size`` x ``size`` x 3 input, inputs 0..255,
    logits output; converted by ``tf_bridge.convert.convert_float_twin``) as ONNX to ``path`` (in a
    child process, once); its batch normalization statistics are set from one batch of 0..255 images
    (training-mode call with momentum 0), so activations keep the magnitudes a trained network has
    instead of shrinking."""
    from .measure import python_module, run_process

    path = Path(path)
    if not path.exists():
        run_process(python_module("tools.bench.models", "keras-app", "--name", name, "--size", str(size),
                                  "--seed", str(seed), "--out", str(path)))
    return path


def _export_keras_app(name: str, out: Path, size: int, seed: int) -> None:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    from onnx_qat.io.models import save_model
    from tf_bridge.convert import convert_float_twin

    keras.utils.set_random_seed(seed)
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=1000,
                                              classifier_activation=None)
    bns = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
    momenta = [bn.momentum for bn in bns]
    for bn in bns:
        bn.momentum = 0.0
    model(images(16, size, seed=seed + 1000), training=True)
    for bn, momentum in zip(bns, momenta):
        bn.momentum = momentum
    save_model(convert_float_twin(model, 17), out)  # the project's conversion (GELU, depthwise...)


def main(argv=None) -> int:
    """``python -m tools.bench.models resnet50 --size S --out P``: export the benchmark ResNet50;
    ``python -m tools.bench.models keras-app --name NAME --size S --out P``: one of `KERAS_APPS`."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.models")
    parser.add_argument("which", choices=["resnet50", "keras-app"])
    parser.add_argument("--name", choices=KERAS_APPS, default="ResNet50")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.which == "resnet50":
        _export_resnet50(Path(args.out), args.size, args.seed)
    else:
        _export_keras_app(args.name, Path(args.out), args.size, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
