"""The graph model every stage shares: the per-graph index (producers, consumers, constants,
``WEIGHTED_OPS``), the protobuf edits the inserter makes, and If/Loop/Scan bodies as graphs.

Owns: `index`, `edit`, `ops` (``WEIGHTED_OPS``), `constants` (the one meaning of "constant"),
`subgraphs`.
May import: ``onnx_qat.errors`` and ``onnx_qat.io``; nothing of placement, insertion or later stages.
"""
