"""ep's device steps: each a Triton kernel on CUDA and the same function in torch ops elsewhere.

``layout`` (DeepEP's ``get_dispatch_layout``), ``steps`` (plan, gather, unpack, exchange, push:
what a dispatch launches), ``programs`` (the Triton source), ``reduce`` (the combine's sums),
``call_block`` (what graph-replayed launches read per call), ``launch`` (launching them
cheaply), ``sum_programs`` (the combine sum's Triton source), and ``stream`` /
``stream_programs`` with ``stream_combine`` / ``stream_combine_programs`` (a dispatch and its
combine streamed through fixed rings with device-checked credits: a streamed Buffer's, ep.paths.streamed)
and ``stream_counts`` (what that Buffer keeps on the device between calls). Nothing here knows of
rounds, peers or mailboxes: callers pass addresses and counts.
"""
