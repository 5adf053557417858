"""The parts ``streaming.StreamingEngine`` is made of, one concern each.

- ``weights.WeightStreamer``: layer weights into two device slots on the H2D stream.
- ``activations.ActivationStash``: saved layer inputs (offload to host, bf16 rounding rule).
- ``..segments.SegmentTracker``: which layers are checkpoint-segment followers.
- ``gradients.GradientSink`` (with ``staging.GradStaging``): gradients to the host store, the
  data-parallel reduce, the global norm.
- ``updates.UpdateScheduler``: the background host update and weight versions (data parallel).

No ``transformers`` import here.
"""
