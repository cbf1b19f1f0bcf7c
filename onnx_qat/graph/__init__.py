"""The graph model every stage shares: the per-graph index (producers, consumers, constants,
``WEIGHTED_OPS``), the protobuf edits the inserter makes (new nodes and initializers possibly as wire
bytes), and If/Loop/Scan bodies as graphs.

Owns: `index`, `edit`, `wire` (protobuf wire bytes of new nodes and initializers), `ops` (``WEIGHTED_OPS``),
`constants` (the one meaning of "constant"), `subgraphs`, `scale_folds` (per-channel Mul/Add after a
convolution, found and folded into its float weight).
May import: ``onnx_qat.errors`` and ``onnx_qat.io``; nothing of placement, insertion or later stages.
"""
