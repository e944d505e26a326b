"""What ep's ranks share, and how each side reads it: the receive regions' layout (``regions``),
the host mailboxes (``mailbox``), the arrival flags in pinned memory (``flags``), the words that
name a call (``words``), a rank's published header (``info``), a dispatch's plan (``handle``)
and the FP8 row format (``fp8``). Formats and their checks; the steps that use them are
ep.paths' and ep.protocol's.
"""
