"""How ep's bytes move, one data path per Buffer, chosen once (``senders``: SMs, copy engines, or
host copies over shared memory; ``streamed``: the streamed space), with the movers under them (``cuda_mover``, ``host_mover``,
``sm_pushes``), the combine's sends and sums (``combine``), the views a dispatch returns
(``outputs``), the communication stream (``comm_stream``, ``event``) and what a Buffer leases
and connects once (``setup``). A path moves bytes when told; the order of a round's steps is
ep.protocol's.
"""
