"""Speculative decoding inside the one scheduler: proposers (``proposer``) draft tokens after
each step; the next step verifies them as known tokens of the request (``app.engine.sampler``
accepts greedily or by lossless rejection sampling) and ``verify`` rolls back what the
rejected ones wrote. The draft step of the checkpoint's drafters is one static-shape function
(``step``) that CUDA graphs capture per batch bucket (``graphs``)."""
