"""ep's facade: ``buffer.Buffer`` (re-exported as ``warmlink.ep.Buffer``), its options, and the
diagnostics ``warmlink bench ep`` reads.
"""
