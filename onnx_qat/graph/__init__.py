"""The graph model every stage shares: the per-graph index (producers, consumers, constants,
``WEIGHTED_OPS``), the protobuf edits the inserter makes, and If/Loop/Scan bodies as graphs.

Owns: :mod:`.index`, :mod:`.edit`, :mod:`.subgraphs`.
May import: ``onnx_qat.errors`` and ``onnx_qat.io``; nothing of placement, insertion or later stages
(except :mod:`.subgraphs`, which runs the one inserter on each body).
"""
