"""New nodes and initializers as protobuf wire bytes, made without one Python protobuf object each.

A rewrite from given scales adds tens of thousands of QuantizeLinear/DequantizeLinear nodes and
scale, zero-point and weight initializers. Constructing each as an ``onnx.NodeProto`` or
``onnx.TensorProto`` and then copying it into the result's graph costs several microseconds per
object (measured on the 50,000-node residual net: a NodeProto 4-4.5 us, copying it into a graph
1.2 us); formatting its few fields as wire bytes from a fixed template costs about 1.5 us, and the
whole graph is then parsed once (`GraphEdit.commit`, with ``encoded=True``). The bytes are exactly
what the protobuf library writes for the same fields: the result parses into the same messages, so
the model saved from it is the same file byte for byte (``tests/onnx_qat/test_graph_wire.py``).

The protobuf wire format (https://protobuf.dev/programming-guides/encoding/): each field is a tag
(field number << 3 | wire type) as a varint, then a varint value (type 0) or a varint length and
that many bytes (type 2). Field numbers are those of ``onnx.proto``: NodeProto input 1, output 2,
name 3, op_type 4, attribute 5, domain 7; AttributeProto name 1, i 3, type 20; TensorProto dims 1,
data_type 2, name 8, raw_data 9; GraphProto node 1, initializer 5.
"""
from __future__ import annotations

from itertools import chain
from typing import NamedTuple, Sequence

