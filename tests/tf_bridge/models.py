"""Tiny Keras models the tf_bridge tests share."""
import keras
import numpy as np


def randomize_bn(model, seed=0):
    """Non-trivial BatchNorm statistics (seeded), so that tf2onnx's fold changes the Conv weights."""
    import tf_bridge

    rng = np.random.default_rng(seed)
    for layer in tf_bridge.spec.iter_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            g, b, m, v = layer.get_weights()
            layer.set_weights([rng.uniform(0.5, 1.5, g.shape).astype("f"),
                               rng.normal(0, .1, b.shape).astype("f"),
                               rng.normal(0, .1, m.shape).astype("f"),
                               rng.uniform(0.5, 1.5, v.shape).astype("f")])
    return model


def single_layer_model(layer, input_shape):
    """Input -> layer, as a Functional model."""
    inp = keras.Input(input_shape, name="x")
    return keras.Model(inp, layer(inp), name="single")


def mixed_cnn(input_shape=(32, 32, 3), classes=4):
    """Conv2D, DepthwiseConv2D, SeparableConv2D, Conv2DTranspose, BN, two residual Adds, Dense."""
    L = keras.layers
    inp = keras.Input(input_shape, name="image")
    x = L.Conv2D(16, 3, strides=2, padding="same", use_bias=False, name="stem_conv")(inp)
    x = L.BatchNormalization(name="stem_bn")(x)
    x = L.ReLU(name="stem_relu")(x)
    y = L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(x)
    y = L.BatchNormalization(name="dw_bn")(y)
    y = L.ReLU(name="dw_relu")(y)
    y = L.Conv2D(16, 1, use_bias=False, name="pw")(y)
    y = L.BatchNormalization(name="pw_bn")(y)
    x = L.Add(name="add1")([x, y])
    x = L.ReLU(name="add1_relu")(x)
    y = L.SeparableConv2D(16, 3, padding="same", name="sep")(x)
    y = L.BatchNormalization(name="sep_bn")(y)
    x = L.Add(name="add2")([x, y])
    x = L.ReLU(name="add2_relu")(x)
    x = L.Conv2DTranspose(8, 3, strides=2, padding="same", name="up")(x)
    x = L.ReLU(name="up_relu")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    out = L.Dense(classes, name="logits")(x)
    return keras.Model(inp, out, name="mixed_cnn")


def blobs(n=256, shape=(32, 32, 3), classes=4, seed=0):
    """A learnable toy task: each class is a different mean colour plus noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    centers = rng.normal(0, 1, (classes, shape[-1])).astype("float32")
    x = rng.normal(0, 0.5, (n, *shape)).astype("float32") + centers[y][:, None, None, :]
    return x.astype("float32"), y.astype("int64")
