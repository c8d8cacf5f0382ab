"""The daemon's shared model: the `Core` its parts share, a `Command`, a `Region` and its
outcome, and the events its observers subscribe to (`events`, `fanout`)."""