#: Tags of the fields written here (wire type 2, length-delimited, unless said otherwise).
NODE_INPUT, NODE_OUTPUT, NODE_NAME, NODE_OP_TYPE, NODE_ATTRIBUTE, NODE_DOMAIN = (
    b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x2a", b"\x3a")
TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_NAME, TENSOR_RAW = b"\x08", b"\x10", b"\x42", b"\x4a"  # 1, 2: varints
GRAPH_NODE, GRAPH_INITIALIZER = b"\x0a", b"\x2a"
_ATTR_NAME, _ATTR_I, _ATTR_TYPE_INT = b"\x0a", b"\x18", b"\xa0\x01\x02"  # type (field 20) = INT (2)

_SMALL = [bytes((n,)) for n in range(128)]


def varint(value: int) -> bytes:
    """``value`` as a protobuf varint (a negative int64 as its 64-bit two's complement: 10 bytes)."""
    if 0 <= value < 128:
        return _SMALL[value]
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 127:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: ``tag``, the length of ``payload``, ``payload``."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 128 else varint(n)) + payload


def string(tag: bytes, text: str) -> bytes:
    """A string field (UTF-8)."""
    data = text.encode()
    n = len(data)
    return tag + (_SMALL[n] if n < 128 else varint(n)) + data


def int_attribute(name: str, value: int) -> bytes:
    """An AttributeProto of type INT named ``name`` holding ``value``, as bytes."""
    return string(_ATTR_NAME, name) + _ATTR_I + varint(int(value)) + _ATTR_TYPE_INT


def node(op_type: str, name: str, inputs: Sequence[str], outputs: Sequence[str],
         attributes: Sequence[bytes] = (), domain: str = "") -> bytes:
    """A NodeProto's bytes (``attributes``: each an AttributeProto's bytes, e.g. `int_attribute`), as
    ``onnx.NodeProto(op_type=..., name=..., input=..., output=...)`` holds them: ``name`` is written
    even when empty (a proto2 field given is set), ``domain`` only when not empty.

    Names of ASCII characters shorter than 128 (a one-byte length; nearly every name) are formatted
    in one step from a template per input and output count."""
    strings = (*inputs, *outputs, name, op_type)
    text = "".join(strings)
    if text.isascii() and max(map(len, strings)) < 128:
        key = (len(inputs), len(outputs))
        template = _TEMPLATES.get(key)
        if template is None:
            template = _TEMPLATES[key] = node_template(*key)
        args = []
        for item in strings:
            args += (len(item), item)
        head = (template % tuple(args)).encode()
    else:
        parts = [string(NODE_INPUT, t) for t in inputs]
        parts.extend(string(NODE_OUTPUT, t) for t in outputs)
        parts.append(string(NODE_NAME, name))
        parts.append(string(NODE_OP_TYPE, op_type))
        head = b"".join(parts)
    if attributes:
        head += b"".join(field(NODE_ATTRIBUTE, a) for a in attributes)
    if domain:
        head += string(NODE_DOMAIN, domain)
    return head


_TEMPLATES: dict = {}


def node_template(inputs: int, outputs: int, op_type: str = "") -> str:
    """The ``%``-format string of a NodeProto's head as `node` writes it for ASCII names shorter than
    128 characters: per input, per output and for the name a ``%c%s`` pair (length, text) after the
    field's tag, then the op type: another such pair, or ``op_type`` itself written in (likewise ASCII
    and shorter than 128), for callers that format many nodes of one op type."""
    op = "\"%c%s" if not op_type else f"\"{chr(len(op_type))}{op_type}"
    return "\n%c%s" * inputs + "\x12%c%s" * outputs + "\x1a%c%s" + op


def tensor(name: str, data_type: int, raw: bytes, dims: Sequence[int] = ()) -> bytes:
    """A TensorProto's bytes: ``dims`` (each a varint field, as protobuf writes a proto2 repeated
    int64), ``data_type``, ``name`` and ``raw`` as its ``raw_data``, as
    ``onnx.TensorProto(name=..., data_type=..., dims=..., raw_data=...)`` holds them (a ``raw_data``
    given is written even when empty)."""
    data = name.encode()
    n, r = len(data), len(raw)
    if n < 128 and 0 <= data_type < 128:  # one formatting step, the dims' bytes made once per shape
        key = dims if type(dims) is tuple else tuple(dims)
        head = _DIMS.get(key)
        if head is None:
            head = _dims(key)
        length = _LENGTHS.get(r) or _length(r)
        return b"%s\x10%c\x42%c%s\x4a%s%s" % (head, data_type, n, data, length, raw)
    parts = [TENSOR_DIMS + varint(int(d)) for d in dims]
    parts.append(TENSOR_DATA_TYPE + varint(int(data_type)))
    parts.append(field(TENSOR_NAME, data))
    parts.append(field(TENSOR_RAW, raw))
    return b"".join(parts)


#: Shape -> the bytes of its ``dims`` fields, for the shapes `tensor` has met (at most `_MAX_SHAPES`).
_DIMS: dict = {(): b""}
_MAX_SHAPES = 4096


def _dims(dims: tuple) -> bytes:
    head = b"".join([TENSOR_DIMS + varint(int(d)) for d in dims])
    if len(_DIMS) < _MAX_SHAPES:
        _DIMS[dims] = head
    return head


def framed(tag: bytes, payloads) -> bytes:
    """The repeated length-delimited field ``tag`` holding each of ``payloads`` in turn, as one bytes.

    Each payload's head (``tag`` and its length's varint) is looked up by length in C (`_heads`), and the
    heads and payloads are joined once: no payload is copied but into the result."""
    payloads = payloads if type(payloads) is list else list(payloads)
    lengths = list(map(len, payloads))
    heads_of = _heads(tag)
    heads = list(map(heads_of.get, lengths))
    if None in heads:  # a length not met yet with this tag
        heads = [head if head is not None else tag + (_LENGTHS.get(n) or _length(n))
                 for head, n in zip(heads, lengths)]
        if len(heads_of) < 16384:
            heads_of.update(zip(lengths, heads))
    return b"".join(chain.from_iterable(zip(heads, payloads)))


#: Tag -> {length -> the tag and the length's varint}, for `framed`.
_HEADS: dict = {}


def _heads(tag: bytes) -> dict:
    found = _HEADS.get(tag)
    if found is None:
        found = _HEADS[tag] = {}
    return found


#: Length -> its varint, for the lengths `framed` has met (most payloads of a graph share a few lengths).
_LENGTHS = dict(enumerate(_SMALL))


def _length(n: int) -> bytes:
    """``varint(n)``, kept in `_LENGTHS` when it takes two bytes (under 16384: the cache stays small)."""
    found = varint(n)
    if n < 16384:
        _LENGTHS[n] = found
    return found


class EncodedNode(NamedTuple):
    """A new node held as its wire bytes (``encoded``), with the fields the edit and the rewrite read
    as plain Python values: ``op_type``, ``name``, ``input``, ``output`` (tuples), and ``domain`` (``""``)
    and ``attribute`` (empty: only the bytes hold an ``axis`` or a ``block_size``, which no reader of
    a new node asks for).

    It stands where a NodeProto would in `GraphEdit`'s queues and lookups (its producer map, the read
    counts of its commit). It cannot be edited: an edit that changes new nodes after insertion, such
    as the ``ort-cpu`` form's folds, works on NodeProtos (``GraphEdit(model)``, without ``encoded``).
    Make one with ``tuple.__new__(EncodedNode, (op_type, name, inputs, outputs, encoded))`` where the
    cost of a call counts (the inserter), or `encode_node`.
    """

    op_type: str
    name: str
    input: tuple
    output: tuple
    encoded: bytes

    domain = ""
    attribute = ()

    def proto(self):
        """The node as an ``onnx.NodeProto`` (parsed from its bytes)."""
        import onnx

        return onnx.NodeProto.FromString(self.encoded)


class EncodedTensor(NamedTuple):
    """A new initializer held as its wire bytes (``encoded``), with its ``name`` and ``data_type``."""

    name: str
    data_type: int
    encoded: bytes

    def proto(self):
        """The initializer as an ``onnx.TensorProto`` (parsed from its bytes)."""
        import onnx

        return onnx.TensorProto.FromString(self.encoded)


def encode_node(op_type: str, name: str, inputs: Sequence[str], outputs: Sequence[str],
                attributes: Sequence[bytes] = ()) -> EncodedNode:
    """An `EncodedNode` of the default domain (see `node`)."""
    return EncodedNode(op_type, name, tuple(inputs), tuple(outputs),
                       node(op_type, name, inputs, outputs, attributes))


def encode_tensor(name: str, data_type: int, raw: bytes, dims: Sequence[int] = ()) -> EncodedTensor:
    """An `EncodedTensor` (see `tensor`)."""
    return EncodedTensor(name, data_type, tensor(name, data_type, raw, dims))


__all__ = ["EncodedNode", "EncodedTensor", "encode_node", "encode_tensor", "field", "framed", "int_attribute",
           "node", "node_template", "string", "tensor", "varint"]
