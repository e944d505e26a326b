"""ep's normal-mode rounds: ``normal.NormalMode`` owns a dispatch's and a combine's steps, over
the mailbox meetings and checks of ``rounds`` (Note [Round protocol]) and the argument checks of
``checks``, driving the Buffer's data path (ep.paths); ``streamed.StreamedMode`` a streamed Buffer's
calls, which meet no peer on the host (Note [Streamed calls]).
"""
