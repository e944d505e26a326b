"""Suite-wide settings.

Hypothesis keeps no example database: a failure found on one machine is reported with its
reproducing blob, but never replayed on the next run, so a run's outcome depends only on the code.
"""

from hypothesis import settings

settings.register_profile("warmlink", database=None, print_blob=True)
settings.load_profile("warmlink")
