"""Warm GPU context processes that run Python commands as if they were fresh processes."""
