"""Command-line interface: ``warmlink demo | bench | doctor``."""
